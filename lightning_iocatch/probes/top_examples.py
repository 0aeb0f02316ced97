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

Each batch costs one pass over its values (the column maxima) while the slots are full
and the batch beats none; only the units the batch can change are ranked.

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

__all__ = ["Rows", "Top", "empty_top", "merge_tops", "update_top"]

_EMPTY = float("-inf")


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
    span = 2 * width + 1 if width else 0
    return Top(
        torch.full((units, k), _EMPTY, dtype=torch.float64, device=device),
        torch.full((units, k), -1, dtype=torch.int64, device=device),
        torch.full((units, k), -1, dtype=torch.int64, device=device),
        torch.full((units, k, span), -1, dtype=torch.int64, device=device),
        torch.full((units, k, span), torch.nan, dtype=torch.float32, device=device),
    )


def update_top(top: Top, rows: Rows, above: float | None = None) -> Top:
    """``top`` with the rows of one batch taken in (``top`` has the rows' unit count).

    ``above``: only values greater than it fill slots. Rows may come in any order.
    """
    units, k = top.values.shape
    if rows.values.shape[0] == 0 or k == 0 or units == 0:
        return top
    values = rows.values if rows.values.dtype == torch.float64 else rows.values.float()
    floor = top.values[:, -1]  # -inf while a unit has an empty slot
    if above is not None:
        floor = floor.clamp(min=above)
    best = values.amax(0).double()
    # a tie with the last slot may still win on its index: >= (> above, > -inf)
    changed = (best >= floor) & (best > _EMPTY) | best.isnan()
    if above is not None:
        changed &= (best > above) | best.isnan()
    units_changed = changed.nonzero().squeeze(1)
    if units_changed.numel() == 0:
        return top
    ordered = _ordered(rows)
    raw = values[:, units_changed][ordered.order]
    ranked = torch.where(raw.isnan(), _EMPTY, raw)
    if above is not None:
        ranked = torch.where(ranked > above, ranked, _EMPTY)
    picked = _batch_best(ranked, k)  # (changed units, min(k, N)) sorted-row numbers
    candidates = _candidates(ordered, ranked, raw, picked, top.context_ids.shape[2])
    merged = _ranked(_joined(_select(top, units_changed), candidates), k)
    return _replace(top, units_changed, merged)


def merge_tops(tops: Top) -> Top:
    """One top of the stacked tops ``(P, U, k, ...)`` of ``P`` processes or parts."""
    parts, units, k = tops.values.shape
    joined = Top(
        *(state.transpose(0, 1).reshape(units, parts * k, *state.shape[3:]) for state in tops)
    )
    return _ranked(joined, k)


class _Ordered(NamedTuple):
    """A batch's rows sorted by (index, position): the order, and per sorted row its
    sample number (0, 1, ... by index), position, token id and original row."""

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


def _batch_best(values: Tensor, k: int) -> Tensor:
    """Per column of ``values`` ``(N, S)`` (rows in tie order), the row numbers of its
    ``min(k, N)`` best values, a tie at the last one going to the earlier rows."""
    kk = min(k, values.shape[0])
    last = values.topk(kk, dim=0).values[-1]
    greater = values > last
    equal = values == last
    needed = kk - greater.sum(0)
    chosen = greater | (equal & (equal.cumsum(0) <= needed))
    return chosen.T.nonzero()[:, 1].view(values.shape[1], kk)


def _candidates(ordered: _Ordered, ranked: Tensor, raw: Tensor, picked: Tensor, span: int) -> Top:
    """The picked rows of each changed unit as slots, with their windows of the unit's
    ``raw`` values (``ranked`` are those that may fill a slot, the others ``-inf``)."""
    columns = torch.arange(ranked.shape[1], device=ranked.device)[:, None]
    chosen = ranked[picked, columns].double()  # (S, kk)
    empty = chosen == _EMPTY
    if span:
        near = _neighbours(ordered, picked, span // 2)  # (S, kk, span), -1: no such token
        found = near >= 0
        safe = near.clamp(min=0)
        ids = ordered.ids
        context_ids = torch.where(found, ids[safe], -1) if ids is not None else near.clamp(max=-1)
        context_values = raw[safe, columns[:, :, None].expand_as(safe)].float()
        context_values = torch.where(found, context_values, torch.nan)
    else:
        context_ids = torch.full((*picked.shape, 0), -1, device=ranked.device)
        context_values = context_ids.float()
    slots = Top(
        chosen, ordered.indices[picked], ordered.positions[picked], context_ids, context_values
    )
    return _emptied(slots, empty) if bool(empty.any()) else slots


def _neighbours(ordered: _Ordered, picked: Tensor, width: int) -> Tensor:
    """For each picked row, the sorted-row numbers of the same sample's tokens at
    positions ``-width .. width`` around it, -1 where that token is not among the rows."""
    span = ordered.positions.max() - ordered.positions.min() + 2 * width + 1
    base = ordered.positions.min() - width
    key = ordered.sample * span + (ordered.positions - base)  # ascending: rows are sorted
    offsets = torch.arange(-width, width + 1, device=picked.device)
    wanted = (ordered.sample[picked] * span + (ordered.positions[picked] - base))[
        ..., None
    ] + offsets
    where = torch.searchsorted(key, wanted).clamp(max=key.numel() - 1)
    return torch.where(key[where] == wanted, where, -1)


def _select(top: Top, units: Tensor) -> Top:
    return Top(*(state[units] for state in top))


def _replace(top: Top, units: Tensor, part: Top) -> Top:
    states = []
    for state, new in zip(top, part, strict=True):
        state = state.clone()
        state[units] = new
        states.append(state)
    return Top(*states)


def _joined(a: Top, b: Top) -> Top:
    return Top(*(torch.cat([x, y], dim=1) for x, y in zip(a, b, strict=True)))


def _ranked(joined: Top, k: int) -> Top:
    """The best ``k`` slots of each unit of ``joined``, in slot order, one slot per row."""
    order = torch.argsort(joined.positions, dim=1, stable=True)
    order = order.gather(1, torch.argsort(joined.indices.gather(1, order), dim=1, stable=True))
    value = joined.values.gather(1, order)
    order = order.gather(1, torch.argsort(value, dim=1, descending=True, stable=True))
    ranked = Top(*(_gather(state, order) for state in joined))
    # a row seen twice: same value, index and position, next to each other once sorted
    twice = (
        (ranked.indices[:, 1:] == ranked.indices[:, :-1])
        & (ranked.positions[:, 1:] == ranked.positions[:, :-1])
        & (ranked.indices[:, 1:] >= 0)
    )
    if bool(twice.any()):
        dropped = torch.cat([torch.zeros_like(twice[:, :1]), twice], dim=1)
        first = torch.argsort(dropped.int(), dim=1, stable=True)  # kept slots first, in order
        ranked = Top(*(_gather(state, first) for state in ranked))
        ranked = _emptied(ranked, dropped.gather(1, first))
    return Top(*(state[:, :k] for state in ranked))


def _gather(state: Tensor, order: Tensor) -> Tensor:
    if state.dim() == 2:
        return state.gather(1, order)
    return state.gather(1, order[:, :, None].expand(-1, -1, state.shape[2]))


def _emptied(top: Top, where: Tensor) -> Top:
    """``top`` with the slots ``where`` made empty."""
    deep = where[:, :, None]
    return Top(
        torch.where(where, _EMPTY, top.values),
        torch.where(where, -1, top.indices),
        torch.where(where, -1, top.positions),
        torch.where(deep, -1, top.context_ids),
        torch.where(deep, torch.nan, top.context_values),
    )
