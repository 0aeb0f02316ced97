"""codec="zstd": lossless, read by blocks of rows, a damaged block refused and named.

The ground truths: the tensors given to the writer, the same store written without a codec,
the blocks a read must touch computed from the rows asked (``row // rows_per_block``), and
the HTTP ranges an S3 server (moto's) was asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import lightning_iocatch.store.backends.coded as coded_module
import lightning_iocatch.store.shard_codec as shard_codec
from lightning_iocatch import FeatureStore, FeatureWriter, StoreError, StoreRows
from lightning_iocatch.cli import main
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.s3_server import S3Server

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}
ROWS, WIDTH = 96, 64  # float32 rows of 256 bytes: blocks of 4 rows at 1 KiB


def data() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(ROWS, WIDTH, generator=generator),
        "bf16": torch.randn(ROWS, 3, WIDTH, generator=generator).to(torch.bfloat16),
        "ids": torch.randint(0, 50_000, (ROWS,), generator=generator),
        "empty": torch.zeros(ROWS, 0),
    }


def write(path: str | Path, tensors: dict[str, torch.Tensor], **options: Any) -> None:
    plan = prepare_store(path, "create", SETTINGS, storage_options=options.get("storage_options"))
    writer = ShardWriter(path, rank=0, plan=plan, **options)
    for first in range(0, ROWS, 32):  # 3 batches, in one shard
        batch = {key: tensor[first : first + 32] for key, tensor in tensors.items()}
        writer.write(batch | {"scalar": torch.tensor(float(first))}, list(range(first, first + 32)))
    writer.close()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_codec, "BLOCK_BYTES", 1024)


def decoded_blocks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The blocks decoded from here on, as ``"tensor block"``."""
    seen: list[str] = []
    decode = coded_module.decode_block

    def counting(raw: Any, info: Any, block: int, shuffle: bool, where: str, **how: Any) -> Any:
        seen.append(where.split(" tensor ")[1].replace("'", "").replace(" block", ""))
        return decode(raw, info, block, shuffle, where, **how)

    monkeypatch.setattr(coded_module, "decode_block", counting)
    return seen


def test_a_coded_store_reads_exactly_what_was_written(tmp_path: Path) -> None:
    tensors = data()
    write(tmp_path / "plain", tensors)
    write(tmp_path / "zstd", tensors, codec="zstd")
    plain, coded = FeatureStore(tmp_path / "plain"), FeatureStore(tmp_path / "zstd")
    for key, tensor in tensors.items():
        assert coded[key].dtype == tensor.dtype and torch.equal(coded[key], tensor), key
    assert [t.item() for _, t in coded.batches("scalar")] == [0.0, 32.0, 64.0]
    assert torch.equal(coded.rows_at("bf16", [95, 0, 41]).rows, tensors["bf16"][[95, 0, 41]])
    assert coded.metadata["keys"] == plain.metadata["keys"]
    batch = next(iter(StoreRows(tmp_path / "zstd", ["f32", "bf16"], batch_size=40, seed=1)))
    rows = batch["f32"][:, 0]
    order = torch.tensor([int((tensors["f32"][:, 0] == v).nonzero()) for v in rows])
    assert torch.equal(batch["bf16"], tensors["bf16"][order])
    (record,) = read_ledgers(tmp_path / "zstd")
    assert record.codec == "zstd" and record.bytes < plain.metadata["bytes"]
    with safe_open(tmp_path / "zstd" / record.file, framework="pt") as shard:
        meta = json.loads(shard.metadata()["codec"])
    assert meta["tensors"]["b0/f32"]["rows"] == 4 and len(meta["tensors"]["b0/f32"]["sizes"]) == 8
    coded.verify()


def test_fp8_with_zstd_reads_as_fp8_without_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"x": data()["f32"] * 100}
    write(tmp_path / "plain", tensors, dtype="float8_e4m3fn")
    write(tmp_path / "zstd", tensors, dtype="float8_e4m3fn", codec="zstd")
    plain, coded = FeatureStore(tmp_path / "plain")["x"], FeatureStore(tmp_path / "zstd")["x"]
    assert coded.dtype == torch.float32 and torch.equal(coded, plain)
    batch = next(iter(StoreRows(tmp_path / "zstd", "x", batch_size=ROWS, shuffle=False)))
    assert torch.equal(batch["x"], plain)
    assert main(["inspect", str(tmp_path / "zstd")]) == 0
    out = capsys.readouterr().out
    assert "codec      zstd (lossless" in out and "float8_e4m3fn (scaled per row)" in out
    plan = prepare_store(tmp_path / "zstd", "resume", SETTINGS)  # reads the coded indices
    writer = ShardWriter(tmp_path / "zstd", rank=0, plan=plan, codec="zstd", dtype="float8_e4m3fn")
    more = torch.randn(8, WIDTH)
    assert writer.write({"x": torch.cat([tensors["x"][-4:], more])}, list(range(92, 104))) == 8
    writer.close()
    store = FeatureStore(tmp_path / "zstd")
    assert torch.equal(store.indices, torch.arange(104))
    assert torch.equal(store["x"][:ROWS], plain)


def test_a_read_of_some_rows_decodes_only_their_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, data(), codec="zstd")
    store = FeatureStore(tmp_path)
    seen = decoded_blocks(monkeypatch)
    store.rows_at("f32", [70, 5, 6])  # rows 5, 6 of batch 0 (block 1); 6 of batch 2 (block 1)
    assert sorted(seen) == ["b0/__index__ 0", "b0/f32 1", "b2/__index__ 0", "b2/f32 1"]
    seen.clear()
    rows = StoreRows(tmp_path, "f32", batch_size=2, shuffle=False)
    next(iter(rows))  # rows 0 and 1: one block of b0/f32
    assert seen == ["b0/f32 0"]


def test_ranged_reads_on_s3_fetch_only_the_blocks_of_the_rows_asked(
    server: S3Server, bucket: str
) -> None:
    url, options = f"s3://{bucket}/run", server.storage_options()
    tensors = {"f32": torch.randn(ROWS, 4096)}  # rows of 16 KiB: a block per row
    write(url, tensors, codec="zstd", storage_options=options)
    store = FeatureStore(url, storage_options=options)
    server.taken()
    rows = store.rows_at("f32", [3, 90])
    assert torch.equal(rows.rows, tensors["f32"][[3, 90]])
    ranges = [r.range for r in server.taken() if r.method == "GET" and r.range]
    asked = sum(int(b) - int(a) + 1 for a, b in (r.split("=")[1].split("-") for r in ranges))
    assert 0 < asked < 4 * 17_000, ranges  # two rows' blocks (and indices), not the shard
    batch = next(iter(StoreRows(url, "f32", batch_size=ROWS, storage_options=options)))
    assert torch.equal(batch["f32"].sort(0).values, tensors["f32"].sort(0).values)


def damage(path: Path, tensor: str, block: int) -> None:
    """Flip a byte in the middle of ``block`` of ``tensor``'s compressed bytes."""
    (record,) = read_ledgers(path)
    raw = (path / record.file).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    sizes = json.loads(header["__metadata__"]["codec"])["tensors"][tensor]["sizes"]
    start = 8 + int.from_bytes(raw[:8], "little") + header[tensor]["data_offsets"][0]
    place = start + sum(sizes[:block]) + sizes[block] // 2
    (path / record.file).write_bytes(raw[:place] + bytes([raw[place] ^ 0x10]) + raw[place + 1 :])


def test_a_damaged_block_is_refused_and_named_by_inspect_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = data()
    write(tmp_path, tensors, codec="zstd")
    damage(tmp_path, "b1/f32", 3)
    store = FeatureStore(tmp_path)
    assert torch.equal(store.rows_at("f32", [32, 33]).rows, tensors["f32"][32:34])  # block 0
    with pytest.raises(StoreError, match=r"tensor 'b1/f32' block 3 is damaged"):
        store["f32"]
    with pytest.raises(StoreError, match=r"tensor 'b1/f32' block 3 is damaged"):
        store.rows_at("f32", [32 + 13])
    assert main(["inspect", str(tmp_path), "--verify"]) == 2  # an error, in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'b1/f32' block 3 is damaged" in err[0], err


def test_a_missing_zstandard_and_an_unknown_codec_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"`codec` must be one of \('zstd',\) or None, got 'lz4'"):
        FeatureWriter(tmp_path, codec="lz4")
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pip install lightning-iocatch\[zstd\]"):
        FeatureWriter(tmp_path, codec="zstd")


@pytest.mark.parametrize("start", ["fork", "spawn"])  # spawn pickles the decoded blocks' cache
def test_a_trainer_dump_in_fp8_with_zstd_reads_through_dataloader_workers(
    tmp_path: Path, start: str
) -> None:
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_iocatch import IOCaptureCallback
    from tests.lightning_models import TinyModule, loader, trainer

    seen: list[torch.Tensor] = []
    torch.manual_seed(0)
    module = TinyModule(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    module.model[0].register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    writer = FeatureWriter(tmp_path, dtype=torch.float8_e4m3fn, codec="zstd")
    callback = IOCaptureCallback("outputs[model.0]", writer=writer)
    trainer([callback]).predict(module, loader(20, 6), return_predictions=False)
    truth = torch.cat(seen).double()
    store = FeatureStore(tmp_path)
    read = store["model.0/outputs"]
    scale = truth.abs().amax(1, keepdim=True) / 448
    bound = torch.maximum(truth.abs() * 2.0**-4, scale * 2.0**-9) * (1 + 1e-6)
    assert read.dtype == torch.float32 and ((read.double() - truth).abs() <= bound).all()
    rows = StoreRows(tmp_path, "model.0/outputs", batch_size=7, with_indices=True, seed=2)
    workers = DataLoader(rows, batch_size=None, num_workers=2, multiprocessing_context=start)
    batches = list(workers)
    index = torch.cat([b["index"] for b in batches])
    assert sorted(index.tolist()) == list(range(20))
    assert torch.equal(torch.cat([b["model.0/outputs"] for b in batches]), read[index])
