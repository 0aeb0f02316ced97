"""The writer codes each batch as it arrives: the shard is the one coding it whole would give.

The ground truths: the same batches written without a codec (their shard's bytes, read by
hand), coded here at once by :func:`encode_tensors`, and the tensors given to the writer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lightning_iocatch.store.shard_codec as shard_codec
from lightning_iocatch import FeatureStore
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.shard_codec import encode_tensors
from lightning_iocatch.store.shard_file import READABLE_CODES
from lightning_iocatch.store.writer import ShardWriter

pytest.importorskip("zstandard")

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_codec, "BLOCK_BYTES", 1000)


def shards(path: Path) -> list[tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """Each shard's safetensors header and tensors' bytes, read by hand."""
    found = []
    for record in read_ledgers(path):
        raw = (path / record.file).read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        data = np.frombuffer(raw, np.uint8)[8 + length :]
        tensors = {
            name: data[slice(*info["data_offsets"])]
            for name, info in header.items()
            if name != "__metadata__"
        }
        found.append((header, tensors))
    return found


def write(path: Path, batches: list[torch.Tensor], **options: Any) -> None:
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)
    first = 0
    for batch in batches:
        writer.write({"x": batch}, list(range(first, first + len(batch))))
        first += len(batch)
    writer.close()


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float8_e4m3fn"])
def test_a_shard_coded_batch_by_batch_is_the_shard_coded_whole(
    tmp_path: Path, dtype: str | None
) -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(rows, 24, generator=generator) for rows in (70, 3, 41)]
    write(tmp_path / "plain", batches, dtype=dtype)
    write(tmp_path / "zstd", batches, dtype=dtype, codec="zstd")
    ((plain_header, plain),) = shards(tmp_path / "plain")
    ((header, coded),) = shards(tmp_path / "zstd")
    whole = {  # the plain shard's tensors, as tensors of their dtype and shape
        name: torch.from_numpy(raw.copy())
        .view(READABLE_CODES[plain_header[name]["dtype"]])
        .reshape(plain_header[name]["shape"])
        for name, raw in plain.items()
    }
    expected, metadata = encode_tensors(whole, "zstd")
    assert set(coded) == set(expected)
    for name, tensor in expected.items():
        assert np.array_equal(coded[name], tensor.numpy()), name
    assert header["__metadata__"]["codec"] == metadata["codec"]
    read = FeatureStore(tmp_path / "zstd")["x"]
    assert torch.equal(read, FeatureStore(tmp_path / "plain")["x"])


def test_a_dtype_change_starts_a_shard_coded_on_its_own(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(30, 8, generator=generator) for _ in range(3)]
    batches[1] = batches[1].double()  # the shard closes before it, and after it
    write(tmp_path / "zstd", batches, codec="zstd")
    assert len(shards(tmp_path / "zstd")) == 3
    read = list(FeatureStore(tmp_path / "zstd").batches("x"))
    assert [indices.tolist() for indices, _ in read] == [
        list(range(s, s + 30)) for s in (0, 30, 60)
    ]
    for (_, tensor), batch in zip(read, batches, strict=True):
        assert tensor.dtype == batch.dtype and torch.equal(tensor, batch)
