"""The store's formats: stores of every earlier format read, and dataset indices that
disagree with their records (a flipped bit) are damage, never read.

The stores of earlier formats are small fixtures written by the writers of those formats
(``tests/fixtures/README.md``); the truth is the shards read by safetensors itself.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError, StoreRows
from lightning_iocatch.cli import main
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.names import FORMAT, INDEX_KEY, STORE_FILE
from lightning_iocatch.store.plan import prepare_store
from tests.lightning_models import TinyModule, loader, trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KEY = "model.layers.1/outputs"
FLIP = 1 << 40  # one bit of an int64 index


def safetensors_truth(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per key, ``(indices, rows)`` in dataset-index order, read from the shards with
    safetensors' own loader, batch by batch as the ledger lists them."""
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for record in read_ledgers(path):
        tensors = load_file(path / record.file)
        for position, _ in enumerate(record.batches):
            index = tensors[f"b{position}/{INDEX_KEY}"]
            for key in record.keys:
                if key not in record.per_batch and f"b{position}/{key}" in tensors:
                    parts.setdefault(key, []).append((index, tensors[f"b{position}/{key}"]))
    truth = {}
    for key, pieces in parts.items():
        indices = torch.cat([index for index, _ in pieces])
        order = torch.argsort(indices, stable=True)
        truth[key] = (indices[order], torch.cat([rows for _, rows in pieces])[order])
    return truth


@pytest.mark.parametrize("name", ["store-v1-rows", "store-v2-rows", "store-v2-tokens"])
def test_stores_of_earlier_formats_read_and_resume(name: str, tmp_path: Path) -> None:
    store_path = shutil.copytree(FIXTURES / name, tmp_path / name)
    truth = safetensors_truth(store_path)
    store = FeatureStore(store_path, verify=True)
    assert store.keys() == sorted(truth)
    for key, (indices, rows) in truth.items():
        got_indices, got_rows = store.rows(key)
        assert torch.equal(got_indices, indices) and torch.equal(got_rows, rows), key
    reader = StoreRows(store_path, sorted(truth)[0], batch_size=3, with_indices=True)
    read = torch.cat([batch["index"] for batch in reader]).sort().values
    assert torch.equal(read, truth[sorted(truth)[0]][0])  # every row once
    assert main(["inspect", str(store_path)]) == 0
    info = json.loads((store_path / STORE_FILE).read_text())
    plan = prepare_store(
        store_path, "resume", {k: info[k] for k in ("spec", "stage", "dtype", "tokens")}
    )
    assert plan.store_json["format"] == info["format"]  # a resume keeps the store's format


def dumped(path: Path) -> Path:
    torch.manual_seed(0)
    writer = FeatureWriter(path, durable=False, max_shard_bytes=1)  # a shard per batch
    callback = IOCaptureCallback("outputs[model.layers.1]", writer=writer)
    trainer([callback]).predict(TinyModule(), loader(12, 4), return_predictions=False)
    return path


def flip_an_index(shard: Path, batch: int, row: int) -> None:
    """Flip bit 40 of one row's dataset index in the shard's bytes (its size stays)."""
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    start = 8 + length + header[f"b{batch}/{INDEX_KEY}"]["data_offsets"][0] + 8 * row
    data[start : start + 8] = struct.pack(
        "<q", struct.unpack("<q", data[start : start + 8])[0] ^ FLIP
    )
    shard.write_bytes(bytes(data))


def test_a_flipped_bit_in_an_index_is_damage_named_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: FeatureStore returned index 2**40 + 5 as a sample without a word, and
    ``inspect`` allocated a flag per index up to it (a 16-line traceback, exit 1).

    Opening and resuming trust the records' index summaries (they are right: the record has
    its own checksum), so they read no index; every reader that reads the damaged one
    names it, and ``inspect --verify`` reads them all."""
    path = dumped(tmp_path / "store")
    assert json.loads((path / STORE_FILE).read_text())["format"] == FORMAT
    shard = path / read_ledgers(path)[1].file  # indices 4..7
    flip_an_index(shard, batch=0, row=1)
    damage = rf"shard {shard} batch 0: its __index__ does not match the CRC-32 its record gives"
    store = FeatureStore(path)
    assert store.sample_count == 12 and store.missing_ranges() == []  # from the summaries
    for read in (lambda: store.indices, lambda: store.rows(KEY), lambda: store.indices_of(KEY)):
        with pytest.raises(StoreError, match=damage):
            read()
    with pytest.raises(StoreError, match=damage):
        list(StoreRows(path, KEY, batch_size=4, with_indices=True, shuffle=False))
    capsys.readouterr()
    assert main(["inspect", str(path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its checksum" in err and "Traceback" not in err


def test_a_flipped_index_in_a_store_of_format_2_is_one_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Format /2 records have no index summary: the flipped index is read as a sample, and
    ``inspect`` reports the gap it leaves as one range, in one line (before: a flag per index
    up to 2**40, then a traceback); ``--verify`` finds the damage by the shard's CRC-32."""
    path = shutil.copytree(FIXTURES / "store-v2-rows", tmp_path / "store")
    flip_an_index(path / read_ledgers(path)[0].file, batch=0, row=1)  # index 1
    store = FeatureStore(path)
    assert store.missing_ranges() == [(1, 2), (11, FLIP + 1)]  # 11 samples: 0..10
    with pytest.raises(StoreError, match="too many to list one by one; store.missing_ranges"):
        store.missing_indices()
    assert store.missing_ranges(11) == [(1, 2)]
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {FLIP - 9} dataset indices missing, in 2 gap(s): 1, 11..{FLIP}\n"
    assert main(["inspect", str(path), "--verify"]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
