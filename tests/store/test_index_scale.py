"""Shuffled small batches stay linear: IndexSet's work to write, open and resume a store.

Counted in operations (the Python and C calls made from ``index_set.py``), never in seconds:
4x the batches must cost about 4x the work, whatever the batches' index pattern.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch

from lightning_iocatch import FeatureStore
from lightning_iocatch.store import ShardWriter, prepare_store
from lightning_iocatch.store import index_set as index_set_module
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.stored_batches import StoredBatch

SETTINGS: dict[str, Any] = {"spec": None, "stage": "predict", "dtype": None, "tokens": None}
SOURCE = index_set_module.__file__


class Operations:
    """Counts the calls (Python and C) made from ``index_set.py`` while an IndexSet method
    runs: profiled only inside its public methods, so the rest of the store costs nothing."""

    METHODS = ("add", "add_progression", "contains", "overlap", "ranges", "__len__", "__bool__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._depth = 0
        for name in self.METHODS:
            monkeypatch.setattr(IndexSet, name, self._counted(getattr(IndexSet, name)))

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event in ("call", "c_call") and frame.f_code.co_filename == SOURCE:
            self.count += 1

    def _counted(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            if self._depth == 1:
                sys.setprofile(self._profile)
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    sys.setprofile(None)

        return counted

    def of(self, work: Callable[[], object]) -> int:
        """The operations counted while ``work`` runs."""
        before = self.count
        work()
        return self.count - before


def shuffled(batches: int, size: int, seed: int = 0) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(batches * size)
    return [order[i * size : (i + 1) * size].tolist() for i in range(batches)]


def strided(batches: int, size: int, world: int = 2) -> list[list[int]]:
    """Rank 0's share of a DDP run: ``0, world, 2 * world, ...`` in batches of ``size``."""
    share = range(0, batches * size * world, world)
    return [list(share[i * size : (i + 1) * size]) for i in range(batches)]


def work_of(path: Path, batches: list[list[int]], operations: Operations) -> dict[str, int]:
    """IndexSet's operations to write ``batches`` through a ShardWriter, open the store and
    plan a resume of it."""
    plan = prepare_store(path, "create", SETTINGS)
    writer = ShardWriter(path, rank=0, plan=plan, durable=False, max_shard_bytes=1 << 16)
    rows = {"x": torch.ones(len(batches[0]), 1, dtype=torch.int8)}

    def write() -> None:
        for batch_idx, indices in enumerate(batches):
            writer.write(rows, indices, batch_idx=batch_idx)
        writer.close()

    stores: list[FeatureStore] = []
    counts = {
        "write": operations.of(write),
        "open": operations.of(lambda: stores.append(FeatureStore(path))),
        "resume": operations.of(lambda: prepare_store(path, "resume", SETTINGS)),
    }
    assert len(stores[0]) == sum(len(batch) for batch in batches)  # each row once, as written
    return counts


def test_a_store_of_shuffled_pairs_writes_opens_and_resumes_in_linear_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    operations = Operations(monkeypatch)
    small = work_of(tmp_path / "small", shuffled(500, 2), operations)
    large = work_of(tmp_path / "large", shuffled(2000, 2), operations)
    for stage in ("write", "open", "resume"):
        growth = large[stage] / small[stage]
        assert growth < 5, f"{stage}: 4x the batches made {growth:.1f}x the operations"
        assert large[stage] < 100 * 2000, f"{stage}: {large[stage]} operations for 2000 batches"


def sparse(batches: int, seed: int = 2) -> list[list[int]]:
    """Batches of 1 to 5 ids drawn at random from a range 1000 times larger."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, batches * 1000, rng.integers(1, 6)).tolist() for _ in range(batches)]


def mixed(batches: int) -> list[list[int]]:
    """Shuffled pairs, strided shares of two ranks and random ids, interleaved."""
    parts = [shuffled(batches, 2), strided(batches, 4), sparse(batches)]
    return [parts[i % 3][i] for i in range(batches)]


PATTERNS = {
    "shuffled-pairs": lambda n: shuffled(n, 2),
    "shuffled-triples": lambda n: shuffled(n, 3, seed=1),
    "random-sparse": sparse,
    "strided-pairs": lambda n: strided(n, 2),
    "mixed": mixed,
}


def reader_work(batches: list[list[int]]) -> None:
    """What the writer and the reader ask of an IndexSet per batch: is it known, which of
    its progression is present, add it."""
    seen = IndexSet()
    for batch in batches:
        seen.contains(batch)
        values = sorted(set(batch))
        step = values[1] - values[0] if len(values) > 1 else 1
        seen.overlap(values[0], step, len(values))
        seen.add(batch)
    assert len(seen) == len({i for batch in batches for i in batch})


@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_set_work_grows_linearly_whatever_the_pattern(
    monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    operations = Operations(monkeypatch)
    small = operations.of(lambda: reader_work(PATTERNS[pattern](500)))
    large = operations.of(lambda: reader_work(PATTERNS[pattern](2000)))
    assert large / small < 5, f"4x the batches made {large / small:.1f}x the operations"


def test_pairs_in_any_order_open_and_resume_from_their_records_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = [[5, 3], [9, 1], [2, 4], [7, 0], [3, 8]]  # the writer drops the second 3
    path = tmp_path / "store"
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS))
    for batch_idx, indices in enumerate(batches):
        writer.write(
            {"x": torch.tensor([[float(i)] for i in indices])}, indices, batch_idx=batch_idx
        )
    writer.close()
    reads: list[int] = []
    read_indices = StoredBatch.read_indices

    def counted(batch: StoredBatch) -> torch.Tensor:
        reads.append(batch.position)
        return read_indices(batch)

    monkeypatch.setattr(StoredBatch, "read_indices", counted)
    store = FeatureStore(path)
    plan = prepare_store(path, "resume", SETTINGS)
    assert reads == []  # each batch's record tells its two samples, in either order
    assert plan.committed[0].ranges().tolist() == [[0, 5], [7, 9]]
    assert store.indices.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # the repeated 3 dropped
    assert store["x"][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
