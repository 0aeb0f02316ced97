"""ActivationStats: mean, std, rms, absmax, zero and dead fractions of one captured tensor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_iocatch.probes.base import (
    _ProbeMetric,
    _rows,
)


class ActivationStats(_ProbeMetric):
    """Statistics of one captured tensor over an epoch, every element counted.

    ``compute()`` returns ``mean``, ``std`` (population), ``rms``, ``absmax``,
    ``zero_frac`` (fraction of elements exactly zero) and ``dead_frac``. Each batch's
    values are cast to float64, their mean and sum of squared deviations taken in two
    passes and merged across batches and processes with Chan's formula, so float16
    captures do not overflow and large counts and means lose no precision.

    ``dead_frac`` is the fraction of dead units. The units are the positions
    ``0 .. U-1`` of the last dimension, ``U`` the largest last dimension of any batch
    (of any process); a unit is dead when it was zero in every batch that had it, for
    every sample and position. When the last dimension changes between batches (conv
    features of variable-length audio, padded sequences) a position that only the
    longer batches have is judged on those alone. A 1-dimensional tensor is one unit.

    Takes floating tensors with a batch dimension (see :func:`usable`), without the
    rows flagged in ``repeated``; anything else is ignored. With ``tokens``, a bool
    ``(batch, seq)`` mask of real tokens, a tensor of at least three dimensions whose first
    two are the mask's counts the real tokens' values only; a ``(batch, d)`` tensor is one
    vector per sample, counted whole; a sample without a real token is left out of every
    tensor, as a ``repeated`` one is.

    Examples:
        >>> stats = ActivationStats()
        >>> stats.update(torch.tensor([[0.0, 1.0], [0.0, 3.0]]))
        >>> {k: round(float(v), 3) for k, v in stats.compute().items()}
        {'mean': 1.0, 'std': 1.225, 'rms': 1.581, 'absmax': 3.0, 'zero_frac': 0.5, 'dead_frac': 0.5}
    """

    moments: Tensor
    absmax: Tensor
    zeros: Tensor
    alive: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # (count, mean, M2) of this process; one row a process once synced
        self.add_state("moments", torch.zeros(1, 3, dtype=torch.float64), dist_reduce_fx="cat")
        self.add_state("absmax", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("zeros", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        # 1 for every unit ever non-zero: its length is the largest last dimension seen,
        # agreed across processes before a sync (see _align)
        self.add_state("alive", torch.zeros(0, dtype=torch.float64), dist_reduce_fx="max")

    def update(
        self,
        features: Tensor,
        batch: Any = None,
        indices: Sequence[int] | None = None,
        repeated: Sequence[bool] | None = None,
        tokens: Tensor | None = None,
    ) -> None:
        found = _rows(features, indices, repeated, tokens)
        if found is None:
            return
        values, real = found
        selected = values if real is None else values[real]  # (tokens, ...) when masked
        if selected.numel() == 0:
            return
        flat = selected.to(torch.float64, copy=True).reshape(-1)  # cast values, not sums
        self.zeros = self.zeros + (flat.numel() - torch.count_nonzero(flat))
        mean = flat.mean()
        deviations = flat.sub_(mean)  # two passes over the float64 copy, in place
        row = torch.stack([mean.new_tensor(float(flat.numel())), mean, deviations @ deviations])
        self.moments = _chan(self.moments[0], row)[None]
        units = selected.reshape(-1, selected.shape[-1] if selected.dim() > 1 else 1)
        low, high = units.amin(dim=0), units.amax(dim=0)  # exact in any dtype
        self.absmax = torch.maximum(self.absmax, torch.maximum(-low.min(), high.max()).double())
        self.alive = _padded_max(self.alive, ((low != 0) | (high != 0)).to(torch.float64))

    def _layout(self) -> int:
        return self.alive.shape[0]

    def _align(self, layouts: list[int]) -> None:
        self.alive = _padded_max(self.alive, self.alive.new_zeros(max(layouts)))

    def compute(self) -> dict[str, Tensor]:
        rows = self.moments.reshape(-1, 3)  # synced rows arrive stacked by process
        rows = rows[rows[:, 0] > 0]
        if rows.shape[0] == 0:
            nan = torch.tensor(math.nan, dtype=torch.float64)
            return dict.fromkeys(("mean", "std", "rms", "absmax", "zero_frac", "dead_frac"), nan)
        total = rows[0]
        for row in rows[1:]:
            total = _chan(total, row)
        count, mean, m2 = total
        variance = m2 / count
        return {
            "mean": mean,
            "std": variance.sqrt(),
            "rms": (variance + mean**2).sqrt(),
            "absmax": self.absmax,
            "zero_frac": self.zeros / count,
            "dead_frac": 1 - self.alive.mean(),
        }


def _padded_max(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise maximum of two vectors, the shorter padded with zeros."""
    if a.shape[0] < b.shape[0]:
        a, b = b, a
    if b.shape[0] == 0:
        return a
    return torch.cat([torch.maximum(a[: b.shape[0]], b), a[b.shape[0] :]])


def _chan(a: Tensor, b: Tensor) -> Tensor:
    """Merge two (count, mean, M2) rows (Chan, Golub and LeVeque); ``a`` may be empty."""
    count = a[0] + b[0]
    delta = b[1] - a[1]
    mean = a[1] + delta * b[0] / count
    m2 = a[2] + b[2] + delta**2 * a[0] * b[0] / count
    return torch.stack([count, mean, m2])
