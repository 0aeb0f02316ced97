"""The order of an epoch of :class:`~lightning_iocatch.store.training.StoreRows`: one sequence
of rows for all processes, and how a run of ``world`` processes reads it in steps.

**The sequence** (:class:`EpochSequence`) of epoch ``e`` of a store read with seed ``s``
depends on ``(s, e)``, the rows read and ``shuffle_rows``, and on nothing else (not the
number of processes, workers, or the batch size):

1. the blocks (the rows read of each stored batch) in an order drawn from ``(s, e)`` (commit
   order without ``shuffle``), laid end to end: rows ``L[0..N)``;
2. ``L`` cut into windows of ``shuffle_rows`` rows (the last one shorter), each window's rows
   in an order drawn from ``(s, e, window)``: the sequence ``S[0..N)`` (``S = L`` without
   ``shuffle``).

**A run reads it in steps** (:class:`StepPlan`): a run that starts at row ``first`` of ``S``
(0, or where a resumed epoch stopped) reads ``S[first..N)`` in global steps of ``world x
batch_size`` rows; step ``t``'s rows go to the ranks in rank order, ``batch_size`` each. So
whatever the number of processes, the rows consumed after ``k`` rows are ``S[0..k)``, which
is what lets a run resumed on another number of processes, workers or batch size finish the
epoch with every row once. The last one or two steps are shortened so that every rank has
the same number of non-empty batches (DDP needs it): rows left over after the full steps are
shared out one more step, every rank one or more rows; where fewer are left than ranks, the
step before gives up one row of some ranks. ``drop_last`` reads the full steps only.

Examples:
    >>> sequence = EpochSequence([3, 2, 4], seed=0, epoch=0, shuffle=False, shuffle_rows=4)
    >>> sequence.locate(2, 6)  # rows 2..5 of S: block, row within the block
    (array([0, 1, 1, 2]), array([2, 0, 1, 0]))
    >>> plan = StepPlan(first=0, total=9, world=2, batch_size=2, drop_last=False)
    >>> len(plan), [plan.share(step, 1) for step in range(len(plan))]
    (3, [(2, 2), (5, 2), (8, 1)])
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["EpochSequence", "StepPlan", "generator"]


def generator(*parts: int | str) -> torch.Generator:
    """A torch generator seeded from ``parts`` (the same in every process and platform)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class EpochSequence:
    """The sequence ``S`` of one epoch (see the module docstring), located in the blocks."""

    def __init__(
        self, counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool, shuffle_rows: int
    ) -> None:
        blocks = len(counts)
        if shuffle:
            self._order = torch.randperm(blocks, generator=generator(seed, epoch)).numpy()
        else:
            self._order = np.arange(blocks, dtype=np.int64)
        ordered = np.asarray(counts, dtype=np.int64)[self._order]
        self._ends = np.cumsum(ordered)
        self._starts = self._ends - ordered
        self.total = int(self._ends[-1]) if blocks else 0
        self._key = (seed, epoch)
        self._shuffle, self._window = shuffle, shuffle_rows
        self._permutations: dict[int, np.ndarray] = {}

    def _permutation(self, window: int) -> np.ndarray:
        permutation = self._permutations.get(window)
        if permutation is None:
            size = min(self._window, self.total - window * self._window)
            gen = generator(*self._key, "window", window)
            permutation = torch.randperm(size, generator=gen).numpy()
            if len(self._permutations) >= 2:  # a run reads windows in order: keep two
                self._permutations.pop(next(iter(self._permutations)))
            self._permutations[window] = permutation
        return permutation

    def positions(self, first: int, stop: int) -> np.ndarray:
        """Where rows ``S[first..stop)`` are in ``L`` (the blocks laid end to end)."""
        positions = np.arange(first, stop, dtype=np.int64)
        if not self._shuffle or first >= stop:
            return positions
        windows = positions // self._window
        for window in np.unique(windows).tolist():
            mine = windows == window
            base = window * self._window
            positions[mine] = base + self._permutation(window)[positions[mine] - base]
        return positions

    def locate(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``S[first..stop)`` as (block, row of the rows read from that block)."""
        positions = self.positions(first, stop)
        slot = np.searchsorted(self._ends, positions, side="right")
        return self._order[slot], positions - self._starts[slot]


class StepPlan:
    """How a run of ``world`` processes reads rows ``S[first..total)`` in batches of
    ``batch_size``: the same number of batches on every rank (see the module docstring)."""

    def __init__(
        self, *, first: int, total: int, world: int, batch_size: int, drop_last: bool
    ) -> None:
        self.first, self.world, self.batch_size = first, world, batch_size
        rows = total - first
        full, left = divmod(rows, world * batch_size)
        self._uniform, self._last = full, []  # steps of batch_size each, then shorter ones
        if drop_last and not full and not first:
            raise ValueError(
                f"{rows} rows over {world} process(es) are fewer than `batch_size` "
                f"{batch_size} per process: `drop_last=True` would drop every batch"
            )
        if drop_last or not left:
            pass
        elif left >= world:
            quotient, remainder = divmod(left, world)
            self._last = [[quotient + (rank < remainder) for rank in range(world)]]
        elif full and batch_size > 1:  # some ranks give the next step one row
            self._uniform -= 1
            giving = world - left
            before = [batch_size - (rank < giving) for rank in range(world)]
            self._last = [before, [1] * world]
        else:
            fix = (
                "use a `batch_size` of 2 or more, fewer processes, or `drop_last=True`"
                if full
                else f"use at most {rows} processes, or `drop_last=True`"
            )
            where = " (what is left of a resumed epoch)" if first else ""
            raise ValueError(
                f"{rows} rows{where} cannot give {world} processes the same number of "
                f"non-empty batches of at most {batch_size} rows each; {fix}"
            )

    def __len__(self) -> int:
        return self._uniform + len(self._last)

    def rows_before(self, step: int) -> int:
        """Rows of ``S`` read by the steps before ``step`` (after ``first``)."""
        uniform = min(step, self._uniform)
        rows = uniform * self.world * self.batch_size
        return rows + sum(sum(counts) for counts in self._last[: max(step - uniform, 0)])

    def share(self, step: int, rank: int) -> tuple[int, int]:
        """Where in ``S`` rank ``rank``'s batch of step ``step`` starts, and its rows."""
        if step < self._uniform:
            counts = [self.batch_size] * self.world
        else:
            counts = self._last[step - self._uniform]
        return self.first + self.rows_before(step) + sum(counts[:rank]), counts[rank]
