"""Sorted, disjoint intervals of integers, the storage of :class:`~.index_set.IndexSet`.

:class:`Intervals` keeps the q-intervals of one step and residue (a log-structured merge of
sorted levels); the functions count, intersect and subtract such intervals without making
their members, and :class:`Points` makes the members of a strided group a block at a time.
Intervals are closed (``first, last``): ``2**63 - 1`` itself needs no bound past it.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "EMPTY",
    "Intervals",
    "Points",
    "common",
    "in_runs",
    "members",
    "minus",
    "normalize",
    "runs_hold",
]

_PENDING = 32  # intervals added one by one before they are merged into the sorted arrays
EMPTY = np.empty(0, dtype=np.int64)


class Intervals:
    """Closed intervals ``[first, last]`` of integers, kept as a few levels of sorted,
    disjoint, non-adjacent intervals, each level less than a quarter of the one before it
    (a log-structured merge): adding ``k`` intervals costs ``O(k log n)`` over time, not a
    merge of all ``n``, and a query asks each of the ``O(log n)`` levels. Intervals added one
    by one wait in a short list (merged at :data:`_PENDING`), which queries read as it is:
    a batch at a time, adding and asking costs little array work."""

    def __init__(self) -> None:
        self._levels: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending: list[tuple[int, int]] = []

    def add(self, first: int, last: int) -> None:
        if self._pending and self._pending[-1][1] == first - 1:  # the common case: extend
            self._pending[-1] = (self._pending[-1][0], last)
        else:
            self._pending.append((first, last))
        if len(self._pending) >= _PENDING:
            self._flush()

    def add_many(self, starts: np.ndarray, stops: np.ndarray) -> None:
        self._flush()
        self._push(starts, stops)

    def _flush(self) -> None:
        if self._pending:
            pending = np.array(self._pending, dtype=np.int64).reshape(-1, 2)
            self._pending = []
            self._push(pending[:, 0], pending[:, 1])

    def _push(self, starts: np.ndarray, stops: np.ndarray) -> None:
        level = normalize(starts, stops)
        while self._levels and self._levels[-1][0].size <= 4 * level[0].size:
            before = self._levels.pop()
            level = normalize(np.concatenate([before[0], level[0]]),
                               np.concatenate([before[1], level[1]]))  # fmt: skip
        self._levels.append(level)

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """All intervals as one sorted, disjoint, non-adjacent level."""
        self._flush()
        if len(self._levels) > 1:
            starts = np.concatenate([level[0] for level in self._levels])
            stops = np.concatenate([level[1] for level in self._levels])
            self._levels = [normalize(starts, stops)]
        if not self._levels:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return self._levels[0]

    def contains(self, values: np.ndarray) -> np.ndarray:
        found = np.zeros(values.shape, dtype=bool)
        if len(self._pending) * values.size > 4 * _PENDING:  # a long query: arrays first
            self._flush()
        if self._pending:
            pending = np.array(self._pending, dtype=np.int64)
            inside = (values[..., None] >= pending[:, 0]) & (values[..., None] <= pending[:, 1])
            found |= inside.any(axis=-1)
        for starts, stops in self._levels:
            at = np.searchsorted(starts, values, side="right") - 1
            inside = at >= 0
            inside[inside] = values[inside] <= stops[at[inside]]
            found |= inside
        return found

    def overlap(self, first: int, last: int) -> list[tuple[int, int]]:
        """The parts of ``[first, last]`` that these intervals cover, as closed intervals."""
        parts = [
            (max(first, a), min(last, b)) for a, b in self._pending if a <= last and b >= first
        ]
        sources = len(self._levels) + bool(parts)
        for starts, stops in self._levels:
            low = int(np.searchsorted(stops, first, side="left"))
            high = int(np.searchsorted(starts, last, side="right"))
            parts += [
                (max(first, int(a)), min(last, int(b)))
                for a, b in zip(starts[low:high], stops[low:high], strict=True)
            ]
        if sources < 2:
            return parts
        starts, stops = normalize(*np.array(parts, dtype=np.int64).reshape(-1, 2).T)
        return list(zip(starts.tolist(), stops.tolist(), strict=True))

    def span(self) -> tuple[int, int] | None:
        """The first and last integer covered, or ``None`` when empty."""
        firsts = [int(a[0]) for a, _ in self._levels] + [a for a, _ in self._pending]
        lasts = [int(b[-1]) for _, b in self._levels] + [b for _, b in self._pending]
        return (min(firsts), max(lasts)) if firsts else None

    def runs(self) -> int:
        return sum(level[0].size for level in self._levels) + len(self._pending)


def normalize(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Closed intervals as sorted, disjoint, non-adjacent ones covering the same integers."""
    if not starts.size:
        return starts.astype(np.int64), stops.astype(np.int64)
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    new = np.ones(starts.size, dtype=bool)
    new[1:] = starts[1:] - 1 > reach[:-1]  # a gap before it: a new interval starts here
    firsts = np.flatnonzero(new)
    return starts[firsts], reach[np.append(firsts[1:] - 1, starts.size - 1)]


def common(groups: list[Intervals]) -> tuple[np.ndarray, np.ndarray]:
    """The q-intervals every one of ``groups`` covers."""
    starts, stops = groups[0].merged()
    for other in groups[1:]:
        starts, stops = _intersect(starts, stops, *other.merged())
    return starts, stops


def _intersect(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    out0, out1 = [], []
    i = j = 0
    while i < a0.size and j < b0.size:
        low, high = max(a0[i], b0[j]), min(a1[i], b1[j])
        if low <= high:
            out0.append(low)
            out1.append(high)
        if a1[i] < b1[j]:
            i += 1
        else:
            j += 1
    return np.array(out0, dtype=np.int64), np.array(out1, dtype=np.int64)


def minus(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Closed intervals ``[a0, a1]`` without ``[b0, b1]`` (both sorted and disjoint)."""
    out0, out1 = [], []
    j = 0
    for first, last in zip(a0.tolist(), a1.tolist(), strict=True):
        while j < b0.size and int(b1[j]) < first:
            j += 1
        k, at = j, first  # the first integer not yet emitted or removed
        while k < b0.size and int(b0[k]) <= last:
            if int(b0[k]) > at:
                out0.append(at)
                out1.append(int(b0[k]) - 1)
            at = max(at, int(b1[k]) + 1)
            k += 1
        if at <= last:
            out0.append(at)
            out1.append(last)
    return np.array(out0, dtype=np.int64), np.array(out1, dtype=np.int64)


class Points:
    """The members ``residue + q * step`` of sorted, disjoint q-intervals, ascending, made
    ``block`` at a time (all at once for ``None``)."""

    def __init__(
        self, q0: np.ndarray, q1: np.ndarray, step: int, residue: int, block: int | None
    ) -> None:
        sizes = q1 - q0 + 1
        self._q0, self._ends = q0, np.cumsum(sizes)  # members up to each interval's end
        self._before = self._ends - sizes
        self._step, self._residue, self._block, self._made = step, residue, block, 0
        self.values = EMPTY
        self._make()

    def _make(self) -> None:
        total = int(self._ends[-1])
        count = total - self._made if self._block is None else min(self._block, total - self._made)
        at = np.arange(self._made, self._made + count, dtype=np.int64)
        which = np.searchsorted(self._ends, at, side="right")
        self.values = (self._q0[which] + at - self._before[which]) * self._step + self._residue
        self._made += count

    def take(self, bound: int) -> np.ndarray:
        """The members up to ``bound`` not taken yet (making the next block when done)."""
        cut = int(np.searchsorted(self.values, bound, side="right"))
        taken, self.values = self.values[:cut], self.values[cut:]
        if not self.values.size and self._made < int(self._ends[-1]):
            self._make()
        return taken


def members(first: np.ndarray, last: np.ndarray) -> int:
    """The integers of disjoint closed intervals (below 2**63, so the sum of the lengths
    less one fits int64)."""
    return int((last - first).sum()) + int(first.size)


def in_runs(first: np.ndarray, last: np.ndarray, values: np.ndarray) -> np.ndarray:
    at = np.searchsorted(first, values, side="right") - 1
    inside = at >= 0
    inside[inside] = values[inside] <= last[at[inside]]
    return inside


def runs_hold(
    q0: np.ndarray, q1: np.ndarray, step: int, residue: int, u0: np.ndarray, u1: np.ndarray
) -> int:
    """How many ``residue + q * step`` (``q`` in the intervals ``q0 .. q1``) the runs
    ``u0 .. u1`` hold: the runs as q-intervals, and the group's members below each end."""
    if not (q0.size and u0.size):
        return 0
    low, high = -((residue - u0) // step), (u1 - residue) // step  # the q each run holds
    low, high = low[low <= high], high[low <= high]
    sizes = q1 - q0 + 1
    before = np.cumsum(sizes) - sizes  # the group's members before each interval

    def upto(values: np.ndarray) -> np.ndarray:  # the group's members up to each value
        at = np.searchsorted(q0, values, side="right") - 1
        i = np.maximum(at, 0)
        return np.where(at >= 0, before[i] + np.minimum(values, q1[i]) - q0[i] + 1, 0)

    return int((upto(high) - upto(low - 1)).sum())
