"""A batch's rows in (index, position) order, and the windows of tokens around some of
them: what :mod:`~lightning_iocatch.probes.top_examples` needs of the rows themselves.

Examples:
    >>> rows = Rows(torch.zeros(4, 1), torch.tensor([9, 2, 9, 2]), torch.tensor([1, 0, 0, 1]))
    >>> ordered = ordered_rows(rows)
    >>> ordered.order.tolist(), ordered.sample.tolist(), ordered.again is None
    ([1, 3, 2, 0], [0, 0, 1, 1], True)
    >>> neighbours(ordered, torch.tensor([2]), width=1).tolist()  # sample 9, position 0
    [[-1, 2, 3]]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Ordered", "Rows", "neighbours", "ordered_rows"]


class Rows(NamedTuple):
    """One batch as rows: ``values`` ``(N, U)``, each row's dataset ``index`` and token
    ``position`` (``(N,)`` int64; -1 for rows that are whole samples) and token ``ids``
    (``(N,)`` int64, or ``None``). A window of tokens around a row is found among the rows
    of the same index at neighbouring positions."""

    values: Tensor
    indices: Tensor
    positions: Tensor
    ids: Tensor | None = None


class Ordered(NamedTuple):
    """A batch's rows sorted by (index, position): the order, and per sorted row its
    sample number (0, 1, ... by index), position, dataset index and token id; per row
    whether an earlier row has its index and position (``again``, ``None``: none; then
    ``unique``), and whether the rows came in that order (``in_order``)."""

    order: Tensor
    sample: Tensor
    positions: Tensor
    indices: Tensor
    ids: Tensor | None
    again: Tensor | None
    unique: bool
    in_order: bool


def ordered_rows(rows: Rows) -> Ordered:
    """``rows`` in (index, position) order (see :class:`Ordered`)."""
    index, position = rows.indices, rows.positions
    order = torch.argsort(position, stable=True)
    order = order[torch.argsort(index[order], stable=True)]
    index, position = index[order], position[order]
    new = index[1:] != index[:-1]
    sample = torch.cat([new.new_zeros(1, dtype=torch.int64), new.cumsum(0)])
    ids = None if rows.ids is None else rows.ids[order]
    again = _seen_before(order, index, position)
    in_order = bool((order == torch.arange(order.numel(), device=order.device)).all())
    return Ordered(order, sample, position, index, ids, again, again is None, in_order)


def neighbours(ordered: Ordered, picked: Tensor, width: int) -> Tensor:
    """For each picked sorted row, the sorted-row numbers of the same sample's tokens at
    positions ``-width .. width`` around it, -1 where that token is not among the rows.

    Where the rows hold each token once, a sample's tokens at consecutive positions are
    consecutive rows: each is looked for there first, and searched for only where it is
    not (a gap in the positions, a sample's edge)."""
    span = ordered.positions.max() - ordered.positions.min() + 2 * width + 1
    base = ordered.positions.min() - width
    key = ordered.sample * span + (ordered.positions - base)  # ascending: rows are sorted
    offsets = torch.arange(-width, width + 1, device=picked.device)
    at = ordered.sample[picked] * span + (ordered.positions[picked] - base)
    wanted = at[..., None] + offsets
    last = key.numel() - 1
    if ordered.unique:
        where = (picked[:, None] + offsets).clamp(0, last)
        missed = (key[where] != wanted).view(-1).nonzero().squeeze(1)
        where.view(-1)[missed] = torch.searchsorted(key, wanted.view(-1)[missed]).clamp(max=last)
    else:
        where = torch.searchsorted(key, wanted).clamp(max=last)
    return torch.where(key[where] == wanted, where, -1)


def _seen_before(order: Tensor, index: Tensor, position: Tensor) -> Tensor | None:
    """Per row of the batch (``order``: the rows by (index, position), then sorted),
    whether an earlier row has its index and position (a sampler's repeat); ``None``
    when no row has."""
    twice = (index[1:] == index[:-1]) & (position[1:] == position[:-1])
    if not bool(twice.any()):
        return None
    again = torch.zeros_like(order, dtype=torch.bool)
    again[order[1:][twice]] = True
    return again
