"""store.py and ledger.py: what the real writer wrote is read exactly; damage is refused.

Stores are written by FeatureWriter through a real Trainer predict, then damaged by hand.
The truth is a manual forward of the same model, the tensors a hand-made store was built
from, and the bytes on disk: never the reader itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader

import lightning_iocatch.store.backends.local as local_backend
import lightning_iocatch.store.backends.local_records as local_records
from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.cli import main
from lightning_iocatch.store.backends.local_files import write_json_atomic
from lightning_iocatch.store.backends.local_records import (
    append_ledger,
    drop_torn_tail,
    file_crc32,
    read_ledgers,
)
from lightning_iocatch.store.names import (
    FORMAT,
    STORE_FILE,
    ledger_name,
    shard_name,
    shard_rank_and_seq,
)
from lightning_iocatch.store.records import BatchRecord, ShardRecord
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer

SPEC = "inputs[head]|outputs[model.layers.1]"
KEY = "model.layers.1/outputs"
N = 30
LEDGER = ledger_name(0)


def dump(
    path: Path, module: TinyModule, data: DataLoader, spec: str = SPEC, **options: Any
) -> None:
    writer = FeatureWriter(path, **options)
    trainer([IOCaptureCallback(spec, writer=writer)]).predict(
        module, data, return_predictions=False
    )


def transplant(source: Path, target: Path, rank: int) -> None:
    """Add ``source``'s committed shards to ``target`` as shards of ``rank``, after its own."""
    seqs = [shard_rank_and_seq(r.file) for r in read_ledgers(target) if r.rank == rank]
    seq = max((named[1] for named in seqs if named), default=-1) + 1
    for record in read_ledgers(source):
        name = shard_name(rank, seq)
        seq += 1
        shutil.copyfile(source / record.file, target / name)
        moved = dataclasses.replace(record, file=name, rank=rank)
        append_ledger(target / ledger_name(rank), moved)


def rewrite_record(path: Path, line: int, **changes: Any) -> None:
    """Replace ledger line ``line`` (from 1) by its record with ``changes``, checksummed anew."""
    lines = (path / LEDGER).read_bytes().splitlines(keepends=True)
    record = ShardRecord.from_json(lines[line - 1].decode(), version=3)
    lines[line - 1] = (dataclasses.replace(record, **changes).to_json() + "\n").encode()
    (path / LEDGER).write_bytes(b"".join(lines))


def first_shard(path: Path) -> str:
    return read_ledgers(path)[0].file


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A 30-sample dump in 4 shards of 2 batches (of 4 samples, the very last of 2)."""
    torch.manual_seed(0)
    module = TinyModule()
    path = tmp_path_factory.mktemp("reader") / "store"
    dump(path, module, loader(N, 4), max_shard_bytes=500)
    return path, manual_outputs(module, dataset(N).tensors[0])[1]


@pytest.fixture
def store(pristine: tuple[Path, torch.Tensor], tmp_path: Path) -> Path:
    """A fresh copy of the pristine store, to damage."""
    return Path(shutil.copytree(pristine[0], tmp_path / "store"))


@pytest.fixture
def expected(pristine: tuple[Path, torch.Tensor]) -> torch.Tensor:
    return pristine[1]


def inspect(path: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``lightning-iocatch inspect`` in this process (a traceback would fail the test)."""
    code = main(["inspect", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


# The format: record checksums


def test_record_checksum_is_the_crc32_of_the_canonical_line(store: Path) -> None:
    assert json.loads((store / STORE_FILE).read_text())["format"] == FORMAT
    lines = (store / LEDGER).read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        record = json.loads(line)
        check = record.pop("record_crc32")
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
        assert check == zlib.crc32(canonical.encode())


def test_every_single_bit_flip_in_a_ledger_is_refused(store: Path) -> None:
    original = read_ledgers(store)
    data = (store / LEDGER).read_bytes()
    lines = data.splitlines(keepends=True)
    positions = [*range(len(lines[0])), *range(len(data) - len(lines[-1]), len(data))]
    refused = 0
    for position in positions:  # the first line, and the last with the ledger's last newline
        for bit in range(8):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            (store / LEDGER).write_bytes(bytes(flipped))
            try:
                records = read_ledgers(store)
            except StoreError as error:
                assert "ledger-r000.jsonl line" in str(error)
                refused += 1
            else:  # only a change that means the same (none here) may pass
                assert records == original, (position, bit)
    assert refused == 8 * len(positions)


def test_records_without_checksum_are_read_in_format_1_stores_only(
    store: Path, expected: torch.Tensor
) -> None:
    lines = []
    for line in (store / LEDGER).read_text().splitlines():
        record = json.loads(line)  # as format /1 wrote it: no checksum, no index summaries
        del record["record_crc32"]
        for batch in record["batches"]:
            del batch["index"]
        lines.append(json.dumps(record) + "\n")
    (store / LEDGER).write_text("".join(lines))
    with pytest.raises(StoreError, match="line 1 is damaged: it has no record_crc32"):
        FeatureStore(store)
    info = json.loads((store / STORE_FILE).read_text())
    (store / STORE_FILE).write_text(json.dumps({**info, "format": "lightning-iocatch-store/1"}))
    assert torch.equal(FeatureStore(store)[KEY], expected)
    (store / LEDGER).write_text("".join(lines).replace('"rows": 4', '"rows": 3', 1))
    with pytest.raises(StoreError, match="disagrees with its ledger record"):
        FeatureStore(store)  # without a checksum, the shard's header still catches it


# The last line: counted by the reader and the resume alike, or by neither


def resume(path: Path, module_seed: int = 0) -> None:
    torch.manual_seed(module_seed)
    dump(path, TinyModule(), loader(N, 4), mode="resume", max_shard_bytes=500)


def ledger_rows(path: Path) -> int:
    """Rows of every committed record, counted from the ledger lines on disk."""
    return sum(b.rows for r in read_ledgers(path) for b in r.batches)


def test_a_complete_last_line_without_newline_counts_for_reader_and_resume(
    store: Path, expected: torch.Tensor
) -> None:
    whole = (store / LEDGER).read_bytes()
    (store / LEDGER).write_bytes(whole[:-1])
    assert torch.equal(FeatureStore(store)[KEY], expected)  # the reader counts it
    drop_torn_tail(store / LEDGER)  # the resume's first step keeps it, with its newline
    assert (store / LEDGER).read_bytes() == whole
    (store / LEDGER).write_bytes(whole[:-1])
    shards = sorted(p.name for p in store.glob("shard-*"))
    resume(store)  # the real writer's resume: nothing left to write
    assert (store / LEDGER).read_bytes() == whole
    assert sorted(p.name for p in store.glob("shard-*")) == shards
    assert torch.equal(FeatureStore(store, verify=True)[KEY], expected)


def test_a_torn_last_line_counts_for_neither_and_the_resume_rewrites_it(
    store: Path, expected: torch.Tensor
) -> None:
    lines = (store / LEDGER).read_bytes().splitlines(keepends=True)
    last_rows = sum(b.rows for b in ShardRecord.from_json(lines[-1].decode(), version=3).batches)
    (store / LEDGER).write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    partial = FeatureStore(store)
    assert len(partial) == N - last_rows
    assert torch.equal(partial[KEY], expected[: N - last_rows])
    drop_torn_tail(store / LEDGER)
    assert (store / LEDGER).read_bytes() == b"".join(lines[:-1])
    resume(store)
    resumed = FeatureStore(store, verify=True)
    assert torch.equal(resumed.indices, torch.arange(N)) and ledger_rows(store) == N
    assert torch.equal(resumed[KEY], expected)


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (lambda line: line.replace(b'"rows":4', b'"rows":3'), "record_crc32 does not match"),
        (lambda line: line + b"x", "extra data after character"),
        (lambda line: b"[" + line + b"]", "not a record: a JSON list"),
    ],
)
def test_a_complete_last_line_that_is_damaged_is_an_error_not_a_torn_write(
    store: Path, tail: Callable[[bytes], bytes], message: str
) -> None:
    lines = (store / LEDGER).read_bytes().splitlines()
    lines[-1] = tail(lines[-1])
    damaged = b"\n".join(lines)  # and no newline at the end
    (store / LEDGER).write_bytes(damaged)
    with pytest.raises(StoreError, match=f"{LEDGER} line 4 is damaged: .*{message}"):
        FeatureStore(store)
    with pytest.raises(StoreError, match=f"{LEDGER} line 4 is damaged: .*{message}"):
        drop_torn_tail(store / LEDGER)
    assert (store / LEDGER).read_bytes() == damaged  # the resume cut nothing off


# A dataset index stored twice


def test_duplicated_indices_are_refused_or_read_from_their_first_commit(
    store: Path, expected: torch.Tensor, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    other = TinyModule()
    dump(tmp_path / "other", other, loader(8, 4))  # indices 0..7 again, other values
    theirs = manual_outputs(other, dataset(8).tensors[0])[1]
    transplant(tmp_path / "other", store, rank=1)
    with pytest.raises(
        StoreError,
        match=r"holds 8 dataset indices more than once, e.g. \[0, 1, 2, 3, 4, 5, 6, 7\] "
        r"\(in shard-r000-000000.safetensors, shard-r001-000000.safetensors\); open it with "
        r"FeatureStore\(..., "
        r"on_duplicate='first'\)",
    ):
        FeatureStore(store)
    first = FeatureStore(store, on_duplicate="first")
    assert first.duplicated_indices() == list(range(8))
    assert torch.equal(first.indices, torch.arange(N))
    assert torch.equal(first[KEY], expected)  # rank 0 commits before rank 1
    assert [i.tolist() for i, _ in first.batches(KEY)][-1] == [28, 29]  # rank 1's are dropped
    # the rule is the order (rank, seq), not "the store that was there first":
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(store / STORE_FILE, swapped / STORE_FILE)
    transplant(tmp_path / "other", swapped, rank=0)
    transplant(store, swapped, rank=1)  # the 30 rows, then the 8 copies again
    again = FeatureStore(swapped, on_duplicate="first")
    assert torch.equal(again[KEY], torch.cat([theirs, expected[8:]]))
    assert again.duplicated_indices() == list(range(8))


# Keys of only some batches, rows of different shapes, tensors stored once per batch


class Branchy(TinyModule):
    """``layers.1`` runs in odd batches (twice in batch 3: its ``@1`` key); ``layers.2`` runs
    ``1 + batch_idx % 3`` decoding steps, as ``generate()`` stops at different lengths."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return branchy_forward(self, batch[0], batch_idx, {})


def branchy_forward(
    module: TinyModule, x: torch.Tensor, batch_idx: int, seen: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The forward of :class:`Branchy`; fills ``seen`` with each call's output by key."""
    layers = module.model.layers
    x = layers[0](x)
    for call in range(2 if batch_idx == 3 else batch_idx % 2):
        x = seen[f"model.layers.1/outputs{f'@{call}' if call else ''}"] = layers[1](x)
    for call in range(1 + batch_idx % 3):
        x = seen[f"model.layers.2/outputs{f'@{call}' if call else ''}"] = layers[2](x)
    return module.head(x)


def test_keys_of_only_some_batches_are_read_with_their_own_indices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    module = Branchy()
    spec = "outputs[model.layers.1|model.layers.2]"
    dump(tmp_path, module, loader(N, 4), spec=spec, max_shard_bytes=300)
    truth: dict[str, dict[int, torch.Tensor]] = {}
    x = dataset(N).tensors[0]
    with torch.no_grad():
        for batch_idx, start in enumerate(range(0, N, 4)):
            seen: dict[str, torch.Tensor] = {}
            branchy_forward(module, x[start : start + 4], batch_idx, seen)
            for key, rows in seen.items():
                indices = range(start, start + len(rows))
                truth.setdefault(key, {}).update(zip(indices, rows, strict=True))
    store = FeatureStore(tmp_path)
    assert store.keys() == sorted(truth) and len(truth) == 5
    for key, rows_by_index in truth.items():
        indices, rows = store.rows(key)
        assert indices.tolist() == sorted(rows_by_index), key
        assert torch.equal(rows, torch.stack([rows_by_index[i] for i in sorted(rows_by_index)]))
        assert torch.equal(store.indices_of(key), indices)
    assert torch.equal(store["model.layers.2/outputs"], store.rows("model.layers.2/outputs")[1])
    assert len(truth["model.layers.1/outputs"]) == 14  # batches 1, 3, 5 and 7 (2 samples)
    with pytest.raises(
        StoreError,
        match=r"'model.layers.1/outputs' is stored for 14 of the 30 rows .*read it with "
        r"store.rows\('model.layers.1/outputs'\), which returns \(indices, rows\)",
    ):
        store["model.layers.1/outputs"]
    per_batch = [i.tolist() for i, _ in store.batches("model.layers.1/outputs@1")]
    assert per_batch == [[12, 13, 14, 15]]
    code, out, _ = inspect(tmp_path, capsys=capsys)
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("model.")]
    listed = {words[0]: words[3:] for words in rows}
    assert listed == {
        "model.layers.1/outputs": ["14", "of", "30"],
        "model.layers.1/outputs@1": ["4", "of", "30"],
        "model.layers.2/outputs": ["30"],
        "model.layers.2/outputs@1": [str(len(truth["model.layers.2/outputs@1"])), "of", "30"],
        "model.layers.2/outputs@2": [str(len(truth["model.layers.2/outputs@2"])), "of", "30"],
    }


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale


def rotary(batch_idx: int) -> torch.Tensor:
    """A tensor of batch dimension 1 that differs by batch, as rotary position embeddings."""
    return torch.arange(8.0).reshape(1, 8) + batch_idx


class WithRotary(TinyModule):
    def __init__(self) -> None:
        super().__init__(model=Scaled())

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.model(batch[0], rotary(batch_idx))


def test_the_real_writers_per_batch_tensors_are_read_per_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump(tmp_path, WithRotary(), loader(N, 4), spec="inputs[model]", max_shard_bytes=300)
    store = FeatureStore(tmp_path)
    assert torch.equal(store["model/inputs/args/0"], dataset(N).tensors[0])
    read = [(indices.tolist(), tensor) for indices, tensor in store.batches("model/inputs/args/1")]
    assert [indices for indices, _ in read] == [
        list(range(s, min(s + 4, N))) for s in range(0, N, 4)
    ]
    assert all(torch.equal(tensor, rotary(number)) for number, (_, tensor) in enumerate(read))
    with pytest.raises(StoreError, match=r"'model/inputs/args/1' is stored once per batch"):
        store["model/inputs/args/1"]
    assert store.metadata["per_batch"] == {"model/inputs/args/1": 8}
    assert store.metadata["keys"]["model/inputs/args/1"] == {"dtype": "float32", "shape": [1, 8]}
    code, out, _ = inspect(tmp_path, capsys=capsys)
    line = next(line for line in out.splitlines() if line.startswith("model/inputs/args/1"))
    assert code == 0 and line.split()[1:] == [
        "float32",
        "per",
        "batch",
        "(1,",
        "8)",
        "8",
        "batches",
    ]


def handmade(
    path: Path, batches: list[tuple[list[int], dict[str, torch.Tensor]]], per_batch: tuple[str, ...]
) -> None:
    """A store written by hand from the documented format: one batch per shard."""
    path.mkdir()
    info = {"format": FORMAT, "spec": "by hand", "stage": "predict", "dtype": None}
    write_json_atomic(path / STORE_FILE, info)
    for seq, (indices, tensors) in enumerate(batches):
        name = shard_name(0, seq)
        flat = {f"b0/{key}": tensor for key, tensor in tensors.items()}
        save_file({"b0/__index__": torch.tensor(indices), **flat}, str(path / name))
        record = ShardRecord(
            file=name,
            rank=0,
            bytes=(path / name).stat().st_size,
            crc32=file_crc32(path / name),
            batches=(BatchRecord.of(0, seq, torch.tensor(indices)),),
            keys={key: str(t.dtype).removeprefix("torch.") for key, t in tensors.items()},
            shapes={
                k: list(t.shape if k in per_batch else t.shape[1:]) for k, t in tensors.items()
            },
            per_batch=tuple(key for key in tensors if key in per_batch),
            skipped={"layer/inputs/kwargs/cache": "not a tensor with a row per sample"},
        )
        append_ledger(path / ledger_name(0), record)


def test_rows_of_different_shapes_and_tensors_stored_once_per_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rotary embeddings (batch dimension 1) next to hidden states whose length varies."""
    written = []
    for number, (indices, length) in enumerate([([4, 5], 3), ([0, 1, 2], 5), ([3], 2)]):
        hidden = torch.randn(len(indices), length, 4)
        rotary = torch.arange(length * 4, dtype=torch.float32).reshape(1, length, 4) + number
        written.append((indices, {"layer/inputs/args/0": hidden, "layer/inputs/rope": rotary}))
    handmade(tmp_path / "store", written, per_batch=("layer/inputs/rope",))
    store = FeatureStore(tmp_path / "store", verify=True)
    assert len(store) == 6 and store.keys() == ["layer/inputs/args/0", "layer/inputs/rope"]
    for key in store:
        read = list(store.batches(key))
        assert [i.tolist() for i, _ in read] == [indices for indices, _ in written]
        assert all(
            torch.equal(t, tensors[key]) for (_, t), (_, tensors) in zip(read, written, strict=True)
        )
    for method in (store.__getitem__, store.rows):
        with pytest.raises(StoreError, match=r"'layer/inputs/rope' is stored once per batch.*"):
            method("layer/inputs/rope")
        with pytest.raises(StoreError, match=r"different shapes .*store.batches\('layer/inputs/"):
            method("layer/inputs/args/0")
    meta = store.metadata
    assert meta["per_batch"] == {"layer/inputs/rope": 3}
    assert meta["keys"]["layer/inputs/rope"] == {"dtype": "float32", "shape": None}
    assert meta["skipped"] == {"layer/inputs/kwargs/cache": "not a tensor with a row per sample"}
    assert torch.equal(store.indices_of("layer/inputs/rope"), torch.arange(6))
    code, out, _ = inspect(tmp_path / "store", capsys=capsys)
    assert code == 0
    assert "layer/inputs/rope" in out and "per batch varies" in out and "3 batches" in out
    assert "layer/inputs/kwargs/cache" in out and "skipped: not a tensor" in out


# Hostile stores: only the store's own files, inside its directory


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../outside.safetensors", "is not a shard name"),
        ("{outside}", "is not a shard name"),  # an absolute path
        ("sub/shard-r000-000000.safetensors", "is not a shard name"),
        ("notes.txt", "is not a shard name"),
        ("shard-r0-0.safetensors", "is not a shard name"),
        ("shard-r000-000000.safetensors.tmp", "is not a shard name"),
        ("shard-r001-000000.safetensors", "is not a shard of rank 0"),
    ],
)
def test_a_record_naming_a_file_that_is_not_its_own_shard_is_refused(
    store: Path, tmp_path: Path, name: str, problem: str
) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(store / first_shard(store), outside)  # a valid shard, if it were followed
    (store / "sub").mkdir()
    shutil.copy(outside, store / "sub" / "shard-r000-000000.safetensors")
    name = name.format(outside=outside)
    rewrite_record(store, 1, file=name)
    with pytest.raises(StoreError, match=rf"{LEDGER} line 1 is damaged: `file` .*{problem}"):
        FeatureStore(store)
    with pytest.raises(StoreError, match=rf"{LEDGER} line 1 is damaged: `file` .*{problem}"):
        drop_torn_tail(store / LEDGER)  # nor would a resume go on


def test_a_record_of_another_rank_in_a_ledger_is_refused(store: Path) -> None:
    rewrite_record(store, 1, file=shard_name(1, 0), rank=1)
    with pytest.raises(StoreError, match="a shard of rank 1, in the ledger of rank 0"):
        FeatureStore(store)


def test_symbolic_links_are_read_only_inside_the_store_and_never_written_through(
    store: Path, expected: torch.Tensor, tmp_path: Path
) -> None:
    record = read_ledgers(store)[0]
    shard = record.file
    os.rename(store / shard, store / "moved.safetensors")
    os.symlink("moved.safetensors", store / shard)  # inside the store: read
    assert torch.equal(FeatureStore(store, verify=True)[KEY], expected)
    link = tmp_path / "link"
    os.symlink(store, link)  # a store reached through a link to its directory: read
    assert torch.equal(FeatureStore(link)[KEY], expected)
    for name in (shard, LEDGER, STORE_FILE):
        outside = tmp_path / f"outside-{name}"
        shutil.copy(store / name, outside)  # valid content, if it were followed
        os.replace(store / name, store / f"{name}.bak")
        os.symlink(outside, store / name)
        with pytest.raises(StoreError, match=f"{name} is a symbolic link to .*outside the store"):
            FeatureStore(store)
        os.replace(store / f"{name}.bak", store / name)
    outside = tmp_path / "outside-ledger"
    shutil.copy(store / LEDGER, outside)
    before = outside.read_bytes()
    (store / LEDGER).unlink()
    os.symlink(outside, store / LEDGER)
    with pytest.raises(StoreError, match=f"{LEDGER} is a symbolic link; .*never writes through"):
        append_ledger(store / LEDGER, record)
    (store / LEDGER).unlink()
    outside.write_bytes(before[:-5])  # a torn tail, outside
    os.symlink(outside, store / LEDGER)
    with pytest.raises(StoreError, match=f"{LEDGER} is a symbolic link; .*never writes through"):
        drop_torn_tail(store / LEDGER)
    assert outside.read_bytes() == before[:-5]
    os.replace(store / STORE_FILE, tmp_path / "outside.json")
    os.symlink(tmp_path / "outside.json", store / STORE_FILE)
    with pytest.raises(StoreError, match=f"{STORE_FILE} is a symbolic link; .*never writes"):
        write_json_atomic(store / STORE_FILE, {"format": FORMAT})
    assert json.loads((tmp_path / "outside.json").read_text())["spec"] == SPEC


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path the reader opens: ``os.open``, ``open`` (file_crc32), ``safe_open``."""
    paths: list[Path] = []

    def recorder(real: Callable[..., Any]) -> Callable[..., Any]:
        def record(path: Any, *args: Any, **kwargs: Any) -> Any:
            paths.append(Path(path))
            return real(path, *args, **kwargs)

        return record

    monkeypatch.setattr(os, "open", recorder(os.open))
    monkeypatch.setattr(local_records, "open", recorder(open), raising=False)
    monkeypatch.setattr(local_backend, "safe_open", recorder(local_backend.safe_open))
    return paths


def test_only_the_stores_own_files_are_read(
    store: Path, opened: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (store / "notes.txt").write_text("mine")
    (store / "ledger-r1.jsonl").write_text("not a ledger of this store\n")
    (store / ".tmpAbc123").write_bytes(b"\0" * 10)
    shutil.copy(store / first_shard(store), store / shard_name(0, 99))  # in no ledger
    own = {STORE_FILE, LEDGER, *(record.file for record in read_ledgers(store))}
    opened.clear()
    reader = FeatureStore(store, verify=True)
    for key in reader:
        reader[key]
    assert inspect(store, "--verify", capsys=capsys)[0] == 0
    assert opened and {path.name for path in opened} <= own
    assert all(path.parent.resolve() == store.resolve() for path in opened)


def flip_utf8(path: Path) -> None:
    data = bytearray((path / LEDGER).read_bytes())
    data[data.index(b"shard-r000") + 3] = 0xFF
    (path / LEDGER).write_bytes(bytes(data))


def set_line(number: int, text: bytes) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        lines = (path / LEDGER).read_bytes().splitlines(keepends=True)
        lines[number - 1] = text
        (path / LEDGER).write_bytes(b"".join(lines))

    return damage


def change_record(**changes: Any) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        record = read_ledgers(path)[0]
        computed = {name: value(record) for name, value in changes.items()}
        rewrite_record(path, 1, **computed)

    return damage


def append_line(path: Path) -> None:
    with open(path / LEDGER, "ab") as handle:
        handle.write((path / LEDGER).read_bytes().splitlines(keepends=True)[0])


def add_field(path: Path) -> None:
    """A record with a field the format does not have, and a checksum that covers it."""
    lines = (path / LEDGER).read_bytes().splitlines(keepends=True)
    record = json.loads(lines[0])
    del record["record_crc32"]
    record["color"] = "red"
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    record["record_crc32"] = zlib.crc32(canonical.encode())
    lines[0] = json.dumps(record).encode() + b"\n"
    (path / LEDGER).write_bytes(b"".join(lines))


def set_store_json(text: bytes) -> Callable[[Path], None]:
    return lambda path: (path / STORE_FILE).write_bytes(text)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "ledger not utf-8": (flip_utf8, rf"{LEDGER} line 1 is damaged: it is not valid UTF-8"),
    "ledger line a list": (set_line(1, b"[1, 2]\n"), rf"{LEDGER} line 1 .*a JSON list, not"),
    "ledger line empty": (set_line(2, b"\n"), rf"{LEDGER} line 2 is damaged: it is not JSON"),
    "ledger line without checksum": (
        set_line(1, b'{"file": "x"}\n'),
        rf"{LEDGER} line 1 is damaged: it has no record_crc32",
    ),
    "ledger line unknown field": (
        add_field,
        rf"{LEDGER} line 1 is damaged: not a record: unknown fields \['color'\], missing fields",
    ),
    "header dtype": (
        change_record(keys=lambda r: {**r.keys, KEY: "float16"}),
        rf"shard-r000-000000.safetensors disagrees with its ledger record \(.*{LEDGER} line 1\): "
        rf"'b0/{KEY}' is float32, the record says float16",
    ),
    "header shape": (
        change_record(shapes=lambda r: {**r.shapes, KEY: [9]}),
        rf"'b0/{KEY}' has shape \[4, 8\], the record says \[4, 9\]",
    ),
    "header rows": (
        change_record(batches=lambda r: (BatchRecord.of(0, 0, torch.arange(3)), *r.batches[1:])),
        r"the record says (int64 \[3\]|\[3, 8\])",
    ),
    "header key not in record": (
        change_record(
            keys=lambda r: {k: v for k, v in r.keys.items() if k != KEY},
            shapes=lambda r: {k: v for k, v in r.shapes.items() if k != KEY},
        ),
        rf"it holds 'b0/{KEY}', a key the record does not list",
    ),
    "record key not in header": (
        change_record(keys=lambda r: {**r.keys, "ghost": "float32"}),
        r"lacks \['ghost'\], which the record lists",
    ),
    "shard recorded twice": (
        append_line,
        rf"shard-r000-000000.safetensors is recorded twice, in .*{LEDGER} line 1 and .*line 5",
    ),
    "shard missing": (
        lambda path: (path / shard_name(0, 2)).unlink(),
        rf"shard-r000-000002.safetensors is committed \(.*{LEDGER} line 3\) but missing",
    ),
    "shard header garbage": (
        lambda path: (path / shard_name(0, 1)).write_bytes(
            b"\xff" * (path / shard_name(0, 1)).stat().st_size
        ),
        r"shard-r000-000001.safetensors is corrupted",
    ),
    "store.json a list": (set_store_json(b"[]"), r"store.json is damaged: a JSON list, not"),
    "store.json not utf-8": (set_store_json(b'{"a": "\xff"}'), r"cannot read .*store.json"),
    "store.json libraries": (
        set_store_json(json.dumps({"format": FORMAT, "libraries": "x"}).encode()),
        r"store.json is damaged: `libraries` is 'x'",
    ),
    "store.json format": (
        set_store_json(json.dumps({"format": "lightning-iocatch-store/9"}).encode()),
        r"store.json has format 'lightning-iocatch-store/9'; this library reads",
    ),
}


HEADER_DAMAGE = ("record key not in header", "shard header garbage")


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_is_an_error_naming_the_file(
    store: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damage to the records or to a shard's size is found when the store is opened;
    damage to a shard's header, before its first tensor is read (opening reads no shard)."""
    apply, message = DAMAGE[damage]
    apply(store)
    with pytest.raises(StoreError, match=message):
        opened = FeatureStore(store)
        assert damage.startswith("header") or damage in HEADER_DAMAGE
        for key in opened:  # a key of each batch: every shard's header is checked
            list(opened.batches(key))
    code, out, err = inspect(store, "--verify", capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert any(name in err for name in (LEDGER, STORE_FILE, "shard-r000-"))


# Permissions


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


@pytest.mark.parametrize("mask", [0o027, 0o002])
def test_format_files_get_the_permissions_of_the_umask(
    tmp_path: Path, umask: Callable[[int], None], mask: int
) -> None:
    umask(mask)
    (tmp_path / "store.json.tmp").write_text("debris")
    (tmp_path / "store.json.tmp").chmod(0o600)
    write_json_atomic(tmp_path / STORE_FILE, {"format": FORMAT})
    batches = (BatchRecord.of(0, 0, torch.tensor([0])),)
    record = ShardRecord(shard_name(0, 0), 0, 1, 2, batches, {}, {})
    append_ledger(tmp_path / LEDGER, record)
    for name in (STORE_FILE, LEDGER):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert read_ledgers(tmp_path) == [record]


# Arguments


def test_a_dataloader_the_store_does_not_hold_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    dump(tmp_path, module, [loader(12, 4), loader(6, 4, seed=1)])
    second = FeatureStore(tmp_path, dataloader_idx=1)
    assert torch.equal(second.indices, torch.arange(6))
    assert torch.equal(second[KEY], manual_outputs(module, dataset(6, seed=1).tensors[0])[1])
    assert len(FeatureStore(tmp_path)) == 12 and second.metadata["dataloaders"] == [0, 1]
    with pytest.raises(
        StoreError, match=r"holds no captures of dataloader_idx=2; it holds dataloader_idx \[0, 1\]"
    ):
        FeatureStore(tmp_path, dataloader_idx=2)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"path": 3}, TypeError, "`path` must be a str or os.PathLike, got int"),
        ({"path": b"store"}, TypeError, "`path` must be a str or os.PathLike, got bytes"),
        ({"dataloader_idx": "0"}, TypeError, "`dataloader_idx` must be an int, got '0'"),
        ({"dataloader_idx": True}, TypeError, "`dataloader_idx` must be an int, got True"),
        ({"dataloader_idx": -1}, ValueError, "`dataloader_idx` must be non-negative, got -1"),
        ({"on_duplicate": "last"}, ValueError, r"`on_duplicate` must be one of \('error', 'f"),
        ({"verify": "yes"}, TypeError, "`verify` must be True or False, got 'yes'"),
    ],
)
def test_bad_feature_store_arguments_are_named(
    store: Path, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        FeatureStore(**{"path": store, **arguments})


def test_bad_method_arguments_are_named(store: Path) -> None:
    reader = FeatureStore(store)
    with pytest.raises(TypeError, match="`key` must be a str, got int"):
        reader[0]  # type: ignore[index]
    with pytest.raises(KeyError, match="did you mean 'model.layers.1/outputs'"):
        reader.rows("model.layers.1/output")
    with pytest.raises(ValueError, match="`expected` must be a non-negative int or None, got -1"):
        reader.missing_indices(-1)
    assert reader.missing_indices(32) == [30, 31]


def test_a_store_of_no_rows_is_read_as_empty(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / STORE_FILE, {"format": FORMAT})
    store = FeatureStore(tmp_path)
    assert len(store) == 0 and store.keys() == [] and store.missing_indices(2) == [0, 1]
    with pytest.raises(StoreError, match=r"dataloader_idx=1; it holds dataloader_idx \[\]"):
        FeatureStore(tmp_path, dataloader_idx=1)
