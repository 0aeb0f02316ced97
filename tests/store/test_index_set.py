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


def pattern_batches(kind: str, rng: random.Random, count: int, base: int) -> list[list[int]]:
    """Batches as loaders make them: shuffled pairs and triples, random sparse ids, strided
    DDP shares in pairs, long progressions of many steps, and all of them mixed."""
    width = 3 * count
    order = list(range(base, base + width))
    rng.shuffle(order)
    if kind in ("pairs", "triples"):
        size = 2 if kind == "pairs" else 3
        return [order[i : i + size] for i in range(0, count * size, size)]
    if kind == "sparse":
        return [[base + rng.randrange(width * 50) for _ in range(rng.randrange(1, 6))]
                for _ in range(count)]  # fmt: skip
    if kind == "strided":  # ranks of a world of 3, batches of two, some batches lost
        world = 3
        share = [base + rank + world * i for rank in range(world) for i in range(0, count, 2)]
        return [share[i : i + 2] for i in range(0, len(share), 2) if rng.random() < 0.9]
    if kind == "steps":  # progressions of 8 to 12 members, of more steps than get groups
        return [list(range(base + rng.randrange(width), base + 4 * width, rng.randrange(2, 300)))
                [: rng.randrange(8, 13)] for _ in range(count)]  # fmt: skip
    kinds = ["pairs", "triples", "sparse", "strided", "steps"]
    parts = [pattern_batches(k, rng, count, base) for k in kinds]
    return [part[i] for i in range(count) for part in parts if i < len(part)]


@pytest.mark.parametrize("base", [0, TOP - 10**6])
@pytest.mark.parametrize("kind", ["pairs", "triples", "sparse", "strided", "steps", "mixed"])
def test_an_index_set_of_any_batch_pattern_holds_what_a_python_set_holds(
    kind: str, base: int
) -> None:
    rng = random.Random(f"{kind}{base}")
    seen, truth = IndexSet(), set()
    for batch in pattern_batches(kind, rng, 80 if kind == "mixed" else 250, base):
        batch = [value for value in batch if value <= TOP]
        if not batch:
            continue
        probe = batch + [base + rng.randrange(1200) for _ in range(4)]
        probe = [value for value in probe if value <= TOP]
        assert seen.contains(probe).tolist() == [value in truth for value in probe]
        values = sorted(set(batch))
        step = values[1] - values[0] if len(values) > 1 else 1
        count = min(len(values) + 2, (TOP - values[0]) // step + 1)
        members = {values[0] + i * step for i in range(count)}
        assert seen.overlap(values[0], step, count).tolist() == sorted(members & truth)
        seen.add(batch)
        truth.update(batch)
    assert seen.ranges().tolist() == ranges_of(truth)
    assert len(seen) == len(truth) and bool(seen)
    copy = pickle.loads(pickle.dumps(seen))
    assert copy.ranges().tolist() == ranges_of(truth)
    assert copy.contains(sorted(truth)).all()


def test_a_ddp_share_in_pairs_is_a_few_runs_and_shuffled_pairs_make_no_groups() -> None:
    share = IndexSet()
    for start in range(0, 4 * 10**5, 4):  # rank 0 of 2 in batches of two: 0, 2 | 4, 6 | ...
        share.add([start, start + 2])
    assert len(share) == 2 * 10**5 and 399_998 in share and 399_999 not in share
    assert len(pickle.dumps(share)) < 2000  # what a resume broadcasts
    pairs = IndexSet()
    order = np.random.default_rng(0).permutation(20_000)
    for i in range(0, order.size, 2):
        pairs.add(order[i : i + 2])
    assert pairs.ranges().tolist() == [[0, 19_999]]
    assert len(pickle.dumps(pairs)) < 4000  # no group left per pair


def test_the_largest_index_counts_and_spans_without_overflow() -> None:
    seen = IndexSet()
    seen.add_progression(TOP - 4, 1, 5)
    seen.add([TOP - 10, TOP - 8])
    assert len(seen) == 7
    assert seen.overlap(TOP - 10, 1, 11).tolist() == [TOP - 10, TOP - 8, *range(TOP - 4, TOP + 1)]
    assert seen.ranges().tolist() == [[TOP - 10, TOP - 10], [TOP - 8, TOP - 8], [TOP - 4, TOP]]
