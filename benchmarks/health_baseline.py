"""BASELINE ONLY, for ``benchmarks/health.py --baseline``: the monitor's statistics as
they were before (commit d1af5de), to time the old and the new in the same run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

import lightning_iocatch.lightning.health_transform as health_transform
from lightning_iocatch.probes.health import EDGES


def float64_statistics(
    tensor: torch.Tensor, rows: torch.Tensor | None = None, histogram: bool = False
) -> torch.Tensor:
    """BASELINE ONLY: ``health_statistics`` as it was before (commit d1af5de), verbatim: a
    float64 copy of every tensor, ``torch.where`` passes. ``--baseline`` times the monitor
    with it, to compare in the same run."""
    values = tensor.detach()
    if rows is not None:
        values = values[rows.to(values.device)]
    units = values.shape[-1] if values.dim() else 1
    values = values.reshape(-1, units)
    finite = torch.isfinite(values)
    wide = torch.where(finite, values, 0).double()
    count = finite.sum().double()
    mean = wide.sum() / count.clamp(min=1)
    centred = torch.where(finite, wide - mean, 0)
    square = centred * centred
    head = torch.stack(
        [
            count,
            mean,
            square.sum(),
            (square * centred).sum(),
            (square * square).sum(),
            wide.abs().max() if wide.numel() else wide.new_zeros(()),
            torch.isnan(values).sum().double(),
            torch.isinf(values).sum().double(),
        ]
    )
    nonzero = ((values != 0) & finite).sum(0).double()
    if not histogram:
        return torch.cat([head, nonzero])
    edges = torch.tensor(EDGES, dtype=torch.float64, device=values.device)
    places = torch.bucketize(wide.abs()[finite], edges, right=True)
    counts = torch.bincount(places, minlength=len(EDGES) + 1).double()
    return torch.cat([head, counts, nonzero])


class Baseline(pl.Callback):
    """For one ``fit``: the monitor's statistics by :func:`float64_statistics` (the old),
    each tensor alone (none batched)."""

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.kept = health_transform.health_statistics, health_transform.batched
        health_transform.health_statistics = float64_statistics
        health_transform.batched = _never

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        health_transform.health_statistics, health_transform.batched = self.kept


def _never(tensor: torch.Tensor) -> bool:
    return False
