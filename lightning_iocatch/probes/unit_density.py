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

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Density", "empty_density", "lowest_above", "update_density"]

_CHUNK = 1 << 22  # values looked at a time: bounds the memory of the active positions


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


def update_density(
    state: Density, values: Tensor, threshold: float, log10_range: tuple[float, float]
) -> Density:
    """``state`` with the rows ``values`` ``(N, U)`` counted."""
    units, bins = state.histogram.shape
    low, high = log10_range
    width = (high - low) / bins
    active, active_sum, histogram = state.active, state.active_sum, state.histogram.flatten()
    step = max(1, _CHUNK // max(units, 1))
    lowest = lowest_above(threshold, values.dtype)
    for start in range(0, values.shape[0], step):
        chunk = values[start : start + step]
        row, unit = (chunk >= lowest).nonzero(as_tuple=True)
        value = chunk[row, unit].double()
        active = active + torch.bincount(unit, minlength=units)
        active_sum = active_sum.index_add(0, unit, value)
        magnitude = torch.where(value > 0, value, 0).log10()  # -inf for zero and below
        slot = ((magnitude - low) / width).clamp(0, bins - 1).floor().long()
        histogram = histogram + torch.bincount(unit * bins + slot, minlength=units * bins)
    return Density(state.rows + values.shape[0], active, active_sum, histogram.view(units, bins))
