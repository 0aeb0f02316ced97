"""Activation health: a tensor's statistics reduced on its device to one small vector.

:func:`health_statistics` turns a captured tensor (activations or gradients) into a
float64 vector on the tensor's device: the number of finite values, their sums of the
first four powers, the largest ``|x|``, the number of NaN and of ±inf values, and per
unit (the last dimension) the number of non-zero values. Vectors of one place add up
across batches and processes (:func:`merge_statistics`: sums added, the maximum taken),
so a monitor gathers them in one collective and reads the figures from the merge
(:class:`HealthFigures`): mean, RMS, max ``|x|``, kurtosis, the fraction of units that
were zero on every row (dead), and the non-finite counts. Rows outside ``rows`` (a bool
mask over the tensor's leading dimensions, e.g. a batch's real tokens) are left out.

Examples:
    >>> x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [float("nan"), 0.0]])
    >>> figures = HealthFigures.of(health_statistics(x))
    >>> figures.mean, figures.absmax, figures.dead_fraction, figures.nan
    (0.8, 3.0, 0.5, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["EDGES", "HEAD", "HealthFigures", "health_statistics", "merge_statistics"]

HEAD = 8  # count, sum, sum2, sum3, sum4, absmax, nan, inf; [a histogram]; a count per unit
_MAX = 5  # the place of absmax: taken as a maximum, every other place is added
EDGES = tuple(10.0 ** (k / 4) for k in range(-24, 13))
"""The edges of the histogram of ``|x|`` (``1e-6`` to ``1e3``, 4 bins a decade): with the
values below the first and above the last, ``len(EDGES) + 1`` counts."""


def health_statistics(
    tensor: torch.Tensor, rows: torch.Tensor | None = None, histogram: bool = False
) -> torch.Tensor:
    """The statistics vector of ``tensor`` (float64, on its device: ``HEAD``, with
    ``histogram`` the counts of the finite ``|x|`` between :data:`EDGES`, then a count per
    unit).

    ``rows``: a bool mask over the tensor's leading dimensions; only those rows count.
    """
    values = tensor.detach()
    if rows is not None:
        values = values[rows.to(values.device)]
    units = values.shape[-1] if values.dim() else 1
    values = values.reshape(-1, units)
    finite = torch.isfinite(values)
    wide = torch.where(finite, values, 0).double()
    square = wide * wide
    head = torch.stack(
        [
            finite.sum().double(),
            wide.sum(),
            square.sum(),
            (square * wide).sum(),
            (square * square).sum(),
            wide.abs().max() if wide.numel() else wide.new_zeros(()),
            torch.isnan(values).sum().double(),
            torch.isinf(values).sum().double(),
        ]
    )
    nonzero = (values != 0).sum(0).double()
    if not histogram:
        return torch.cat([head, nonzero])
    edges = torch.tensor(EDGES, dtype=torch.float64, device=values.device)
    places = torch.bucketize(wide.abs()[finite], edges, right=True)  # 0: below the first
    counts = torch.bincount(places, minlength=len(EDGES) + 1).double()
    return torch.cat([head, counts, nonzero])


def merge_statistics(vectors: torch.Tensor) -> torch.Tensor:
    """One vector from several of one place (``[n, HEAD + units]``): sums added, the
    largest ``|x|`` taken.

    Examples:
        >>> a = health_statistics(torch.tensor([[1.0, -4.0]]))
        >>> b = health_statistics(torch.tensor([[2.0, 0.0]]))
        >>> HealthFigures.of(merge_statistics(torch.stack([a, b]))).absmax
        4.0
    """
    merged = vectors.sum(0)
    merged[_MAX] = vectors[:, _MAX].max()
    return merged


@dataclass(frozen=True)
class HealthFigures:
    """What a statistics vector says: mean, RMS, max ``|x|`` and kurtosis of the finite
    values, the fraction of units zero on every row, and the NaN and ±inf counts."""

    count: int
    mean: float
    rms: float
    absmax: float
    kurtosis: float  # E[(x - mean)^4] / var^2: 3 for a normal distribution
    dead_fraction: float
    nan: int
    inf: int
    histogram: tuple[float, ...] = ()  # counts of |x| between EDGES, if asked for
    sums: tuple[float, float] = (math.nan, math.nan)  # of x and of x^2

    @classmethod
    def of(cls, vector: torch.Tensor, histogram: bool = False) -> HealthFigures:
        """Read a (merged) statistics vector, on any device (``histogram``: it has one)."""
        values = vector.detach().double().cpu().tolist()
        count, s1, s2, s3, s4, absmax, nan, inf = values[:HEAD]
        bins = len(EDGES) + 1 if histogram else 0
        counts, units = tuple(values[HEAD : HEAD + bins]), values[HEAD + bins :]
        if not count:
            none = math.nan
            return cls(0, none, none, none, none, none, int(nan), int(inf), counts)
        mean = s1 / count
        variance = max(s2 / count - mean * mean, 0.0)
        fourth = s4 / count - 4 * mean * s3 / count + 6 * mean**2 * s2 / count - 3 * mean**4
        kurtosis = fourth / variance**2 if variance > 0 else math.nan
        dead = sum(1 for unit in units if unit == 0) / len(units) if units else math.nan
        rms = math.sqrt(s2 / count)
        return cls(
            int(count), mean, rms, absmax, kurtosis, dead, int(nan), int(inf), counts, (s1, s2)
        )

    def scalars(self) -> dict[str, float]:
        """The figures a monitor logs, by name."""
        return {
            "mean": self.mean,
            "rms": self.rms,
            "absmax": self.absmax,
            "kurtosis": self.kurtosis,
            "dead_frac": self.dead_fraction,
            "nonfinite": float(self.nan + self.inf),
        }
