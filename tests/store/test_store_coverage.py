"""coverage.py: the samples a store holds and lacks, up to the largest index the writer takes.

The truth is the list of indices written, in Python integers: never the reader itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_iocatch import FeatureStore
from lightning_iocatch.store import ShardWriter, prepare_store

TOP = 2**63 - 1  # the largest dataset index the writer accepts
SETTINGS: dict[str, Any] = {"spec": None, "stage": "predict", "dtype": None, "tokens": None}


def written(path: Path, batches: list[list[int]]) -> FeatureStore:
    """A store of ``batches`` through ShardWriter, each row ``[index % 1000]``."""
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS))
    for batch_idx, indices in enumerate(batches):
        rows = torch.tensor([[i % 1000] for i in indices], dtype=torch.float64)
        writer.write({"x": rows}, indices, batch_idx=batch_idx)
    writer.close()
    return FeatureStore(path)


def test_a_store_holding_the_largest_index_counts_and_lists_its_samples(tmp_path: Path) -> None:
    batches = [[TOP - 2, TOP - 1, TOP], [5], [TOP - 6, TOP - 4]]
    truth = sorted(i for batch in batches for i in batch)
    store = written(tmp_path / "store", batches)
    assert store.samples.tolist() == truth
    assert store.sample_count == len(store) == 6
    assert store.indices.tolist() == truth
    assert store.missing_ranges(limit=1) == [(0, 5)]
    assert store.missing_ranges()[1:] == [(6, TOP - 6), (TOP - 5, TOP - 4), (TOP - 3, TOP - 2)]
    assert store.missing_count() == TOP + 1 - 6
    assert store.missing_indices(4) == [0, 1, 2, 3]
    assert store.rows_at("x", [TOP, 5]).rows[:, 0].tolist() == [TOP % 1000, 5]
    assert store["x"][:, 0].tolist() == [i % 1000 for i in truth]
    plan = prepare_store(tmp_path / "store", "resume", SETTINGS)
    runs = [[5, 5], [TOP - 6, TOP - 6], [TOP - 4, TOP - 4], [TOP - 2, TOP]]
    assert plan.committed[0].ranges().tolist() == runs


def test_samples_of_many_runs_are_every_index_once_in_order(tmp_path: Path) -> None:
    batches = [[9, 3, 4], [100, 102, 104], [0], [50, 51]]
    store = written(tmp_path / "store", batches)
    assert store.samples.tolist() == sorted(i for batch in batches for i in batch)
    assert store.samples.dtype == torch.int64
