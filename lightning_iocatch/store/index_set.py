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
(:meth:`overlap`) all work on intervals; the size (``len``) is counted from them, never
from the members, and :meth:`iter_ranges` makes the ranges a block at a time (one DDP
rank's share alone is one interval but a range per member). Intervals are closed
(``first, last``), so that ``2**63 - 1`` itself needs no bound past it.

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
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from lightning_iocatch.store.intervals import (
    EMPTY,
    Intervals,
    Points,
    common,
    in_runs,
    members,
    minus,
    normalize,
    runs_hold,
)

__all__ = ["IndexSet", "progression"]

_LONG = 8  # a progression this long gets a group of its step and residue at once
_STEPS = 64  # steps with groups at most; more asks of each query more work for nothing
_RECENT = 4096  # short progressions remembered, to see whether the next one continues them
_BLOCK = 1 << 16  # members of groups of two steps tested at a time when counting


def progression(indices: np.ndarray) -> tuple[int, int, int] | None:
    """``(start, step, count)`` when ``indices`` (sorted, distinct, non-empty) are one
    arithmetic progression, else ``None``."""
    if indices.size == 1:
        return int(indices[0]), 1, 1
    step = int(indices[1] - indices[0])
    if step >= 1 and bool((np.diff(indices) == step).all()):
        return int(indices[0]), step, int(indices.size)
    return None


class IndexSet:
    """Non-negative dataset indices (see the module docstring). Pickles compactly."""

    def __init__(self) -> None:
        # step -> residue -> q-intervals; step 1 (residue 0) holds runs of step 1
        self._groups: dict[int, dict[int, Intervals]] = {}
        self._spans: dict[int, tuple[int, int]] = {}  # step -> lowest, highest index covered
        # (step, residue) -> q-interval of the last short progression kept as runs of step 1
        self._recent: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()

    def _group(self, step: int, residue: int, low: int, high: int) -> Intervals:
        """The group of ``(step, residue)`` (made if new), its step's span grown to hold
        ``low .. high``."""
        span = self._spans.get(step)
        self._spans[step] = (low, high) if span is None else (min(span[0], low), max(span[1], high))
        residues = self._groups.setdefault(step, {})
        if residue not in residues:
            residues[residue] = Intervals()
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

    def _parts(
        self,
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray, int, int]]]:
        """The runs of step 1 (with the q-ranges every residue of a step holds, as the runs
        they are), normalized, and each strided group's other q-intervals."""
        starts, stops = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
        rests = []
        for step in sorted(self._groups):
            residues = self._groups[step]
            full = common(list(residues.values())) if 1 < step == len(residues) else None
            for residue, intervals in residues.items():
                rest = intervals.merged()
                if step == 1:
                    starts.append(rest[0])
                    stops.append(rest[1])
                    continue
                rest = minus(*rest, *full) if full is not None else rest
                if rest[0].size:
                    rests.append((*rest, step, residue))
            if full is not None:  # every residue of q: the values q*s .. q*s+s-1
                starts.append(full[0] * step)
                stops.append(full[1] * step + (step - 1))
        return *normalize(np.concatenate(starts), np.concatenate(stops)), rests

    def ranges(self) -> np.ndarray:
        """The set as sorted, disjoint, closed ranges ``[first, last]`` of step 1: an
        ``(n, 2)`` int64 array, one range per member of a strided group that no other member
        adjoins (see :meth:`iter_ranges` to read them a block at a time)."""
        starts, stops, rests = self._parts()
        points = [np.empty(0, dtype=np.int64)]
        for q0, q1, step, residue in rests:
            points.append(Points(q0, q1, step, residue, None).values)
        every = np.concatenate(points)
        return np.stack(normalize(np.concatenate([starts, every]),
                                   np.concatenate([stops, every])), axis=1)  # fmt: skip

    def iter_ranges(self, block: int = 1 << 16) -> Iterator[np.ndarray]:
        """:meth:`ranges` as consecutive ``(n, 2)`` arrays, made as they are read: a strided
        group's members are made ``block`` at a time, so a reader that stops early (the
        first gaps) holds a block per group, not the group."""
        starts, stops, rests = self._parts()
        streams = [Points(*rest, block) for rest in rests]
        held: np.ndarray | None = None  # the last range so far: the next may extend it
        at = 0
        while True:
            streams = [stream for stream in streams if stream.values.size]
            bound = min((int(stream.values[-1]) for stream in streams), default=None)
            upto = starts.size if bound is None else int(np.searchsorted(starts, bound, "right"))
            points = [stream.take(bound) for stream in streams if bound is not None]
            every = np.concatenate(points or [np.empty(0, dtype=np.int64)])
            low = [starts[at:upto], every] + ([held[:1]] if held is not None else [])
            high = [stops[at:upto], every] + ([held[1:]] if held is not None else [])
            at = upto
            found = np.stack(normalize(np.concatenate(low), np.concatenate(high)), axis=1)
            if bound is None:
                if found.size:
                    yield found
                return
            if found.size:
                held = found[-1]
                if len(found) > 1:
                    yield found[:-1]

    def __len__(self) -> int:
        """Counted from the intervals, in Python integers: a member that runs of step 1 or
        groups of other steps hold too counts once."""
        units = self._groups.get(1, {}).get(0)
        u0, u1 = units.merged() if units is not None else (EMPTY, EMPTY)
        total = members(u0, u1)
        for step, residues in self._groups.items():
            for residue, group in residues.items() if step > 1 else ():
                q0, q1 = group.merged()
                total += members(q0, q1) - runs_hold(q0, q1, step, residue, u0, u1)
        return total - self._strided_twice(u0, u1)

    def _strided_twice(self, u0: np.ndarray, u1: np.ndarray) -> int:
        """How many more times the groups of steps above 1 count the members outside the
        runs of step 1 than the members are: tested a block at a time where the groups of
        two steps or more reach (the spans of one step's residues never share a member)."""
        covers = []
        for step, residues in self._groups.items():
            if step > 1:
                merged = [(*g.merged(), r) for r, g in residues.items()]
                lows = np.concatenate([q0 * step + r for q0, _, r in merged])
                covers.append(
                    normalize(lows, np.concatenate([q1 * step + r for _, q1, r in merged]))
                )
        if len(covers) < 2:
            return 0
        coords = np.concatenate([c[0] for c in covers] + [c[1] for c in covers])
        ends = np.repeat([0, 1], coords.size // 2)  # at one coordinate, starts come first
        order = np.lexsort((ends, coords))
        delta = np.where(ends[order] == 0, 1, -1)
        depth = np.cumsum(delta)
        firsts = coords[order][(delta == 1) & (depth == 2)].tolist()
        lasts = coords[order][(delta == -1) & (depth == 1)].tolist()
        twice = 0
        for first, last in zip(firsts, lasts, strict=True):
            for low in range(first, last + 1, _BLOCK):
                values = np.arange(min(last - low + 1, _BLOCK), dtype=np.int64) + low
                values = values[~in_runs(u0, u1, values)]
                held = [_held(r, s, values) for s, r in self._groups.items() if s > 1]
                twice += int(np.sum(held)) - int(np.any(held, axis=0).sum())
        return twice

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


def _held(residues: dict[int, Intervals], step: int, values: np.ndarray) -> np.ndarray:
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
