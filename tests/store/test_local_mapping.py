"""Shards kept mapped between reads (store/backends/local_mapping.py): the bytes of every
row as the file holds them, whatever is kept; a file replaced or cut is never read stale;
the bytes kept resident within the budget; StoreRows sets the budget from its window."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.local_mapping import GRANULE, KeptMappings
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import StoreRows
from lightning_iocatch.store.writer import ShardWriter


def _file(path: Path, size: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).bytes(size)
    path.write_bytes(data)
    return data


def _rows_by_hand(data: bytes, offsets: np.ndarray, width: int) -> list[bytes]:
    return [data[int(offset) : int(offset) + width] for offset in offsets]


@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_rows_at_any_offsets_and_widths_are_the_files_bytes(tmp_path: Path, limit: int) -> None:
    data = _file(tmp_path / "a", 3 * GRANULE + 123, seed=0)
    kept = KeptMappings(limit)
    rng = np.random.default_rng(1)
    for _ in range(5):  # repeated reads: from the mapping kept, or mapped anew
        asked = [
            (rng.integers(0, len(data) - width + 1, size=rows), width)
            for rows, width in ((300, 512), (7, 4), (0, 8), (3, 70_000), (2, 0))
        ]
        found = kept.gather(str(tmp_path / "a"), asked)
        for (offsets, width), rows in zip(asked, found, strict=True):
            assert rows.shape == (len(offsets), width) and rows.dtype == np.uint8
            assert [row.tobytes() for row in rows] == _rows_by_hand(data, offsets, width)
        assert kept.mapped == (1 if limit else 0)  # limit 0: nothing stays mapped


def test_a_file_replaced_or_cut_after_it_was_mapped_is_never_read_stale(tmp_path: Path) -> None:
    path = tmp_path / "a"
    _file(path, 4 * GRANULE, seed=0)
    kept = KeptMappings(1 << 30)
    offsets = np.arange(0, 4 * GRANULE - 64, 4096)
    kept.gather(str(path), [(offsets, 64)])
    assert kept.mapped == 1
    replacement = tmp_path / "b"
    new = _file(replacement, 4 * GRANULE, seed=1)
    os.replace(replacement, path)  # same name and size, another inode: as a rewrite does
    (rows,) = kept.gather(str(path), [(offsets, 64)])
    assert [row.tobytes() for row in rows] == _rows_by_hand(new, offsets, 64)
    os.truncate(path, 2 * GRANULE)  # cut in place: the rows past its end are refused
    with pytest.raises(StoreError, match="changed while it was read"):
        kept.gather(str(path), [(offsets, 64)])
    path.unlink()
    with pytest.raises(StoreError, match="cannot read shard"):
        kept.gather(str(path), [(offsets, 64)])


def test_the_bytes_kept_resident_stay_within_the_limit(tmp_path: Path) -> None:
    files = [tmp_path / f"s{n}" for n in range(4)]
    for n, path in enumerate(files):
        _file(path, 8 * GRANULE, seed=n)
    kept = KeptMappings(limit=12 * GRANULE)  # a file and a half of granules
    rng = np.random.default_rng(0)
    for _ in range(3):
        for path in files:
            kept.gather(str(path), [(rng.integers(0, 8 * GRANULE - 256, size=64), 256)])
            resident = sum(mapping.resident for mapping in kept._files.values())
            assert resident <= kept.limit
            assert 1 <= kept.mapped <= 2
    kept.resize(0)
    assert kept.mapped == 0
    few = KeptMappings(limit=12 * GRANULE)  # a few rows of each file: all four stay mapped
    for path in files:
        few.gather(str(path), [(np.array([0, GRANULE]), 16)])
    assert few.mapped == 4
    a_file_alone_past_it = KeptMappings(limit=GRANULE)  # unmapped after each read
    a_file_alone_past_it.gather(str(files[0]), [(np.array([0, 3 * GRANULE]), 16)])
    assert a_file_alone_past_it.mapped == 0


def test_pickled_it_keeps_its_limit_and_no_mapping(tmp_path: Path) -> None:
    _file(tmp_path / "a", GRANULE, seed=0)
    kept = KeptMappings(1 << 20)
    kept.gather(str(tmp_path / "a"), [(np.array([0]), 8)])
    copy = pickle.loads(pickle.dumps(kept))
    assert copy.limit == 1 << 20 and copy.mapped == 0 and kept.mapped == 1


def test_store_rows_keeps_a_windows_worth_of_shards_mapped(tmp_path: Path) -> None:
    path = tmp_path / "store"
    writer = ShardWriter(
        path, rank=0, plan=prepare_store(path, "create", {"spec": None}), max_shard_bytes=64 << 10
    )
    values = torch.randn(2048, 32, generator=torch.Generator().manual_seed(0))  # 128 B a row
    for start in range(0, 2048, 256):
        writer.write({"h": values[start : start + 256]}, indices=list(range(start, start + 256)))
    writer.close()
    data = StoreRows(path, "h", batch_size=64, shuffle_rows=512, with_indices=True, seed=3)
    mappings = data._blocks[0].batch.source.shard.mappings
    # the window's stored bytes: its rows and indices (asked for, and read to be checked)
    assert mappings.limit == 512 * (128 + 8 + 8)
    seen = []
    for batch in data:
        seen.append(batch["index"])
        torch.testing.assert_close(batch["h"], values[batch["index"]], rtol=0, atol=0)
        resident = sum(mapping.resident for mapping in mappings._files.values())
        assert resident <= mappings.limit
    assert sorted(torch.cat(seen).tolist()) == list(range(2048))
    shards = len({block.batch.source.name for block in data._blocks})
    assert shards >= 4 and 1 <= mappings.mapped <= 2  # the shards of a window, not all
