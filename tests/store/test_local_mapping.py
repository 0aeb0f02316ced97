"""Shards kept mapped between reads (store/backends/local_mapping.py): the bytes of every
row as the file holds them, whatever is kept; a mapping kept is reused, a file replaced or
cut never read stale; the files kept within the limit and the count, the least recently
read let go first; StoreRows keeps a window's shards and lets go at the epoch's end."""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends import local_mapping
from lightning_iocatch.store.backends.local_mapping import KeptMappings
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import StoreRows
from lightning_iocatch.store.writer import ShardWriter

SIZE = 3 * 65536 + 123


def _file(path: Path, size: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).bytes(size)
    path.write_bytes(data)
    return data


def _rows_by_hand(data: bytes, offsets: np.ndarray, width: int) -> list[bytes]:
    return [data[int(offset) : int(offset) + width] for offset in offsets]


@pytest.fixture
def maps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths mapped, one entry a mapping made."""
    made: list[str] = []
    real = local_mapping._mapped

    def counted(path: str, fd: int) -> np.ndarray:
        made.append(path)
        return real(path, fd)

    monkeypatch.setattr(local_mapping, "_mapped", counted)
    return made


@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_rows_at_any_offsets_and_widths_are_the_files_bytes(
    tmp_path: Path, limit: int, maps: list[str]
) -> None:
    data = _file(tmp_path / "a", SIZE, seed=0)
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
    assert len(maps) == (1 if limit else 5)  # kept: mapped once for the five reads


def test_a_file_replaced_or_cut_after_it_was_mapped_is_never_read_stale(
    tmp_path: Path, maps: list[str]
) -> None:
    path = tmp_path / "a"
    _file(path, SIZE, seed=0)
    kept = KeptMappings(1 << 30)
    offsets = np.arange(0, SIZE - 64, 4096)
    kept.gather(str(path), [(offsets, 64)])
    before = os.stat(path)
    replacement = tmp_path / "b"
    new = _file(replacement, SIZE, seed=1)
    # another inode, with the size and modification time of the file it replaces
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(replacement, path)
    (rows,) = kept.gather(str(path), [(offsets, 64)])
    assert [row.tobytes() for row in rows] == _rows_by_hand(new, offsets, 64)
    assert len(maps) == 2
    os.truncate(path, SIZE // 2)  # cut in place: the rows past its end are refused
    with pytest.raises(StoreError, match="changed while it was read"):
        kept.gather(str(path), [(offsets, 64)])
    path.unlink()
    with pytest.raises(StoreError, match="cannot read shard"):
        kept.gather(str(path), [(offsets, 64)])


def test_files_kept_within_the_limit_and_count_least_recently_read_first(
    tmp_path: Path, maps: list[str]
) -> None:
    files = [str(tmp_path / f"s{n}") for n in range(4)]
    for n, path in enumerate(files):
        _file(Path(path), SIZE, seed=n)
    row = [(np.array([0, SIZE - 16]), 16)]
    kept = KeptMappings(limit=2 * SIZE)  # room for two files
    for path in (files[0], files[1], files[0], files[2]):  # files[1]: least recently read
        kept.gather(path, row)
    assert list(kept._files) == [files[0], files[2]] and kept.mapped == 2
    kept.gather(files[0], row)  # still kept: not mapped again
    assert maps == [files[0], files[1], files[2]]
    kept.resize(SIZE)
    assert list(kept._files) == [files[0]]
    few = KeptMappings(limit=1 << 30, most=3)  # the count bounds it too
    for path in files:
        few.gather(path, row)
    assert few.mapped == 3
    few.release()
    assert few.mapped == 0
    too_big = KeptMappings(limit=SIZE - 1)  # a file larger than the limit: never kept
    too_big.gather(files[0], row)
    assert too_big.mapped == 0


def test_reads_from_several_threads_are_the_files_bytes(tmp_path: Path) -> None:
    files = {str(tmp_path / f"s{n}"): _file(tmp_path / f"s{n}", SIZE, seed=n) for n in range(3)}
    kept = KeptMappings(limit=2 * SIZE)  # two of the three: files come and go
    wrong: list[str] = []

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            path = list(files)[int(rng.integers(0, 3))]
            offsets = rng.integers(0, SIZE - 32, size=16)
            (rows,) = kept.gather(path, [(offsets, 32)])
            if [r.tobytes() for r in rows] != _rows_by_hand(files[path], offsets, 32):
                wrong.append(path)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and kept.mapped <= 2


def test_pickled_it_keeps_its_limits_and_no_mapping(tmp_path: Path) -> None:
    _file(tmp_path / "a", SIZE, seed=0)
    kept = KeptMappings(1 << 20, most=5)
    kept.gather(str(tmp_path / "a"), [(np.array([0]), 8)])
    copy = pickle.loads(pickle.dumps(kept))
    assert (copy.limit, copy.most, copy.mapped, kept.mapped) == (1 << 20, 5, 0, 1)


def _store(path: Path, rows: int, max_shard_bytes: int) -> torch.Tensor:
    writer = ShardWriter(
        path, rank=0, plan=prepare_store(path, "create", {"spec": None}),
        max_shard_bytes=max_shard_bytes,
    )  # fmt: skip
    values = torch.randn(rows, 32, generator=torch.Generator().manual_seed(0))  # 128 B a row
    for start in range(0, rows, 256):
        writer.write({"h": values[start : start + 256]}, indices=list(range(start, start + 256)))
    writer.close()
    return values


def test_store_rows_keeps_its_windows_shards_and_lets_go_at_the_epochs_end(
    tmp_path: Path, maps: list[str]
) -> None:
    values = _store(tmp_path / "store", 2048, max_shard_bytes=64 << 10)  # 4 or more shards
    data = StoreRows(tmp_path / "store", "h", batch_size=64, shuffle_rows=1024, seed=3,
                     with_indices=True)  # fmt: skip
    mappings = data._blocks[0].batch.source.shard.mappings
    assert mappings.limit == 2 * 1024 * (128 + 8)  # twice the window: its rows, indices
    shards = len({block.batch.source.name for block in data._blocks})
    seen = []
    for batch in data:
        seen.append(batch["index"])
        torch.testing.assert_close(batch["h"], values[batch["index"]], rtol=0, atol=0)
        kept = sum(len(mapping.data) for mapping in mappings._files.values())
        assert kept <= mappings.limit
    assert sorted(torch.cat(seen).tolist()) == list(range(2048))
    assert mappings.mapped == 0  # let go at the epoch's end
    assert shards <= len(maps) < 4 * shards  # each shard mapped about once an epoch
    whole = StoreRows(tmp_path / "store", "h", batch_size=64, shuffle=False)
    assert whole._blocks[0].batch.source.shard.mappings.limit == 0  # in order: nothing kept
