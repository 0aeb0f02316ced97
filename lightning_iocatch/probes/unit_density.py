"""How often each unit is active, its mean when active, and a histogram of its log10 values.

The state of ``U`` units is a :class:`Density`: the rows counted, per unit the number of
rows where it is active (its value is above the threshold; NaN never is) and the sum of
those values in float64, and per unit a histogram of ``log10(value)`` of its active values
over fixed bins (``bins`` equal bins from ``low`` to ``high``: bin ``i`` holds
``low + i * w <= log10(value) < low + (i + 1) * w``; lower values, zero and negatives
included, count in the first bin, higher ones in the last). Every part is a sum, so
states of any split of the rows add up to the state of all of them: counts exactly, sums
up to float64 rounding.

Examples:
    >>> state = update_density(empty_density(2, bins=4), torch.tensor([[0.0, 10.0], [2.0, 100.0]]),
    ...                        threshold=0.0, log10_range=(0.0, 4.0))
    >>> state.active.tolist(), state.active_sum.tolist(), state.histogram.tolist()
    ([1, 2], [2.0, 110.0], [[1, 0, 0, 0], [0, 1, 1, 0]])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Density",
    "above_cut",
    "chunks",
    "count_active",
    "empty_density",
    "lowest_above",
    "update_density",
]

_CHUNK = 1 << 22  # values looked at a time: bounds the memory of the active positions
_BLOCK = 8  # rows whose largest value per unit is compared first (see `above_cut`)


class Density(NamedTuple):
    """``rows`` ``()`` int64; ``active`` ``(U,)`` int64; ``active_sum`` ``(U,)`` float64;
    ``histogram`` ``(U, bins)`` int64 (see the module docstring)."""

    rows: Tensor
    active: Tensor
    active_sum: Tensor
    histogram: Tensor


def empty_density(units: int, bins: int, device: torch.device | None = None) -> Density:
    """The state of ``units`` units before any row."""
    return Density(
        torch.zeros((), dtype=torch.int64, device=device),
        torch.zeros(units, dtype=torch.int64, device=device),
        torch.zeros(units, dtype=torch.float64, device=device),
        torch.zeros(units, bins, dtype=torch.int64, device=device),
    )


def lowest_above(bound: float, dtype: torch.dtype) -> Tensor:
    """The smallest value of ``dtype`` greater than ``bound``: ``x > bound`` exactly as
    ``x >= lowest_above(bound, x.dtype)``, without rounding ``bound`` to ``dtype`` first
    (0.1 in float32 is 0.100000001, itself above 0.1).

    Examples:
        >>> lowest_above(0.1, torch.float32).item() > 0.1, lowest_above(0.0, torch.float16).item()
        (True, 5.960464477539063e-08)
    """
    near = torch.tensor(bound, dtype=torch.float64).to(dtype)
    if float(near) <= bound:
        near = torch.nextafter(near, torch.tensor(float("inf"), dtype=dtype))
    return near


def chunks(values: Tensor) -> Iterator[tuple[int, Tensor]]:
    """``(first row, rows)`` of ``values`` ``(N, U)``, about ``_CHUNK`` values at a time."""
    step = max(1, _CHUNK // max(values.shape[1], 1))
    for start in range(0, values.shape[0], step):
        yield start, values[start : start + step]


def above_cut(values: Tensor, cut: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(row, unit, value)`` of the entries of ``values`` ``(N, U)`` at or above ``cut``
    (a number of ``values``' dtype, compared in it, or a ``(U,)`` tensor, one per unit,
    compared in the wider of the two dtypes; NaN never is), each unit's in ascending
    rows.

    Sparse values are found a block of ``_BLOCK`` rows at a time: a block's largest value
    per unit says whether any of its rows can be (a NaN among them: maybe), and only the
    rows of those blocks are compared, one pass over ``values`` and a small one over the
    rest instead of a scan of every value; dense ones (more than a quarter of the blocks
    hold some) directly."""
    rows, units = values.shape
    values = values.contiguous()
    whole = rows - rows % _BLOCK
    found = []
    if whole and units:
        blocks = values[:whole].view(whole // _BLOCK, _BLOCK, units).amax(1)
        hit = (~(blocks < cut)).view(-1).nonzero().squeeze(1)
        if hit.numel() * 4 <= blocks.numel():
            block, unit = hit // units, hit % units
            offsets = torch.arange(0, _BLOCK * units, units, device=values.device)
            at = ((block * (_BLOCK * units) + unit)[:, None] + offsets).view(-1)
            value = values.view(-1).index_select(0, at)
            each = cut[at % units] if isinstance(cut, Tensor) and cut.dim() == 1 else cut
            kept = (value >= each).nonzero()
            at = at[kept.squeeze(1)]
            found.append((at // units, at % units, value[kept.squeeze(1)]))
        else:
            whole = 0
    if whole < rows or not found:
        row, unit = (values[whole:] >= cut).nonzero(as_tuple=True)
        found.append((row + whole, unit, values[whole:][row, unit]))
    if len(found) == 1:
        return found[0]
    return tuple(torch.cat(part) for part in zip(*found, strict=True))  # type: ignore[return-value]


def count_active(
    state: Density, unit: Tensor, value: Tensor, log10_range: tuple[float, float]
) -> Density:
    """``state`` with the active entries ``(unit, value)`` of some rows counted (each
    unit's in the order of its rows; ``rows`` unchanged)."""
    units, bins = state.histogram.shape
    low, high = log10_range
    width = (high - low) / bins
    value = value.double()
    active = state.active + torch.bincount(unit, minlength=units)
    active_sum = state.active_sum.index_add(0, unit, value)
    magnitude = torch.where(value > 0, value, 0).log10()  # -inf for zero and below
    slot = ((magnitude - low) / width).clamp(0, bins - 1).floor().long()
    histogram = state.histogram.view(-1) + torch.bincount(
        unit * bins + slot, minlength=units * bins
    )
    return Density(state.rows, active, active_sum, histogram.view(units, bins))


def update_density(
    state: Density, values: Tensor, threshold: float, log10_range: tuple[float, float]
) -> Density:
    """``state`` with the rows ``values`` ``(N, U)`` counted."""
    lowest = float(lowest_above(threshold, values.dtype))  # a number: nothing to copy
    for _, chunk in chunks(values):
        _, unit, value = above_cut(chunk, lowest)
        state = count_active(state, unit, value, log10_range)
    return state._replace(rows=state.rows + values.shape[0])
