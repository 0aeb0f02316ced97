"""IndexSet's size and gaps from its intervals: a strided share is never expanded."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from lightning_iocatch.store.coverage import gaps
from lightning_iocatch.store.index_set import IndexSet

TOP = 2**63 - 1


def ddp_share(count: int, world: int = 8, rank: int = 3, batch: int = 64) -> IndexSet:
    """One rank's share of ``world`` (indices ``rank, rank + world, ...``), in batches."""
    share = IndexSet()
    for start in range(rank, world * count, world * batch):
        share.add(np.arange(start, min(start + world * batch, world * count), world))
    return share


def peak_bytes(call) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_size_of_a_strided_share_is_arithmetic_not_one_entry_per_index() -> None:
    share = ddp_share(4_000_000)  # indices 3, 11, ..., 3 + 8 * 3,999,999
    count, peak = peak_bytes(lambda: len(share))
    assert count == 4_000_000
    assert peak < 1 << 20  # was 356 MB: each member made a range
    far = IndexSet()
    far.add_progression(TOP - 8 * (10**12 - 1), 8, 10**12)  # ends at 2**63 - 1
    far.add([0, 1, 2])
    assert len(far) == 10**12 + 3


def test_gaps_with_a_limit_stop_early_in_a_strided_share() -> None:
    share = ddp_share(500_000)
    found, peak = peak_bytes(lambda: gaps(share, None, 3))
    assert found == [(0, 3), (4, 11), (12, 19)]
    assert peak < 4 << 20  # was 105 MB: the first gaps need a block of members, not all
    assert gaps(share, 20, None) == [(0, 3), (4, 11), (12, 19)]


@pytest.mark.parametrize("seed", range(12))
def test_size_and_gaps_of_overlapping_groups_match_a_python_set(seed: int) -> None:
    """Steps 1, 2, 3, 4, 6 and 8 over the same indices, repeats and shuffled batches: each
    member counted once, gaps as the slow way finds them."""
    rng = random.Random(seed)
    seen, truth = IndexSet(), set()
    for _ in range(rng.randrange(5, 60)):
        start, step = rng.randrange(300), rng.choice([1, 2, 3, 4, 6, 8])
        batch = (
            list(range(start, start + step * rng.randrange(1, 20), step))
            if rng.random() < 0.7
            else [rng.randrange(300) for _ in range(rng.randrange(1, 6))]
        )
        seen.add(batch)
        truth.update(batch)
    assert len(seen) == len(truth)
    expected = rng.choice([None, 320])
    stop = expected if expected is not None else max(truth) + 1
    absent = [i for i in range(stop) if i not in truth]
    slow: list[tuple[int, int]] = []
    for i in absent:
        if slow and slow[-1][1] == i:
            slow[-1] = (slow[-1][0], i + 1)
        else:
            slow.append((i, i + 1))
    assert gaps(seen, expected, None) == slow
    for limit in (0, 1, 3):
        assert gaps(seen, expected, limit) == slow[:limit]
