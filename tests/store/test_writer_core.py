"""shard_writer.py without Lightning, and FeatureWriter's boundary: what is stored, and how.

The ground truths: safetensors' own reader (``load_file``), the bytes of the file (CRC-32),
and the tensors given to the writer.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import lightning_iocatch.store.writer as shard_writer_module
from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.store.backends.local_records import file_crc32, read_ledgers
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.records import ShardRecord
from lightning_iocatch.store.shard_file import STORABLE_DTYPES
from lightning_iocatch.store.writer import ShardWriter
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}


def new_writer(path: Path, **options: Any) -> ShardWriter:
    return ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("iocatch-writer")]


def shard_tensors(path: Path) -> list[tuple[ShardRecord, dict[str, torch.Tensor]]]:
    return [(r, load_file(path / r.file)) for r in read_ledgers(path)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_shards_are_safetensors_files_for_every_storable_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_writer_module, "_CHUNK", 7)  # tensors written (and summed) in pieces
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"k/{str(dtype).removeprefix('torch.')}": torch.randint(
            0, 100, (3, 2, 5), generator=generator
        ).to(dtype)
        for dtype in STORABLE_DTYPES
    }
    tensors["k/empty"] = torch.zeros(3, 0)
    writer = new_writer(tmp_path)
    assert writer.write(tensors, indices=[7, 8, 9]) == 3
    writer.close()
    ((record, loaded),) = shard_tensors(tmp_path)  # safetensors' own reader
    assert torch.equal(loaded[f"b0/{INDEX_KEY}"], torch.tensor([7, 8, 9]))
    for key, tensor in tensors.items():
        assert loaded[f"b0/{key}"].dtype == tensor.dtype, key
        assert torch.equal(as_bytes(loaded[f"b0/{key}"]), as_bytes(tensor)), key
    shard = tmp_path / record.file
    assert record.crc32 == file_crc32(shard) and record.bytes == shard.stat().st_size
    with safe_open(shard, framework="pt") as handle:
        assert handle.metadata()["rank"] == "0"
    assert record.shapes["k/float32"] == [2, 5] and record.per_batch == ()


def test_each_dataset_index_is_written_once_per_dataloader(tmp_path: Path) -> None:
    data = torch.arange(40.0).reshape(20, 2)
    writer = new_writer(tmp_path, max_shard_bytes=100)
    batches = [
        ([0, 1, 2, 3], None),
        ([2, 3, 4, 5], None),  # 2 and 3 again: only 4, 5 are new
        ([5, 6, 6, 7], None),  # 6 twice in one batch: the first is written
        ([8, 9, 0, 1], (False, True, False, False)),  # 9 is sampler padding
        ([2, 3], None),  # nothing new
    ]
    kept = [writer.write({"x": data[i]}, indices=i, repeated=r) for i, r in batches]
    assert kept == [4, 2, 2, 1, 0]
    assert writer.has(0, [0, 5, 8]) and not writer.has(0, [8, 9]) and not writer.has(1, [0])
    writer.write({"x": data[[0, 1]]}, indices=[0, 1], dataloader_idx=1)  # another dataloader
    writer.close()
    rows: dict[int, list[int]] = {0: [], 1: []}
    for record, tensors in shard_tensors(tmp_path):
        for position, batch in enumerate(record.batches):
            index = tensors[f"b{position}/{INDEX_KEY}"]
            assert torch.equal(tensors[f"b{position}/x"], data[index])  # each row is its sample
            assert batch.rows == len(index)
            rows[batch.dataloader_idx] += index.tolist()
    assert rows == {0: [0, 1, 2, 3, 4, 5, 6, 7, 8], 1: [0, 1]}
    assert writer.rows_written == 11


def test_tensors_without_a_row_per_sample_are_stored_once_per_batch(tmp_path: Path) -> None:
    writer = new_writer(tmp_path, max_shard_bytes=1 << 20)
    rope = torch.randn(1, 5, 4)  # batch dimension 1, as rotary embeddings arrive
    sizes = [3, 3, 1]  # the last batch has one sample: rope keeps its kind
    start = 0
    for size in sizes:
        indices = list(range(start, start + size))
        hidden = torch.randn(size, 5, 8)
        mask = torch.ones(size) if size > 1 else torch.ones(2)  # row key, then without rows
        writer.write({"h": hidden, "rope": rope, "step": torch.tensor(3.0), "mask": mask}, indices)
        start += size
    writer.close()
    ((record, tensors),) = shard_tensors(tmp_path)
    assert record.per_batch == ("rope", "step")
    assert record.shapes["rope"] == [1, 5, 4] and record.shapes["h"] == [5, 8]
    assert record.skipped == {
        "mask": "shape (2,) has no row per sample in a batch of 1 samples, though earlier "
        "batches stored this key row by row"
    }
    for position in range(3):
        assert torch.equal(tensors[f"b{position}/rope"], rope)
        assert tensors[f"b{position}/step"].shape == ()
    assert "b2/mask" not in tensors and tensors["b1/mask"].shape == (3,)


def test_a_key_whose_dtype_changes_starts_a_new_shard(tmp_path: Path) -> None:
    writer = new_writer(tmp_path, max_shard_bytes=1 << 20)
    writer.write({"x": torch.ones(2, 3)}, [0, 1])
    writer.write({"x": torch.ones(2, 3, dtype=torch.float16)}, [2, 3])
    writer.close()
    records = [record for record, _ in shard_tensors(tmp_path)]
    assert [(r.keys, [b.rows for b in r.batches]) for r in records] == [
        ({"x": "float32"}, [2]),
        ({"x": "float16"}, [2]),
    ]


def test_a_required_key_without_rows_is_refused(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    with pytest.raises(
        StoreError, match="one row per sample, but 'm/outputs' has shape \\(1, 4\\)"
    ):
        writer.write({"m/outputs": torch.zeros(1, 4)}, [0, 1], required=["m/outputs"])
    writer.close()


@pytest.mark.parametrize(
    ("tensor", "problem"),
    [
        (torch.eye(3).to_sparse(), "torch.sparse_coo tensor; make it dense"),
        (torch.zeros(3, 2, dtype=torch.complex128), "dtype complex128, which safetensors cannot"),
        (
            torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
            "nested",
        ),
        (torch.zeros(3, 2, device="meta"), "a meta tensor"),
    ],
)
def test_unstorable_tensors_are_refused_on_the_calling_thread(
    tmp_path: Path, tensor: torch.Tensor, problem: str
) -> None:
    writer = new_writer(tmp_path)
    with pytest.raises(StoreError, match=f"cannot store 'bad/key': it is .*{problem}"):
        writer.write({"good": torch.zeros(3), "bad/key": tensor}, [0, 1, 2])
    assert not writer_threads()  # refused before anything was queued
    writer.close()
    assert read_ledgers(tmp_path) == []


@pytest.mark.parametrize("index", [-1, "a", 1.5, True, None])
def test_dataset_indices_must_be_non_negative_integers(tmp_path: Path, index: object) -> None:
    writer = new_writer(tmp_path)
    with pytest.raises(StoreError, match=f"non-negative integer dataset index.*has {index!r}"):
        writer.write({"x": torch.zeros(2)}, [0, index])  # type: ignore[list-item]
    writer.close()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"path": 3}, TypeError, "`path` must be a str or os.PathLike, got int"),
        ({"path": b"x"}, TypeError, "`path` must be a str or os.PathLike, got bytes"),
        ({"mode": "append"}, ValueError, "`mode` must be one of \\('create', 'resume', "),
        ({"max_shard_bytes": 0}, ValueError, "`max_shard_bytes` must be >= 1, got 0"),
        ({"max_shard_bytes": 1.5e9}, TypeError, "`max_shard_bytes` must be an int, got float"),
        (
            {"max_shard_bytes": True},
            TypeError,
            "`max_shard_bytes` must be an int, got bool \\(True\\)",
        ),
        ({"queue_size": 0}, ValueError, "`queue_size` must be >= 1, got 0"),
        ({"queue_size": "4"}, TypeError, "`queue_size` must be an int, got str"),
        ({"dtype": "int8"}, ValueError, "`dtype` must be a floating-point torch dtype or its"),
        ({"dtype": torch.int32}, ValueError, "`dtype` must be a floating-point torch dtype"),
        ({"dtype": "float17"}, ValueError, "`dtype` must be a floating-point torch dtype"),
        ({"dtype": "float8_e8m0fnu"}, ValueError, "`dtype` 'float8_e8m0fnu' is a dtype safet"),
        ({"durable": "yes"}, TypeError, "`durable` must be True or False, got str"),
        ({"stage": "train"}, ValueError, "`stage` must be 'predict'"),
        ({"stage": "Predict"}, ValueError, "`stage` must be 'predict'"),
        ({"stage": "validate"}, ValueError, "`stage` must be 'predict' .*runs once"),
    ],
)
def test_bad_feature_writer_arguments_name_the_argument(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    path = options.pop("path", "x")
    with pytest.raises(error, match=match):
        FeatureWriter(path, **options)


def test_dtype_given_by_name_stores_that_dtype(tmp_path: Path) -> None:
    module = TinyModule()
    writer = FeatureWriter(tmp_path, dtype="float16")
    callback = IOCaptureCallback("outputs[model.layers.1]", writer=writer)
    trainer([callback]).predict(module, loader(10, 4), return_predictions=False)
    store = FeatureStore(tmp_path)
    expected = manual_outputs(module, dataset(10).tensors[0])[1].to(torch.float16)
    assert torch.equal(store["model.layers.1/outputs"], expected)
    assert store.metadata["dtype"] == "float16"


class Emits(TinyModule):
    """``emit`` returns whatever ``make(x)`` builds; captured as ``emit/outputs``."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.emit = Lambda(make)
        self.steps = 0

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.steps += 1
        return self.emit(batch[0])


class Lambda(nn.Module):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(x)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: x.to_sparse(), "cannot store 'emit/outputs': it is a torch.sparse_coo tensor"),
        (
            lambda x: x.to(torch.complex128),
            "cannot store 'emit/outputs': it is of dtype complex128",
        ),
        (lambda x: {"a/b": x, "a": {"b": x + 1}}, "flatten to the same key path '/a/b'"),
        (lambda x: {0: x, "0": x + 1}, "flatten to the same key path '/0'"),
    ],
)
def test_captures_that_cannot_be_stored_are_refused_naming_the_key(
    tmp_path: Path, make: Any, match: str
) -> None:
    module = Emits(make)
    callback = IOCaptureCallback("outputs[emit]", writer=FeatureWriter(tmp_path))
    with pytest.raises(StoreError, match=match):
        trainer([callback]).predict(module, loader(8, 4), return_predictions=False)
    assert module.steps == 1  # refused at the first batch, on the loop's thread
    assert read_ledgers(tmp_path) == [] and not writer_threads()
    assert json.loads((tmp_path / "store.json").read_text())["spec"] == "outputs[emit]"
