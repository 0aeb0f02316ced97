"""writer.py and store.py: a predict dump through a real Trainer, read back and checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.store.names import FORMAT
from tests.lightning_models import TinyModule, TinyNet, dataset, loader, manual_outputs, trainer

ROOT = Path(__file__).resolve().parents[2]
SPEC = "inputs[head]|outputs[model.layers.1]"


def dump(
    path: Path, module: TinyModule, n: int = 30, batch_size: int = 4, **options: object
) -> None:
    writer = FeatureWriter(path, **options)  # type: ignore[arg-type]
    callback = IOCaptureCallback(SPEC, writer=writer)
    trainer([callback]).predict(module, loader(n, batch_size), return_predictions=False)


def test_dump_round_trips_in_dataset_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    dump(tmp_path / "store", module, max_shard_bytes=500)
    store = FeatureStore(tmp_path / "store")
    expected = manual_outputs(module, dataset(30).tensors[0])
    assert store.keys() == ["head/inputs/args/0", "model.layers.1/outputs"]
    assert len(store) == 30 and torch.equal(store.indices, torch.arange(30))
    assert torch.equal(store["model.layers.1/outputs"], expected[1])
    assert torch.equal(store["head/inputs/args/0"], expected[2])
    meta = store.metadata
    assert meta["spec"] == SPEC and meta["stage"] == "predict" and meta["rows"] == 30
    assert meta["keys"] == {
        "head/inputs/args/0": {"dtype": "float32", "shape": [8]},
        "model.layers.1/outputs": {"dtype": "float32", "shape": [8]},
    }
    assert set(meta["libraries"]) == {"torch", "lightning", "safetensors", "lightning-iocatch"}
    assert len(meta["shards"]) > 1 and meta["ranks"] == [0]
    assert store.duplicated_indices() == [] and store.missing_indices(30) == []
    store.verify()


def test_files_are_plain_safetensors_and_json(tmp_path: Path) -> None:
    dump(tmp_path, TinyModule(), n=8, batch_size=4)
    info = json.loads((tmp_path / "store.json").read_text())
    assert info["format"] == FORMAT
    (line,) = (tmp_path / "ledger-r000.jsonl").read_text().splitlines()
    record = json.loads(line)
    with safe_open(tmp_path / record["file"], framework="pt") as shard:
        names = set(shard.keys())
        assert torch.equal(shard.get_tensor("b1/__index__"), torch.arange(4, 8))
    assert names == {f"b{j}/{k}" for j in (0, 1) for k in ["__index__", *record["keys"]]}
    assert not list(tmp_path.glob("*.tmp"))


def test_storage_dtype_and_unsorted_dataset_order(tmp_path: Path) -> None:
    module = TinyModule()
    data = dataset(12)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = torch.utils.data.DataLoader(data, batch_size=5, sampler=order)
    writer = FeatureWriter(tmp_path, dtype=torch.float16)
    trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(module, shuffled)
    store = FeatureStore(tmp_path)
    expected = manual_outputs(module, data.tensors[0])[1].to(torch.float16)
    assert torch.equal(store["model.layers.1/outputs"], expected)  # sorted back by index
    assert store.metadata["dtype"] == "float16"


def test_create_refuses_a_non_empty_directory_and_overwrite_replaces(tmp_path: Path) -> None:
    module = TinyModule()
    dump(tmp_path, module, n=8)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(StoreError, match="is not empty; use FeatureWriter\\(..., mode='resume'\\)"):
        dump(tmp_path, module, n=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    (tmp_path / "notes.txt").write_text("mine")
    dump(tmp_path, module, n=12, mode="overwrite")
    assert len(FeatureStore(tmp_path)) == 12 and (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(StoreError, match="nothing to resume"):
        dump(tmp_path / "empty", module, mode="resume")


def test_a_writer_needs_the_predict_stage() -> None:
    with pytest.raises(ValueError, match="`writer` dumps the predict loop"):
        IOCaptureCallback("outputs[a]", stages=["validate"], writer="x")


def test_unknown_keys_and_damaged_shards_are_named(tmp_path: Path) -> None:
    dump(tmp_path, TinyModule(), n=8, batch_size=4)
    store = FeatureStore(tmp_path)
    with pytest.raises(KeyError, match="did you mean 'model.layers.1/outputs'"):
        store["model.layers.1/output"]
    shard = next(tmp_path.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{shard.name} does not match its checksum"):
        FeatureStore(tmp_path).verify()
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(StoreError, match=f"{shard.name} is {len(data) - 10} bytes.*truncated"):
        FeatureStore(tmp_path)
    shard.write_bytes(b"\xff" * len(data))
    with pytest.raises(StoreError, match=f"{shard.name} is corrupted"):
        FeatureStore(tmp_path)["model.layers.1/outputs"]
    with pytest.raises(StoreError, match="is not a feature store"):
        FeatureStore(tmp_path / "nowhere")


class Ragged(TinyModule):
    """Batches of token sequences whose length varies from batch to batch."""

    def __init__(self) -> None:
        super().__init__(model=nn.Embedding(10, 4))

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.model(batch[0][:, : 2 + batch_idx])


def test_variable_sequence_length_is_readable_per_batch(tmp_path: Path) -> None:
    module = Ragged()
    ids = torch.randint(0, 10, (6, 5))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    writer = FeatureWriter(tmp_path)
    trainer([IOCaptureCallback("outputs[model]", writer=writer)]).predict(module, data)
    store = FeatureStore(tmp_path)
    with pytest.raises(StoreError, match="read it per batch with store.batches"):
        store["model/outputs"]
    assert store.metadata["keys"]["model/outputs"] == {"dtype": "float32", "shape": None}
    for number, (indices, rows) in enumerate(store.batches("model/outputs")):
        assert indices.tolist() == [2 * number, 2 * number + 1]
        assert torch.equal(rows, module.model(ids[indices, : 2 + number]))


class NoBatchDim(TinyModule):
    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.head(self.model.layers[0](torch.zeros(1, 8)))


def test_a_module_output_without_a_row_per_sample_is_refused(tmp_path: Path) -> None:
    callback = IOCaptureCallback("outputs[model.layers.0]", writer=FeatureWriter(tmp_path))
    with pytest.raises(StoreError, match="one row per sample.*shape \\(1, 8\\) for a batch of 4"):
        trainer([callback]).predict(NoBatchDim(), loader(8, 4))
    assert not list(tmp_path.glob("shard-*"))


def run_dump(path: Path, weights: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DUMP_WEIGHTS": str(weights)}
    return subprocess.run(
        [sys.executable, str(ROOT / "tests/scripts/dump_features.py"), str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "weights.pt"
    torch.save(TinyModule().state_dict(), path)
    return path


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:predict returned None")  # the committed batches, skipped
def test_full_disk_names_the_file_and_keeps_committed_shards(tmp_path: Path, weights: Path) -> None:
    path = tmp_path / "store"
    result = run_dump(path, weights, "--fsize-limit", "200", "--fsize-limit-at-batch", "8")
    assert result.returncode != 0
    assert "could not write shard" in result.stderr and "shard-r000-" in result.stderr
    store = FeatureStore(path)
    assert 0 < len(store) < 60 and store.duplicated_indices() == []
    store.verify()
    assert not list(path.glob("*.tmp"))
    module = TinyModule(model=TinyNet(3))  # as the script's, resumed in this process
    module.load_state_dict(torch.load(weights))
    writer = FeatureWriter(path, mode="resume", max_shard_bytes=600)
    callback = IOCaptureCallback("outputs[model.layers.1]|inputs[head]", writer=writer)
    trainer([callback]).predict(module, loader(60, 4), return_predictions=False)
    store = FeatureStore(path)
    assert torch.equal(store.indices, torch.arange(60)) and store.duplicated_indices() == []
    assert torch.equal(
        store["model.layers.1/outputs"], manual_outputs(module, dataset(60).tensors[0])[1]
    )
