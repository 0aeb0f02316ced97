"""A store written with a codec decodes each block about once per shuffled epoch.

The ground truths: the blocks a tensor has, counted from its bytes and the block size set
here (``ceil(rows * row_bytes / BLOCK_BYTES)``), every decode counted as it happens, and the
tensors given to the writer.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_iocatch.store.backends.coded as coded_module
import lightning_iocatch.store.shard_codec as shard_codec
import lightning_iocatch.store.training as training
from lightning_iocatch import FeatureStore, StoreRows
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}
ROWS, BATCH, WIDTH, BLOCK = 2048, 32, 64, 1024
# per stored batch of 32 rows: fp8 data 2048 bytes (2 blocks), scales 128, __index__ 256 (1 each)
BLOCKS = {"x": 2, "x.scale": 1, "__index__": 1}


def write(path: Path, x: torch.Tensor, **options: Any) -> None:
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)
    for first in range(0, ROWS, BATCH):
        writer.write({"x": x[first : first + BATCH]}, list(range(first, first + BATCH)))
    writer.close()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each decoded block (``"shard tensor block"``) -> how many times it was decoded."""
    monkeypatch.setattr(shard_codec, "BLOCK_BYTES", BLOCK)
    seen: Counter[str] = Counter()
    decode = coded_module.decode_block

    def counting(raw: Any, info: Any, block: int, shuffle: bool, where: str, **how: Any) -> Any:
        seen[where] += 1
        return decode(raw, info, block, shuffle, where, **how)

    monkeypatch.setattr(coded_module, "decode_block", counting)
    return seen


def kind(where: str) -> str:
    """``"x"``, ``"x.scale"`` or ``"__index__"`` from a decode's ``where``."""
    batch, key = where.split("'")[1].split("/")  # 'b4/x', 'b4.scale/x', 'b4/__index__'
    return key + ".scale" * batch.endswith(".scale")


def all_blocks() -> int:
    return ROWS // BATCH * sum(BLOCKS.values())


def test_a_shuffled_epoch_decodes_each_block_once(tmp_path: Path, decodes: Counter[str]) -> None:
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))
    write(tmp_path / "s", x, dtype="float8_e4m3fn", codec="zstd")
    data = StoreRows(tmp_path / "s", "x", batch_size=100, with_indices=True, seed=3)
    for epoch in range(2):
        decodes.clear()
        data.set_epoch(epoch)
        seen = torch.cat([batch["index"] for batch in data])
        assert sorted(seen.tolist()) == list(range(ROWS))
        assert set(decodes.values()) <= {1}, decodes.most_common(3)
        if epoch == 0:  # then kept: the whole store is within one window
            assert len(decodes) == all_blocks()  # 64 batches x (2 data + 1 scale + 1 index)


def test_a_window_smaller_than_the_store_keeps_about_a_window(
    tmp_path: Path, decodes: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(training, "BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(training, "KEPT_BYTES", 0)  # the window's own size, however small
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
    write(tmp_path / "z", x, codec="zstd")  # float32: 8 blocks of data per stored batch
    data = StoreRows(tmp_path / "z", "x", batch_size=64, with_indices=True, shuffle_rows=256)
    kept = data._blocks[0].batch.source.shard.kept
    store_bytes = ROWS * (4 * WIDTH + 8)
    assert kept.limit < store_bytes / 4  # bounded by the window, not the store
    rows, indices = [], []
    for batch in data:
        rows.append(batch["x"])
        indices.append(batch["index"])
        assert kept.nbytes <= kept.limit
    order = torch.cat(indices).argsort()
    assert torch.equal(torch.cat(rows)[order], x)  # lossless, every row once
    blocks = ROWS // BATCH * (8 + 1)
    assert len(decodes) == blocks
    assert sum(decodes.values()) <= 1.2 * blocks, sum(decodes.values())  # window ends twice


def test_rows_at_random_rows_decodes_each_block_once(tmp_path: Path, decodes: Counter[str]) -> None:
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(2)) * 10
    write(tmp_path / "r", x, dtype="float8_e4m3fn", codec="zstd")
    write(tmp_path / "p", x, dtype="float8_e4m3fn")
    coded, plain = FeatureStore(tmp_path / "r"), FeatureStore(tmp_path / "p")
    asked = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3))[:512]
    for first in range(0, len(asked), 16):
        part = asked[first : first + 16]
        got = coded.rows_at("x", part).rows
        assert torch.equal(got, plain.rows_at("x", part).rows)
    rows_per_block = BLOCK // WIDTH  # 16 rows of fp8 per data block
    data_blocks = {(int(i) // BATCH, int(i) % BATCH // rows_per_block) for i in asked}
    assert max(decodes.values()) == 1, decodes.most_common(3)
    assert Counter(kind(w) for w in decodes)["x"] == len(data_blocks)
    assert math.isclose(len(data_blocks), 128, rel_tol=0.1)  # nearly all: the test means it
