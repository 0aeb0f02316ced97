"""Compact storage dtypes: bfloat16 stored bit for bit, 8-bit floats with a scale per row.

The ground truths: ``tensor.to(torch.bfloat16)`` of the values a forward hook saw, the
bytes of the shard as safetensors' own reader gives them, and float64 NumPy arithmetic of
the e4m3 format's documented error (3 mantissa bits: a normal value rounds to within
``2**-4`` of itself, relative; a subnormal to within half of ``2**-9``, times the scale).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreRows
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.lightning_models import TinyModule, loader, trainer

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}
E4M3_MAX = 448.0


def write(path: Path, batches: list[dict[str, torch.Tensor]], **options: Any) -> None:
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)
    first = 0
    for batch in batches:
        rows = len(next(iter(batch.values())))
        writer.write(batch, list(range(first, first + rows)))
        first += rows
    writer.close()


def shard_contents(path: Path) -> tuple[dict[str, Any], dict[str, str], dict[str, torch.Tensor]]:
    """The one shard's record, safetensors metadata and tensors, read by safetensors."""
    (record,) = read_ledgers(path)
    with safe_open(path / record.file, framework="pt") as shard:
        tensors = {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118
        return json.loads(record.to_json()), shard.metadata(), tensors


def e4m3_bound(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The largest error e4m3 with a scale per row may make of each value (float64)."""
    scale = scale.reshape(-1, *([1] * (values.ndim - 1)))
    return np.maximum(np.abs(values) * 2.0**-4, scale * 2.0**-9) * (1 + 1e-6)


def test_bfloat16_is_stored_bit_for_bit_from_float32_and_from_bf16_mixed(tmp_path: Path) -> None:
    seen: list[torch.Tensor] = []
    torch.manual_seed(0)
    module = TinyModule(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))  # Linear autocasts to bf16
    module.model[0].register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    for name, precision in (("f32", "32-true"), ("bf16", "bf16-mixed")):
        seen.clear()
        writer = FeatureWriter(tmp_path / name, dtype="bfloat16")
        callback = IOCaptureCallback("outputs[model.0]", writer=writer)
        run = trainer([callback], precision=precision)
        run.predict(module, loader(10, 4), return_predictions=False)
        truth = torch.cat(seen).to(torch.bfloat16)
        assert {t.dtype for t in seen} == {torch.float32 if name == "f32" else torch.bfloat16}
        store = FeatureStore(tmp_path / name)
        rows = store["model.0/outputs"]
        assert rows.dtype == torch.bfloat16  # stays bf16 unless asked
        assert torch.equal(rows.view(torch.int16), truth.view(torch.int16))
        stored = [
            shard.get_tensor(f"b{j}/model.0/outputs")
            for record in read_ledgers(tmp_path / name)
            for shard in [safe_open(tmp_path / name / record.file, framework="pt")]
            for j in range(len(record.batches))
        ]
        assert torch.equal(torch.cat(stored).view(torch.int16), truth.view(torch.int16))
        wide = FeatureStore(tmp_path / name, dtype="float32")["model.0/outputs"]
        assert wide.dtype == torch.float32 and torch.equal(wide, truth.float())


def test_float8_rows_are_within_e4m3_error_of_the_float64_value(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator, dtype=torch.float64) * torch.logspace(
        -3, 3, 64, dtype=torch.float64
    ).unsqueeze(1)
    x[5, 3] = 1e4  # an outlier: its row's scale follows it, the rest keep their error bound
    x[7] = 0.0  # an all-zero row
    x[9, :4] = torch.tensor([1e-30, -1e-12, 3.0, -4.0], dtype=torch.float64)  # subnormals
    write(tmp_path, [{"x": x[:40]}, {"x": x[40:]}], dtype=torch.float8_e4m3fn)
    record, metadata, tensors = shard_contents(tmp_path)
    assert record["keys"] == {"x": "float8_e4m3fn"} and record["scaled"] == {"x": "row"}
    assert json.loads(metadata["scaled"]) == {"x": "row"}
    assert tensors["b0/x"].dtype == torch.float8_e4m3fn and tensors["b0.scale/x"].shape == (40,)
    scale = torch.cat([tensors["b0.scale/x"], tensors["b1.scale/x"]]).double().numpy()
    values = x.numpy()
    peak = np.abs(values).max(1)
    expected = np.where(peak > 0, peak / E4M3_MAX, 1.0)
    np.testing.assert_allclose(scale, expected, rtol=2**-23)  # float32 of max|x| / 448
    store = FeatureStore(tmp_path)
    read = store["x"]
    assert read.dtype == torch.float32
    error = np.abs(read.double().numpy() - values)
    assert (error <= e4m3_bound(values, scale)).all(), error.max()
    assert read[5, 3].item() == pytest.approx(1e4, rel=2**-23)  # the outlier is the row's 448
    assert torch.equal(read[7], torch.zeros(16)) and scale[7] == 1.0
    assert read[9, 0].item() == 0.0 and read[9, 2].item() == pytest.approx(3.0, rel=2**-4)
    assert store.metadata["keys"]["x"] == {
        "dtype": "float8_e4m3fn",
        "shape": [16],
        "scaled": "row",
        "read_as": "float32",
    }
    half = FeatureStore(tmp_path, dtype=torch.bfloat16)["x"]
    assert half.dtype == torch.bfloat16 and torch.equal(half, read.to(torch.bfloat16))


def test_non_finite_values_never_turn_into_finite_ones(tmp_path: Path) -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[nan, 1.0, -2.0], [inf, 0.5, 1.0], [-inf, nan, 0.0], [1e6, 2e6, -3e6]])
    write(tmp_path / "e4m3", [{"x": x}], dtype="float8_e4m3fn")
    write(tmp_path / "e5m2", [{"x": x}], dtype="float8_e5m2")
    e4m3 = FeatureStore(tmp_path / "e4m3")["x"]
    e5m2 = FeatureStore(tmp_path / "e5m2")["x"]
    finite = torch.isfinite(x)
    # e4m3fn has no infinity: NaN, never its largest value (torch's own cast saturates)
    assert torch.equal(torch.isnan(e4m3), ~finite)
    assert torch.isnan(e5m2[0, 0]) and e5m2[1, 0] == inf and e5m2[2, 0] == -inf
    assert torch.isnan(e5m2[2, 1])
    for read, relative in ((e4m3, 2.0**-4), (e5m2, 2.0**-3)):
        # the finite values keep the scale of their row's finite maximum
        assert torch.allclose(read[finite], x[finite], rtol=relative, atol=0)
    assert torch.equal(e4m3[1, 1:], torch.tensor([0.5, 1.0]))  # scale 1/448: exact here


def test_rows_at_store_rows_and_per_batch_keys_read_dequantized(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, 3, generator=generator) * 10
    rope = torch.randn(1, 5, generator=generator)  # one per batch: scaled per its one row
    ids = torch.arange(12, dtype=torch.int64) * 7  # integers are stored as they are
    write(
        tmp_path,
        [{"x": x[:6], "rope": rope, "id": ids[:6]}, {"x": x[6:], "rope": rope, "id": ids[6:]}],
        dtype="float8_e4m3fn",
        max_shard_bytes=1,  # a shard per batch
    )
    store = FeatureStore(tmp_path)
    whole = store["x"]
    assert torch.equal(store["id"], ids) and store["id"].dtype == torch.int64
    rows = store.rows_at("x", [11, 0, 6]).rows
    assert rows.dtype == torch.float32 and torch.equal(rows, whole[[11, 0, 6]])
    for _, tensor in store.batches("rope"):
        assert torch.allclose(tensor, rope, rtol=2**-4, atol=0)
    loaded = list(StoreRows(tmp_path, ["x", "id"], batch_size=5, shuffle=True, seed=3))
    order = torch.cat([batch["id"] for batch in loaded]) // 7
    assert sorted(order.tolist()) == list(range(12))
    assert torch.equal(torch.cat([batch["x"] for batch in loaded]), whole[order])
    bf16 = next(iter(StoreRows(tmp_path, "x", batch_size=12, shuffle=False, dtype="bfloat16")))
    assert bf16["x"].dtype == torch.bfloat16 and torch.equal(bf16["x"], whole.to(torch.bfloat16))
    assert store.mean("x").double().numpy() == pytest.approx(whole.double().mean(0).numpy())


def test_float8_exports_dequantized_as_float32(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from lightning_iocatch.store.export import export_dataset

    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(2)) * 50
    write(tmp_path / "store", [{"x": x}], dtype="float8_e4m3fn")
    _, _, tensors = shard_contents(tmp_path / "store")
    stored = tensors["b0/x"].to(torch.float32).numpy()  # fp8 values are exact in float32
    by_hand = stored * tensors["b0.scale/x"].numpy()[:, None]  # NumPy's float32 product
    export_dataset(tmp_path / "store", tmp_path / "ds")
    data = datasets.load_from_disk(str(tmp_path / "ds")).with_format("numpy")
    assert data.features["x"].feature.dtype == "float32"
    np.testing.assert_array_equal(data[:]["x"], by_hand[data[:]["index"]])


def test_a_store_written_before_compact_dtypes_reads_unchanged(tmp_path: Path) -> None:
    """``tests/fixtures/store-v3-bf16``: written by ShardWriter(dtype=torch.bfloat16) of
    commit d1af5de (format /3, before scales and codecs): 9 rows ``x[i, j] = (4i + j) / 3``,
    ``ids = 10 i``, and ``rope`` once per batch of 3, ``first / 7``."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "store-v3-bf16"
    store = FeatureStore(fixture, verify=True)
    i = torch.arange(9)
    x = ((i[:, None] * 4 + torch.arange(4)).float() / 3).to(torch.bfloat16)
    assert store["x"].dtype == torch.bfloat16 and torch.equal(store["x"], x)
    assert torch.equal(store["ids"], i * 10)
    assert [t.tolist() for _, t in store.batches("rope")] == [
        torch.full((1, 2), first / 7).to(torch.bfloat16).tolist() for first in (0, 3, 6)
    ]
    assert "scaled" not in store.metadata["keys"]["x"] and store.metadata["codecs"] == []
    assert torch.equal(FeatureStore(fixture, dtype="float32")["x"], x.float())
    batch = next(iter(StoreRows(fixture, ["x", "ids"], batch_size=9, shuffle=False)))
    assert torch.equal(batch["x"], x) and torch.equal(batch["ids"], i * 10)
