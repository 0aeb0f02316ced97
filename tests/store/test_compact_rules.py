"""Compact dtypes' edge rules: never a silently wrong value, never a store made bigger.

The ground truths: hand-computed values (e4m3's largest value 448, float32's largest
3.4028e38), the tensors given to the writer, the bytes safetensors reads from the shard,
and NumPy's float64 arithmetic for the fnuz variants' error bound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from lightning_iocatch import FeatureStore, StoreError, StoreRows
from lightning_iocatch.checks import parse_dtype
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}


def write(path: Path, batch: dict[str, torch.Tensor], rows: int, **options: Any) -> None:
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)
    writer.write(batch, list(range(rows)))
    writer.close()


def shard(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The one shard's record and its tensors, read by safetensors."""
    (record,) = read_ledgers(path)
    with safe_open(path / record.file, framework="pt") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    return json.loads(record.to_json()), tensors


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", torch.float8_e5m2])
def test_an_8_bit_read_dtype_is_refused_naming_the_ones_to_use(tmp_path: Path, dtype: Any) -> None:
    write(tmp_path / "s", {"x": torch.tensor([[1000.0, 1e-4], [0.5, -3.0]])}, 2)
    for read in (
        lambda: FeatureStore(tmp_path / "s", dtype=dtype),
        lambda: StoreRows(tmp_path / "s", "x", batch_size=2, dtype=dtype),
    ):
        with pytest.raises(ValueError, match="cannot be read into") as refused:
            read()
        assert "1000 would read 448" in str(refused.value)
        assert "float32, bfloat16 or float16" in str(refused.value)


@pytest.mark.parametrize(
    ("given", "close"),
    [
        ("fp8", "float8_e4m3fn"),
        ("e4m3", "float8_e4m3fn"),
        ("E5M2", "float8_e5m2"),
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("float8_e4m3", "float8_e4m3fn"),
    ],
)
def test_a_dtype_misspelt_names_the_8_bit_dtypes_and_the_close_one(given: str, close: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_dtype("dtype", given)
    message = str(refused.value)
    assert "'float8_e4m3fn' or 'float8_e5m2'" in message and "'bfloat16'" in message
    assert message.endswith(f"did you mean {close!r}?")


def test_a_value_beyond_float32_is_refused_naming_key_row_and_value(tmp_path: Path) -> None:
    # a scaled row is read in float32, whose largest value is 3.4028e38
    fits = torch.tensor([[3e38, 1.0], [2.0, 1.0]], dtype=torch.float64)
    write(tmp_path / "ok", {"x": fits}, 2, dtype="float8_e4m3fn")
    read = FeatureStore(tmp_path / "ok")["x"]
    assert torch.isfinite(read).all() and abs(float(read[0, 0]) / 3e38 - 1) < 2**-4
    for value in (3.5e38, 1.6e41):  # beyond float32; beyond 448 float32 scales too
        with pytest.raises(StoreError, match=re.escape(f"row 0 holds {value:.4g}")):  # scaled
            write(
                tmp_path / f"s{value}",
                {"x": torch.tensor([[value, 1.0]] * 2, dtype=torch.float64)},
                2,
                dtype="float8_e5m2",
            )
        # rows of one value (float32, unscaled)
        with pytest.raises(StoreError, match=re.escape(f"row 0 holds {value:.4g}")):
            write(
                tmp_path / f"{value}",
                {"x": torch.tensor([[value]] * 2, dtype=torch.float64)},
                2,
                dtype="float8_e5m2",
            )
    huge = torch.tensor([[1.0, 2.0], [1e300, 1.0]], dtype=torch.float64)
    with pytest.raises(StoreError) as refused:
        write(tmp_path / "huge", {"acts": huge}, 2, dtype="float8_e4m3fn")
    message = str(refused.value)
    assert "'acts'" in message and "row 1" in message and "1e+300" in message
    assert "3.403e+38" in message and "FeatureWriter(dtype=None)" in message


def test_keys_of_one_value_per_row_stay_float32_unscaled(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    batch = {
        "wide": torch.randn(4, 8, generator=g),
        "vector": torch.randn(4, generator=g).double(),  # (batch,): one value a row
        "column": torch.randn(4, 1, generator=g).half(),
        "loss": torch.tensor(0.123456789),  # 0-d, once per batch
    }
    write(tmp_path / "s", batch, 4, dtype="float8_e4m3fn")
    record, tensors = shard(tmp_path / "s")
    assert set(record["scaled"]) == {"wide"}
    assert tensors["b0/wide"].dtype == torch.float8_e4m3fn
    for key in ("vector", "column", "loss"):
        assert tensors[f"b0/{key}"].dtype == torch.float32, key
        assert f"b0.scale/{key}" not in tensors
        assert torch.equal(tensors[f"b0/{key}"], batch[key].float()), key
    store = FeatureStore(tmp_path / "s")
    assert torch.equal(store["vector"], batch["vector"].float())
    assert [t.item() for _, t in store.batches("loss")] == [batch["loss"].item()]
    assert store.metadata["keys"]["vector"]["dtype"] == "float32"


@pytest.mark.parametrize(
    ("dtype", "largest"), [("float8_e4m3fnuz", 240.0), ("float8_e5m2fnuz", 57344.0)]
)
def test_fnuz_variants_are_scaled_by_their_own_largest_value(
    tmp_path: Path, dtype: str, largest: float
) -> None:
    x = torch.tensor([[1000.0, 1e-1, -3.0, -0.0], [0.5, float("inf"), float("nan"), 0.25]])
    write(tmp_path / "s", {"x": x}, 2, dtype=dtype)
    _, tensors = shard(tmp_path / "s")
    scale = tensors["b0.scale/x"].double().numpy()
    assert np.allclose(scale, [1000.0 / largest, 0.5 / largest], rtol=1e-6)
    read = FeatureStore(tmp_path / "s")["x"].double().numpy()
    want = x.double().numpy()
    finite = np.isfinite(want)
    mantissa = 3 if "e4m3" in dtype else 2
    bound = np.abs(want) * 2.0 ** -(mantissa + 1) + scale[:, None] * 2.0**-20
    assert (np.abs(read - want)[finite] <= bound[finite]).all()
    assert read[0, 3] == 0.0 and not np.signbit(read[0, 3])  # fnuz: no negative zero
    assert np.isnan(read[1, 1]) and np.isnan(read[1, 2])  # fnuz: no infinity
