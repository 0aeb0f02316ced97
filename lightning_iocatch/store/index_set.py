"""IndexSet: a set of dataset indices whose memory grows with its runs, not its members.

Dataset indices arrive in batches that are arithmetic progressions almost always: a
sequential loader gives ``s, s+1, ...``, and each of ``W`` DDP ranks gives ``r, r+W, ...``.
An :class:`IndexSet` keeps, for each step ``s`` and residue ``r = i mod s`` it has seen,
the sorted, disjoint intervals of ``q = i // s``: a dump of 10^8 contiguous samples by 8
processes is 8 intervals, whatever its size, and an index up to ``2**63 - 1`` costs what
any other does. Indices that are no progression (a shuffled loader) are kept as runs of
step 1, and so is a short progression of a step not seen before (a shuffled pair ``a, b``
is a progression of step ``b - a``): it gets a group of its own only once the next
batch of its step and residue continues it (a DDP share in batches of two), or when it is
long. Groups are found by step and residue, never by a scan of all of them, and there are
at most :data:`_STEPS` steps: adding a batch and asking about one cost ``O(log n)`` per
index, whatever the batches' pattern. Membership, adding a batch, the union as ranges of
step 1 (:meth:`ranges`) and the members of a progression already present
(:meth:`overlap`) all work on intervals. Intervals are closed (``first, last``), so that
``2**63 - 1`` itself needs no bound past it.

Examples:
    >>> seen = IndexSet()
    >>> seen.add(range(0, 8, 2)); seen.add(range(1, 8, 2)); seen.add([20, 21, 22])
    >>> seen.ranges().tolist(), len(seen)
    ([[0, 7], [20, 22]], 11)
    >>> seen.contains([6, 9, 21]).tolist()
    [True, False, True]
    >>> seen.overlap(0, 5, 10).tolist()  # 0, 5, 10, ..., 45 already present
    [0, 5, 20]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["IndexSet", "progression"]

_PENDING = 32  # intervals added one by one before they are merged into the sorted arrays
_LONG = 8  # a progression this long gets a group of its step and residue at once
_STEPS = 64  # steps with groups at most; more asks of each query more work for nothing
_RECENT = 4096  # short progressions remembered, to see whether the next one continues them


def progression(indices: np.ndarray) -> tuple[int, int, int] | None:
    """``(start, step, count)`` when ``indices`` (sorted, distinct, non-empty) are one
    arithmetic progression, else ``None``."""
    if indices.size == 1:
        return int(indices[0]), 1, 1
    step = int(indices[1] - indices[0])
    if step >= 1 and bool((np.diff(indices) == step).all()):
        return int(indices[0]), step, int(indices.size)
    return None


class _Intervals:
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
        level = _normalize(starts, stops)
        while self._levels and self._levels[-1][0].size <= 4 * level[0].size:
            before = self._levels.pop()
            level = _normalize(np.concatenate([before[0], level[0]]),
                               np.concatenate([before[1], level[1]]))  # fmt: skip
        self._levels.append(level)

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """All intervals as one sorted, disjoint, non-adjacent level."""
        self._flush()
        if len(self._levels) > 1:
            starts = np.concatenate([level[0] for level in self._levels])
            stops = np.concatenate([level[1] for level in self._levels])
            self._levels = [_normalize(starts, stops)]
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
        starts, stops = _normalize(*np.array(parts, dtype=np.int64).reshape(-1, 2).T)
        return list(zip(starts.tolist(), stops.tolist(), strict=True))

    def span(self) -> tuple[int, int] | None:
        """The first and last integer covered, or ``None`` when empty."""
        firsts = [int(a[0]) for a, _ in self._levels] + [a for a, _ in self._pending]
        lasts = [int(b[-1]) for _, b in self._levels] + [b for _, b in self._pending]
        return (min(firsts), max(lasts)) if firsts else None

    def runs(self) -> int:
        return sum(level[0].size for level in self._levels) + len(self._pending)


def _normalize(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


class IndexSet:
    """Non-negative dataset indices (see the module docstring). Pickles compactly."""

    def __init__(self) -> None:
        # step -> residue -> q-intervals; step 1 (residue 0) holds runs of step 1
        self._groups: dict[int, dict[int, _Intervals]] = {}
        self._spans: dict[int, tuple[int, int]] = {}  # step -> lowest, highest index covered
        # (step, residue) -> q-interval of the last short progression kept as runs of step 1
        self._recent: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()

    def _group(self, step: int, residue: int, low: int, high: int) -> _Intervals:
        """The group of ``(step, residue)`` (made if new), its step's span grown to hold
        ``low .. high``."""
        span = self._spans.get(step)
        self._spans[step] = (low, high) if span is None else (min(span[0], low), max(span[1], high))
        residues = self._groups.setdefault(step, {})
        if residue not in residues:
            residues[residue] = _Intervals()
        return residues[residue]

    def add_progression(self, start: int, step: int, count: int) -> None:
        """Add ``start, start + step, ..., start + (count - 1) * step``."""
        if count <= 0:
            return
        step = 1 if count == 1 else step
        high = start + step * (count - 1)
        first, residue = divmod(start, step)
        last = first + count - 1
        if step == 1 or residue in self._groups.get(step, ()):
            self._group(step, residue, start, high).add(first, last)
            return
        before = self._recent.pop((step, residue), None)
        continued = before is not None and (before[1] + 1 == first or last + 1 == before[0])
        room = step in self._groups or len(self._groups) <= _STEPS
        if room and (count >= _LONG or continued):
            if before is not None and continued:  # its runs of step 1 stay where they are
                first, last = min(first, before[0]), max(last, before[1])
            self._group(step, residue, first * step + residue, last * step + residue).add(
                first, last
            )
            return
        units = self._group(1, 0, start, high)
        for value in range(start, high + 1, step):
            units.add(value, value)
        self._recent[(step, residue)] = (first, last)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def add(self, indices: Iterable[int] | np.ndarray) -> None:
        """Add ``indices`` (any order, repeats allowed)."""
        values = np.unique(np.asarray(list(indices) if not isinstance(indices, np.ndarray)
                                      else indices, dtype=np.int64))  # fmt: skip
        if not values.size:
            return
        found = progression(values)
        if found is not None:
            self.add_progression(*found)
            return
        breaks = np.flatnonzero(np.diff(values) != 1) + 1  # runs of step 1
        firsts = values[np.concatenate([[0], breaks])]
        lasts = values[np.concatenate([breaks - 1, [values.size - 1]])]
        units = self._group(1, 0, int(values[0]), int(values[-1]))
        if firsts.size > _LONG:
            units.add_many(firsts, lasts)
            return
        for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
            units.add(first, last)

    def contains(self, indices: Iterable[int] | np.ndarray) -> np.ndarray:
        """For each index, whether the set holds it."""
        values = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices),
                            dtype=np.int64)  # fmt: skip
        found = np.zeros(values.shape, dtype=bool)
        for step, residues in self._groups.items():
            low, high = self._spans[step]
            mine = ~found & (values >= low) & (values <= high)
            if mine.any():
                found[mine] = _held(residues, step, values[mine])
        return found

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and bool(self.contains([index])[0])

    def overlap(self, start: int, step: int, count: int) -> np.ndarray:
        """The members of the progression ``start, start + step, ...`` (``count`` of them)
        already in the set, ascending; work bounded by ``count`` per step held, and by the
        parts it overlaps in the group of its own step and residue."""
        if count <= 0:
            return np.empty(0, dtype=np.int64)
        step = 1 if count == 1 else step
        high = start + step * (count - 1)
        found: list[np.ndarray] = []
        for s, residues in self._groups.items():
            low_s, high_s = self._spans[s]
            if high_s < start or low_s > high:
                continue
            if s == step:  # the same progression: in its q-space, its one group
                intervals = residues.get(start % step)
                q0 = start // step
                for a, b in intervals.overlap(q0, q0 + count - 1) if intervals else ():
                    found.append(np.arange(a, b + 1, dtype=np.int64) * step + start % step)
                continue
            low = max(start, low_s)  # another step: test its members within the span
            first = start + -(-(low - start) // step) * step
            last = min(high, high_s)
            if first <= last:
                members = np.arange(first, last + 1, step, dtype=np.int64)
                found.append(members[_held(residues, s, members)])
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(found))

    def ranges(self) -> np.ndarray:
        """The set as sorted, disjoint, closed ranges ``[first, last]`` of step 1: an
        ``(n, 2)`` int64 array."""
        starts: list[np.ndarray] = []
        stops: list[np.ndarray] = []
        for step in sorted(self._groups):
            residues = self._groups[step]
            full = _common(list(residues.values())) if len(residues) == step else None
            for residue, intervals in residues.items():
                rest = intervals.merged()
                if full is not None and step > 1:
                    rest = _minus(*rest, *full)
                if step == 1:
                    starts.append(rest[0])
                    stops.append(rest[1])
                    continue
                points = np.concatenate(
                    [np.arange(a, b + 1, dtype=np.int64) for a, b in zip(*rest, strict=True)]
                    or [np.empty(0, dtype=np.int64)]
                )
                starts.append(points * step + residue)
                stops.append(points * step + residue)
            if full is not None and step > 1:  # every residue of q: the values q*s .. q*s+s-1
                starts.append(full[0] * step)
                stops.append(full[1] * step + (step - 1))
        if not starts:
            return np.empty((0, 2), dtype=np.int64)
        return np.stack(_normalize(np.concatenate(starts), np.concatenate(stops)), axis=1)

    def __len__(self) -> int:
        bounds = self.ranges()  # a run's length less one fits int64 even up to 2**63 - 1
        return int((bounds[:, 1] - bounds[:, 0]).sum()) + len(bounds)

    def __bool__(self) -> bool:
        return bool(self._spans)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "groups": {
                (step, residue): group.merged()
                for step, residues in self._groups.items()
                for residue, group in residues.items()
            }
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        for (step, residue), (starts, stops) in state["groups"].items():
            if starts.size:
                low, high = int(starts[0]) * step + residue, int(stops.max()) * step + residue
                self._group(step, residue, low, high).add_many(starts, stops)

    def __repr__(self) -> str:
        runs = sum(
            group.runs() for residues in self._groups.values() for group in residues.values()
        )
        return f"IndexSet({len(self)} indices in {runs} runs)"


def _held(residues: dict[int, _Intervals], step: int, values: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is ``r + q * step`` for a group ``r`` of ``residues``
    holding ``q``: one lookup per residue the values have, none per group."""
    if step == 1:
        return residues[0].contains(values)
    found = np.zeros(values.shape, dtype=bool)
    quotients, remainders = np.divmod(values, step)
    for residue in np.unique(remainders).tolist():
        group = residues.get(residue)
        if group is not None:
            mine = remainders == residue
            found[mine] = group.contains(quotients[mine])
    return found


def _common(groups: list[_Intervals]) -> tuple[np.ndarray, np.ndarray]:
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


def _minus(
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
