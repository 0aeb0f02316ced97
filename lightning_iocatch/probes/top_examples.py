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
``k``-th best above ``above``: at most ``k`` per unit and batch (and their ties).

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

from lightning_iocatch.probes.unit_density import lowest_above

__all__ = ["Rows", "Top", "empty_top", "merge_tops", "update_top"]

_EMPTY = float("-inf")
_CHUNK = 1 << 22  # values looked at a time for a batch's k-th best: bounds its memory


class Rows(NamedTuple):
    """One batch as rows: ``values`` ``(N, U)``, each row's dataset ``index`` and token
    ``position`` (``(N,)`` int64; -1 for rows that are whole samples) and token ``ids``
    (``(N,)`` int64, or ``None``). A window of tokens around a row is found among the rows
    of the same index at neighbouring positions."""

    values: Tensor
    indices: Tensor
    positions: Tensor
    ids: Tensor | None = None


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
    values = rows.values if rows.values.dtype == torch.float64 else rows.values.float()
    ordered = _ordered(rows)
    rank = torch.empty_like(ordered.order)
    rank[ordered.order] = torch.arange(rank.numel(), device=rank.device)
    again = _seen_before(ordered)  # per row: the same index and position as an earlier one
    lowest = _lowest(top, values, above, k, again)
    row, unit = (values >= lowest).nonzero(as_tuple=True)  # NaN never is
    value = values[row, unit]
    keep = value > _EMPTY if bool(lowest.min() == _EMPTY) else None  # -inf: never an example
    if again is not None:
        keep = ~again[row] if keep is None else keep & ~again[row]
    if keep is not None:
        row, unit, value = row[keep], unit[keep], value[keep]
    if row.numel() == 0:
        return top
    changed, found = _best_pairs(rank[row], unit, value, units, k)  # (S, k) sorted rows
    held = _select(top, changed)
    empty = found < 0
    picked = found.clamp(min=0)
    new_values = torch.where(empty, _EMPTY, values[ordered.order[picked], changed[:, None]])
    order, dropped = _best_order(
        torch.cat([held.values, new_values.double()], 1),
        torch.cat([held.indices, torch.where(empty, -1, ordered.indices[picked])], 1),
        torch.cat([held.positions, torch.where(empty, -1, ordered.positions[picked])], 1),
        k,
    )
    merged = _slots_from(held, order, dropped, ordered, values, changed, found)
    return _replace(top, changed, merged)


def _lowest(top: Top, values: Tensor, above: float | None, k: int, again: Tensor | None) -> Tensor:
    """Per unit, in ``values``' dtype, the lowest value of this batch that may still
    fill a slot: the last slot's value (a tie may win on its index), or the next value
    above ``above``; for a unit whose slots are not all filled, also the batch's own
    ``k``-th best above ``above`` (of its rows not seen before in it): ``k`` rows of the
    batch at or above it fill the slots first, so at most ``k`` (and ties) per unit are
    candidates, whatever the batch."""
    lowest = top.values[:, -1].to(values.dtype, copy=True)
    floor = None if above is None else lowest_above(above, values.dtype)
    if floor is not None:
        lowest = lowest.clamp(min=floor)
    unfilled = (top.values[:, -1] == _EMPTY).nonzero().squeeze(1)
    if unfilled.numel():
        lowest[unfilled] = lowest[unfilled].maximum(_kth_best(values, unfilled, floor, k, again))
    return lowest


def _kth_best(
    values: Tensor, units: Tensor, floor: Tensor | None, k: int, again: Tensor | None
) -> Tensor:
    """Per unit of ``units``, the ``k``-th best value of the batch at or above ``floor``
    (NaN, ``-inf`` and rows ``again`` left out), ``-inf`` where fewer: found a chunk of rows
    at a time, keeping each unit's ``k`` best so far, so it needs about a chunk's memory."""
    rows = values.shape[0]
    if rows < k:
        return torch.full((units.numel(),), _EMPTY, dtype=values.dtype, device=values.device)
    step = max(k, _CHUNK // units.numel())  # each part has at least k rows
    best = values.new_empty((0, units.numel()))
    for start in range(0, rows, step):
        part = values[start : start + step].index_select(1, units)  # a copy: changed below
        part.nan_to_num_(nan=_EMPTY, posinf=float("inf"), neginf=_EMPTY)
        if floor is not None:
            part.masked_fill_(part < floor, _EMPTY)
        if again is not None:
            part.masked_fill_(again[start : start + step, None], _EMPTY)
        best = torch.cat([best, part]).topk(k, dim=0, sorted=False).values
    return best.amin(0)


def _seen_before(ordered: _Ordered) -> Tensor | None:
    """Per row of the batch, whether an earlier row has its index and position (a
    sampler's repeat); ``None`` when no row has."""
    twice = (ordered.indices[1:] == ordered.indices[:-1]) & (
        ordered.positions[1:] == ordered.positions[:-1]
    )
    if not bool(twice.any()):
        return None
    again = torch.zeros_like(ordered.order, dtype=torch.bool)
    again[ordered.order[1:][twice]] = True
    return again


def _best_pairs(
    rank: Tensor, unit: Tensor, value: Tensor, units: int, k: int
) -> tuple[Tensor, Tensor]:
    """The units with candidates and, per such unit, its best ``k`` candidates by
    (value desc, rank) as ``(S, k)`` sorted-row numbers, -1 where fewer."""
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
    held: Top,
    order: Tensor,
    dropped: Tensor,
    ordered: _Ordered,
    values: Tensor,
    units: Tensor,
    found: Tensor,
) -> Top:
    """The slots ``order`` picks among ``held``'s (numbers below k) and the batch's
    ``found`` rows (k and above), windows computed for the batch's alone."""
    k = held.values.shape[1]
    mine = order < k
    own = order.clamp(max=k - 1)
    row = found.gather(1, (order - k).clamp(min=0)).clamp(min=0)  # sorted-row numbers
    new_values = values[ordered.order[row], units[:, None]].double()
    slots = Top(
        torch.where(mine, held.values.gather(1, own), new_values),
        torch.where(mine, held.indices.gather(1, own), ordered.indices[row]),
        torch.where(mine, held.positions.gather(1, own), ordered.positions[row]),
        _gather(held.context_ids, own),
        _gather(held.context_values, own),
    )
    span = held.context_ids.shape[2]
    fresh = ~mine & (slots.values > _EMPTY)
    if span and bool(fresh.any()):
        at = row[fresh]
        near = _neighbours(ordered, at, span // 2)  # (M, span), -1: no such token
        inside = near >= 0
        safe = near.clamp(min=0)
        ids = ordered.ids
        slots.context_ids[fresh] = (
            torch.where(inside, ids[safe], -1) if ids is not None else near.clamp(max=-1)
        )
        unit = units[:, None].expand_as(fresh)[fresh]
        near_values = values[ordered.order[safe], unit[:, None]].float()
        slots.context_values[fresh] = torch.where(inside, near_values, torch.nan)
    return _emptied(slots, dropped | (slots.values == _EMPTY))


def merge_tops(tops: Top) -> Top:
    """One top of the stacked tops ``(P, U, k, ...)`` of ``P`` processes or parts."""
    parts, units, k = tops.values.shape
    joined = Top(
        *(state.transpose(0, 1).reshape(units, parts * k, *state.shape[3:]) for state in tops)
    )
    order, dropped = _best_order(joined.values, joined.indices, joined.positions, k)
    return _emptied(Top(*(_gather(state, order) for state in joined)), dropped)


class _Ordered(NamedTuple):
    """A batch's rows sorted by (index, position): the order, and per sorted row its
    sample number (0, 1, ... by index), position, dataset index and token id."""

    order: Tensor
    sample: Tensor
    positions: Tensor
    indices: Tensor
    ids: Tensor | None


def _ordered(rows: Rows) -> _Ordered:
    index, position = rows.indices, rows.positions
    order = torch.argsort(position, stable=True)
    order = order[torch.argsort(index[order], stable=True)]
    index, position = index[order], position[order]
    sample = torch.unique_consecutive(index, return_inverse=True)[1]
    ids = None if rows.ids is None else rows.ids[order]
    return _Ordered(order, sample, position, index, ids)


def _neighbours(ordered: _Ordered, picked: Tensor, width: int) -> Tensor:
    """For each picked sorted row, the sorted-row numbers of the same sample's tokens at
    positions ``-width .. width`` around it, -1 where that token is not among the rows."""
    span = ordered.positions.max() - ordered.positions.min() + 2 * width + 1
    base = ordered.positions.min() - width
    key = ordered.sample * span + (ordered.positions - base)  # ascending: rows are sorted
    offsets = torch.arange(-width, width + 1, device=picked.device)
    at = ordered.sample[picked] * span + (ordered.positions[picked] - base)
    wanted = at[..., None] + offsets
    where = torch.searchsorted(key, wanted).clamp(max=key.numel() - 1)
    return torch.where(key[where] == wanted, where, -1)


def _select(top: Top, units: Tensor) -> Top:
    return Top(*(state[units] for state in top))


def _replace(top: Top, units: Tensor, part: Top) -> Top:
    """``top`` with the slots of ``units`` replaced by ``part``'s, in place."""
    for state, new in zip(top, part, strict=True):
        state[units] = new
    return top


def _best_order(
    values: Tensor, indices: Tensor, positions: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """Per unit, the ``k`` best of its slots side by side, as slot numbers in slot order,
    and which of them to empty: a row seen twice (same value, index and position, next
    to each other once sorted) keeps its first."""
    order = torch.argsort(positions, dim=1, stable=True)
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
