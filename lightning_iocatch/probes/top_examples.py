"""The k largest activations of every unit, kept as rows stream by: state and merge rule.

The state of ``U`` units is a :class:`Top`: per unit, ``k`` slots ordered best first,
each an activation with the row it came from (its sample's dataset index and its token
position, -1 for a row that is a whole sample) and the tokens around it (their ids and
this unit's activations on them). Slots are ordered by value, largest first, then by
dataset index, then by position, both ascending: the order of a total key, so the same
rows give the same slots whatever the batches, their order or the number of processes
(:func:`merge_tops` of any split of the rows is the top of all of them). An empty slot
has value ``-inf`` and index -1; NaN and ``-inf`` activations never fill a slot, nor,
with ``above``, values at or below it. A row seen twice (the same index and position,
e.g. padding a sampler repeats) fills one slot.

Each batch costs a pass over its values and a sort of the values found: per unit those at
or above its last slot, or, while its slots are not all filled, at or above the batch's own
``k``-th best above ``above``: at most ``k`` per unit and batch (and their ties). In three
steps (:func:`begin_top`, :func:`candidates` a chunk of rows at a time, :func:`finish_top`)
so that the density's pass can hand its active entries over
(:mod:`~lightning_iocatch.probes.unit_pass`); there an unfilled unit is bounded by each
chunk's own ``k``-th best, and only where it has more than ``k`` entries in the chunk.

Examples:
    >>> rows = Rows(torch.tensor([[1.0], [3.0], [3.0]]), torch.tensor([7, 5, 9]), torch.tensor([-1, -1, -1]))
    >>> top = update_top(empty_top(1, k=2, width=0), rows)
    >>> top.values.tolist(), top.indices.tolist()  # the tie at 3.0: index 5 before 9
    ([[3.0, 3.0]], [[5, 9]])
"""  # noqa: E501

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_iocatch.probes.unit_density import above_cut, chunks, lowest_above
from lightning_iocatch.probes.unit_rows import Ordered, Rows, neighbours, ordered_rows

__all__ = [
    "Batch",
    "Rows",
    "Top",
    "begin_top",
    "candidates",
    "empty_top",
    "finish_top",
    "join_entries",
    "merge_tops",
    "update_top",
]

_EMPTY = float("-inf")
_CHUNK = 1 << 22  # values looked at a time for a batch's k-th best: bounds its memory


class Top(NamedTuple):
    """The best ``k`` slots of each of ``U`` units (see the module docstring).

    ``values`` ``(U, k)`` float64, ``index`` and ``position`` ``(U, k)`` int64,
    ``context_ids`` ``(U, k, 2w+1)`` int64 (-1 where no token) and ``context_values``
    ``(U, k, 2w+1)`` float32 (NaN where no token): the window of ``w`` tokens each side
    of the slot's token, the slot's own token in the middle.
    """

    values: Tensor
    indices: Tensor
    positions: Tensor
    context_ids: Tensor
    context_values: Tensor


def empty_top(units: int, k: int, width: int, device: torch.device | None = None) -> Top:
    """``units`` units of ``k`` empty slots with windows of ``width`` tokens each side."""
    span = 2 * width + 1  # with width 0: the example's own token
    return Top(
        torch.full((units, k), _EMPTY, dtype=torch.float64, device=device),
        torch.full((units, k), -1, dtype=torch.int64, device=device),
        torch.full((units, k), -1, dtype=torch.int64, device=device),
        torch.full((units, k, span), -1, dtype=torch.int64, device=device),
        torch.full((units, k, span), torch.nan, dtype=torch.float32, device=device),
    )


def update_top(top: Top, rows: Rows, above: float | None = None) -> Top:
    """``top`` with the rows of one batch taken in (``top`` has the rows' unit count),
    updated in place.

    ``above``: only values greater than it fill slots. Rows may come in any order; a
    sample's rows must all be in the batch for its windows to be whole.
    """
    units, k = top.values.shape
    if rows.values.shape[0] == 0 or k == 0 or units == 0:
        return top
    batch = begin_top(top, rows, above)
    lowest = _lowest(rows.values, batch)  # the batch's k-th best: no chunk needs a bound
    batch = batch._replace(lowest=lowest, unfilled=None)
    parts = [
        candidates(batch, chunk, start, *above_cut(chunk, batch.lowest))
        for start, chunk in chunks(rows.values)
    ]
    return finish_top(top, rows.values, batch, *join_entries(parts))


class Batch(NamedTuple):
    """What the top needs of one batch besides its values: its rows in (index, position)
    order, the rows seen before in it (``None``: none), per unit the lowest value that may
    still fill a slot (in ``work``, the dtype the slots compare in) and the one above
    ``above`` (``None``: no such bound), and the units whose slots are not all filled."""

    ordered: Ordered
    again: Tensor | None
    lowest: Tensor
    floor: float | None
    unfilled: Tensor | None
    work: torch.dtype
    k: int


def begin_top(top: Top, rows: Rows, above: float | None) -> Batch:
    """A batch's :class:`Batch`, its ``lowest`` from the slots alone: the last slot's
    value (a tie may win on its index), or the next value above ``above``."""
    work = torch.float64 if rows.values.dtype == torch.float64 else torch.float32
    ordered = ordered_rows(rows)
    floor = None if above is None else float(lowest_above(above, work))  # exact in `work`
    lowest = top.values[:, -1].to(work, copy=True)
    if floor is not None:
        lowest = lowest.clamp(min=floor)
    empty = top.values[:, -1] == _EMPTY
    unfilled = empty if bool(empty.any()) else None
    return Batch(ordered, ordered.again, lowest, floor, unfilled, work, top.values.shape[1])


def candidates(
    batch: Batch, chunk: Tensor, start: int, row: Tensor, unit: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``(row, unit, value)`` entries of the batch's rows ``start ..`` (``chunk``,
    entries at or above every unit's ``lowest`` among them) that may fill a slot, rows
    numbered in the batch, values in ``batch.work``: at most ``k`` a unit and chunk (and
    their ties) for a unit whose slots are not all filled, bounded by the chunk's own
    ``k``-th best."""
    value = value.to(batch.work)
    keep = (value >= batch.lowest[unit]) & (value > _EMPTY)  # -inf: never an example
    if batch.again is not None:
        keep &= ~batch.again[row + start]
    row, unit, value = row[keep] + start, unit[keep], value[keep]
    if batch.unfilled is None:
        return row, unit, value
    k = batch.k
    crowded = batch.unfilled & (torch.bincount(unit, minlength=batch.lowest.numel()) > k)
    crowded = crowded.nonzero().squeeze(1)
    if crowded.numel():
        again = None if batch.again is None else batch.again[start : start + chunk.shape[0]]
        bound = torch.full_like(batch.lowest, _EMPTY)
        bound[crowded] = _kth_best(chunk, crowded, batch.floor, k, again)
        keep = value >= bound[unit]
        row, unit, value = row[keep], unit[keep], value[keep]
    return row, unit, value


def finish_top(
    top: Top, values: Tensor, batch: Batch, row: Tensor, unit: Tensor, value: Tensor
) -> Top:
    """``top`` with the batch's candidates ``(row, unit, value)`` (rows numbered in the
    batch ``values``) taken in, in place."""
    units, k = top.values.shape
    if row.numel() == 0:
        return top
    ordered = batch.ordered
    rank = torch.empty_like(ordered.order)
    rank[ordered.order] = torch.arange(rank.numel(), device=rank.device)
    changed, found = _best_pairs(rank[row], unit, value, units, k, ordered.in_order)
    held_values, held_indices, held_positions = (
        state.index_select(0, changed) for state in (top.values, top.indices, top.positions)
    )
    held = Top(held_values, held_indices, held_positions, top.context_ids, top.context_values)
    empty = found < 0
    picked = found.clamp(min=0)
    new_values = torch.where(
        empty, _EMPTY, values[ordered.order[picked], changed[:, None]].double()
    )
    order, dropped = _best_order(
        torch.cat([held.values, new_values], 1),
        torch.cat([held.indices, torch.where(empty, -1, ordered.indices[picked])], 1),
        torch.cat([held.positions, torch.where(empty, -1, ordered.positions[picked])], 1),
        k,
    )
    return _slots_from(top, held, order, dropped, ordered, values, changed, found)


def _lowest(values: Tensor, batch: Batch) -> Tensor:
    """Per unit, ``batch.lowest`` raised, for a unit whose slots are not all filled, to
    the batch's own ``k``-th best above ``above`` (of its rows not seen before in it):
    ``k`` rows of the batch at or above it fill the slots first, so at most ``k`` (and
    ties) per unit are candidates, whatever the batch."""
    lowest = batch.lowest
    if batch.unfilled is None:
        return lowest
    unfilled = batch.unfilled.nonzero().squeeze(1)
    if unfilled.numel():
        kth = _kth_best(values, unfilled, batch.floor, batch.k, batch.again)
        lowest[unfilled] = lowest[unfilled].maximum(kth)
    return lowest


def _kth_best(
    values: Tensor, units: Tensor, floor: float | None, k: int, again: Tensor | None
) -> Tensor:
    """Per unit of ``units``, the ``k``-th best value of the batch at or above ``floor``
    (NaN, ``-inf`` and rows ``again`` left out), ``-inf`` where fewer: found a chunk of rows
    at a time, keeping each unit's ``k`` best so far, so it needs about a chunk's memory."""
    rows = values.shape[0]
    work = torch.float64 if values.dtype == torch.float64 else torch.float32
    if rows < k:
        return torch.full((units.numel(),), _EMPTY, dtype=work, device=values.device)
    step = max(k, _CHUNK // units.numel())  # each part has at least k rows
    best = values.new_empty((0, units.numel()), dtype=work)
    for start in range(0, rows, step):
        part = values[start : start + step].index_select(1, units).to(work)  # changed below
        part.nan_to_num_(nan=_EMPTY, posinf=float("inf"), neginf=_EMPTY)
        if floor is not None:
            part.masked_fill_(part < floor, _EMPTY)
        if again is not None:
            part.masked_fill_(again[start : start + step, None], _EMPTY)
        best = torch.cat([best, part]).topk(k, dim=0, sorted=False).values
    return best.amin(0)


def join_entries(parts: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """The ``(row, unit, value)`` entries of a batch's chunks, in the chunks' order."""
    if len(parts) == 1:
        return parts[0]
    row, unit, value = (torch.cat(part) for part in zip(*parts, strict=True))
    return row, unit, value


def _best_pairs(
    rank: Tensor, unit: Tensor, value: Tensor, units: int, k: int, presorted: bool = False
) -> tuple[Tensor, Tensor]:
    """The units with candidates and, per such unit, its best ``k`` candidates by
    (value desc, rank) as ``(S, k)`` sorted-row numbers, -1 where fewer (``presorted``:
    each unit's candidates come in ascending rank)."""
    if presorted:  # each unit's candidates come in rank order already
        order = torch.argsort(value, descending=True, stable=True)
    else:
        order = torch.argsort(rank, stable=True)
        order = order[torch.argsort(value[order], descending=True, stable=True)]
    order = order[torch.argsort(unit[order], stable=True)]
    unit, rank = unit[order], rank[order]
    counts = torch.bincount(unit, minlength=units)
    starts = counts.cumsum(0) - counts
    slot = torch.arange(unit.numel(), device=unit.device) - starts[unit]
    kept = slot < k
    unit, rank, slot = unit[kept], rank[kept], slot[kept]
    changed = (counts > 0).nonzero().squeeze(1)
    number = torch.full((units,), -1, dtype=torch.int64, device=unit.device)
    number[changed] = torch.arange(changed.numel(), device=unit.device)
    found = torch.full((changed.numel(), k), -1, dtype=torch.int64, device=unit.device)
    found[number[unit], slot] = rank
    return changed, found


def _slots_from(
    top: Top,
    held: Top,
    order: Tensor,
    dropped: Tensor,
    ordered: Ordered,
    values: Tensor,
    units: Tensor,
    found: Tensor,
) -> Top:
    """``top`` with the slots of ``units`` that ``order`` picks among ``held``'s (their
    values, indices and positions; numbers below k) and the batch's ``found`` rows (k and
    above), in place: a window is copied only where its slot's example changes, and
    computed for the batch's examples alone."""
    k = held.values.shape[1]
    mine = order < k
    own = order.clamp(max=k - 1)
    row = found.gather(1, (order - k).clamp(min=0)).clamp(min=0)  # sorted-row numbers
    new_values = values[ordered.order[row], units[:, None]].double()
    slot_values = torch.where(mine, held.values.gather(1, own), new_values)
    gone = dropped | (slot_values == _EMPTY)
    stays = mine & (own == torch.arange(k, device=own.device)) & ~gone
    moved = (~stays).view(-1).nonzero().squeeze(1)  # slots whose window changes
    span = top.context_ids.shape[2]
    first = units[:, None] * k
    into = (first + torch.arange(k, device=own.device)).view(-1)[moved]
    source = (first + own).view(-1)[moved]
    context_ids = top.context_ids.view(-1, span).index_select(0, source)  # (M, span)
    context_values = top.context_values.view(-1, span).index_select(0, source)
    fresh = (~mine & ~gone).view(-1)[moved].nonzero().squeeze(1)
    if fresh.numel():
        near = neighbours(ordered, row.view(-1)[moved[fresh]], span // 2)  # -1: no token
        inside = near >= 0
        safe = near.clamp(min=0)
        ids = ordered.ids
        context_ids[fresh] = (
            torch.where(inside, ids[safe], -1) if ids is not None else near.clamp(max=-1)
        )
        unit = units[moved[fresh] // k]
        near_values = values[ordered.order[safe], unit[:, None]].float()
        context_values[fresh] = torch.where(inside, near_values, torch.nan)
    emptied = gone.view(-1)[moved, None]
    top.context_ids.view(-1, span).index_copy_(0, into, context_ids.masked_fill_(emptied, -1))
    top.context_values.view(-1, span).index_copy_(
        0, into, context_values.masked_fill_(emptied, torch.nan)
    )
    indices = torch.where(mine, held.indices.gather(1, own), ordered.indices[row])
    positions = torch.where(mine, held.positions.gather(1, own), ordered.positions[row])
    for state, new in (
        (top.values, slot_values.masked_fill(gone, _EMPTY)),
        (top.indices, indices.masked_fill(gone, -1)),
        (top.positions, positions.masked_fill(gone, -1)),
    ):
        state.index_copy_(0, units, new)
    return top


def merge_tops(tops: Top) -> Top:
    """One top of the stacked tops ``(P, U, k, ...)`` of ``P`` processes or parts."""
    parts, units, k = tops.values.shape
    joined = Top(
        *(state.transpose(0, 1).reshape(units, parts * k, *state.shape[3:]) for state in tops)
    )
    order, dropped = _best_order(joined.values, joined.indices, joined.positions, k)
    return _emptied(Top(*(_gather(state, order) for state in joined)), dropped)


def _best_order(
    values: Tensor, indices: Tensor, positions: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """Per unit, the ``k`` best of its slots side by side, as slot numbers in slot order,
    and which of them to empty: a row seen twice (same value, index and position, next
    to each other once sorted) keeps its first. Sorted by value alone where no two
    values (but empty slots) are equal: the same order."""
    order = torch.argsort(values, dim=1, descending=True, stable=True)
    value = values.gather(1, order)
    if bool(((value[:, 1:] == value[:, :-1]) & (value[:, 1:] > _EMPTY)).any()):
        order = torch.argsort(positions, dim=1, stable=True)  # ties: by index, position
        order = order.gather(1, torch.argsort(indices.gather(1, order), dim=1, stable=True))
        value = values.gather(1, order)
        order = order.gather(1, torch.argsort(value, dim=1, descending=True, stable=True))
    index, position = indices.gather(1, order), positions.gather(1, order)
    twice = (
        (index[:, 1:] == index[:, :-1])
        & (position[:, 1:] == position[:, :-1])
        & (index[:, 1:] >= 0)
    )
    dropped = torch.cat([torch.zeros_like(twice[:, :1]), twice], dim=1)
    if bool(twice.any()):
        first = torch.argsort(dropped.int(), dim=1, stable=True)  # kept slots first, in order
        order, dropped = order.gather(1, first), dropped.gather(1, first)
    return order[:, :k], dropped[:, :k]


def _gather(state: Tensor, order: Tensor) -> Tensor:
    if state.dim() == 2:
        return state.gather(1, order)
    return state.gather(1, order[:, :, None].expand(-1, -1, state.shape[2]))


def _emptied(top: Top, where: Tensor) -> Top:
    """``top`` with the slots ``where`` made empty."""
    if not bool(where.any()):
        return top
    deep = where[:, :, None]
    return Top(
        torch.where(where, _EMPTY, top.values),
        torch.where(where, -1, top.indices),
        torch.where(where, -1, top.positions),
        torch.where(deep, -1, top.context_ids),
        torch.where(deep, torch.nan, top.context_values),
    )
