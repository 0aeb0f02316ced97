"""IndexSet against a Python set: the same members, ranges and overlaps, in memory per run."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from lightning_iocatch.store.index_set import IndexSet

TOP = 2**63 - 1


def ranges_of(members: set[int]) -> list[list[int]]:
    """Closed ranges of step 1, the slow way."""
    out: list[list[int]] = []
    for value in sorted(members):
        if out and out[-1][1] == value - 1:
            out[-1][1] = value
        else:
            out.append([value, value])
    return out


def random_batches(rng: random.Random, count: int, base: int) -> list[list[int]]:
    """Progressions of several steps (as DDP ranks give them) and irregular batches."""
    batches = []
    for _ in range(count):
        kind = rng.random()
        start = base + rng.randrange(400)
        if kind < 0.6:
            step = rng.choice([1, 1, 2, 3, 8])
            batches.append(list(range(start, start + step * rng.randrange(1, 12), step)))
        else:
            batches.append([base + rng.randrange(400) for _ in range(rng.randrange(1, 10))])
    return batches


@pytest.mark.parametrize("base", [0, 10**12, TOP - 1000])
@pytest.mark.parametrize("seed", range(8))
def test_an_index_set_holds_what_a_python_set_holds(seed: int, base: int) -> None:
    rng = random.Random(seed)
    seen, truth = IndexSet(), set()
    for batch in random_batches(rng, 300, base):
        probe = [base + rng.randrange(420) for _ in range(20)]
        probe = [value for value in probe if value <= TOP]
        assert seen.contains(probe).tolist() == [value in truth for value in probe]
        start, step = base + rng.randrange(400), rng.choice([1, 2, 5])
        count = min(rng.randrange(1, 30), (TOP - start) // step + 1)
        members = {start + i * step for i in range(count)}
        assert seen.overlap(start, step, count).tolist() == sorted(members & truth)
        seen.add([value for value in batch if value <= TOP])
        truth.update(value for value in batch if value <= TOP)
    assert seen.ranges().tolist() == ranges_of(truth)
    assert len(seen) == len(truth)
    copy = pickle.loads(pickle.dumps(seen))
    assert copy.ranges().tolist() == ranges_of(truth)


def test_the_largest_index_and_ids_far_apart_cost_a_run_each() -> None:
    seen = IndexSet()
    seen.add([TOP])
    seen.add_progression(0, 10**12, 1000)  # document ids 10^12 apart
    assert TOP in seen and 5 * 10**12 in seen and 5 not in seen
    assert len(seen) == 1001
    assert len(pickle.dumps(seen)) < 2000


def test_ranks_of_a_contiguous_dump_are_a_few_intervals_whatever_their_size() -> None:
    seen = IndexSet()
    world, batch = 8, 1000
    for start in range(0, 10**8, world * batch):  # 10^8 samples: 12,500 batches per rank
        for rank in range(world):
            seen.add_progression(start + rank, world, batch)
    assert seen.ranges().tolist() == [[0, 10**8 - 1]]
    assert len(pickle.dumps(seen)) < 4000  # what a resume broadcasts


def test_shuffled_batches_are_merged_as_they_fill_in() -> None:
    order = np.random.default_rng(0).permutation(200_000)
    seen = IndexSet()
    for batch in np.array_split(order, 400):
        seen.add(batch)
    assert seen.ranges().tolist() == [[0, 199_999]]
    assert repr(seen) == "IndexSet(200000 indices in 1 runs)"
