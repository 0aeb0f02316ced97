"""Activation health: a tensor's statistics reduced on its device to one small vector.

:func:`health_statistics` turns a captured tensor (activations or gradients) into a
float64 vector on the tensor's device: the number of finite values, their mean and the
sums of their centred second, third and fourth powers (centred, so that a large mean does
not cancel the rest), the largest ``|x|``, the number of NaN and of ±inf values, and per
unit (the last dimension) the number of non-zero values. Vectors of one place merge
across batches and processes (:func:`merge_statistics`: the moments combined by Pébay's
formulas, the counts added, the maximum taken), so a monitor gathers them in one
collective and reads the figures from the merge
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

HEAD = 8  # count, mean, m2, m3, m4 (centred sums), absmax, nan, inf; [histogram]; units
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
    nonzero = ((values != 0) & finite).sum(0).double()  # a NaN is not activity
    if not histogram:
        return torch.cat([head, nonzero])
    edges = torch.tensor(EDGES, dtype=torch.float64, device=values.device)
    places = torch.bucketize(wide.abs()[finite], edges, right=True)  # 0: below the first
    counts = torch.bincount(places, minlength=len(EDGES) + 1).double()
    return torch.cat([head, counts, nonzero])


def merge_statistics(vectors: torch.Tensor) -> torch.Tensor:
    """One vector from several of one place (``[n, HEAD + units]``): the moments
    combined, the counts added, the largest ``|x|`` taken.

    Examples:
        >>> a = health_statistics(torch.tensor([[1.0, -4.0]]))
        >>> b = health_statistics(torch.tensor([[2.0, 0.0]]))
        >>> HealthFigures.of(merge_statistics(torch.stack([a, b]))).absmax
        4.0
    """
    merged = vectors.sum(0)
    merged[_MAX] = vectors[:, _MAX].max()
    moments = vectors[0, :5]
    for row in vectors[1:]:
        moments = _combined(moments, row[:5])
    merged[:5] = moments
    return merged


def _combined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two parts' ``(count, mean, m2, m3, m4)`` as one (Pébay 2008, the pairwise update)."""
    na, ma, a2, a3, a4 = a.unbind()
    nb, mb, b2, b3, b4 = b.unbind()
    n = na + nb
    empty = n == 0
    n = torch.where(empty, torch.ones_like(n), n)  # no host sync: both parts empty -> a
    d = mb - ma
    m = ma + d * nb / n
    m2 = a2 + b2 + d**2 * na * nb / n
    m3 = a3 + b3 + d**3 * na * nb * (na - nb) / n**2 + 3 * d * (na * b2 - nb * a2) / n
    m4 = (
        a4 + b4
        + d**4 * na * nb * (na**2 - na * nb + nb**2) / n**3
        + 6 * d**2 * (na**2 * b2 + nb**2 * a2) / n**2
        + 4 * d * (na * b3 - nb * a3) / n
    )  # fmt: skip
    return torch.where(empty, a, torch.stack([na + nb, m, m2, m3, m4]))


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
        count, mean, m2, _m3, m4, absmax, nan, inf = values[:HEAD]
        bins = len(EDGES) + 1 if histogram else 0
        counts, units = tuple(values[HEAD : HEAD + bins]), values[HEAD + bins :]
        if not count:
            none = math.nan
            return cls(0, none, none, none, none, none, int(nan), int(inf), counts)
        variance = m2 / count
        kurtosis = (m4 / count) / variance**2 if variance > 0 else math.nan
        dead = sum(1 for unit in units if unit == 0) / len(units) if units else math.nan
        rms = math.sqrt(variance + mean * mean)
        sums = (mean * count, (variance + mean * mean) * count)
        return cls(int(count), mean, rms, absmax, kurtosis, dead, int(nan), int(inf), counts, sums)

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
