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

__all__ = [
    "EDGES",
    "HEAD",
    "HealthFigures",
    "batch_statistics",
    "batched",
    "health_statistics",
    "merge_statistics",
]

HEAD = 8  # count, mean, m2, m3, m4 (centred sums), absmax, nan, inf; [histogram]; units
_MAX = 5  # the place of absmax: taken as a maximum, every other place is added
EDGES = tuple(10.0 ** (k / 4) for k in range(-24, 13))
"""The edges of the histogram of ``|x|`` (``1e-6`` to ``1e3``, 4 bins a decade): with the
values below the first and above the last, ``len(EDGES) + 1`` counts."""
_SMALL = 2**16
"""Tensors of at most this many values are read in float64 (a copy of 512 KiB at most)."""
_BATCHED = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes :func:`batch_statistics` takes (float64 values may overflow a fourth power)."""
_LAYOUT = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}
"""A dtype's integer of its size, mantissa bits and exponent bias."""


def health_statistics(
    tensor: torch.Tensor, rows: torch.Tensor | None = None, histogram: bool = False
) -> torch.Tensor:
    """The statistics vector of ``tensor`` (float64, on its device: ``HEAD``, with
    ``histogram`` the counts of the finite ``|x|`` between :data:`EDGES` and their sum,
    then a count per unit).

    ``rows``: a bool mask over the tensor's leading dimensions; only those rows count.
    A tensor of more than 65,536 values is read in its own dtype (float16 and
    bfloat16 widened to float32), not copied to float64: the centred powers are taken in
    float32 of the values scaled by a power of two (no overflow at ``1e20``, no underflow
    at ``1e-20``), summed along the last dimension in float32 and across it in float64.
    Against float64 arithmetic: the mean within ``1e-6`` of the RMS, RMS, kurtosis and
    the centred sums within a relative ``1e-6``; max ``|x|`` and the counts exact. Smaller
    tensors are read in float64 (the same figures as float64 arithmetic, to rounding).
    """
    values = _selected(tensor.detach(), rows)
    units = values.shape[-1] if values.dim() else 1
    values = values.reshape(-1, units)
    if values.numel() <= _SMALL:  # float64 arithmetic costs nothing here: exact figures
        values = values.double()
    elif values.dtype not in _LAYOUT:
        values = values.float()  # float16 and bfloat16: their powers would overflow
    if not values.numel():
        head = values.new_zeros(HEAD, dtype=torch.float64)
        counts = values.new_zeros(len(EDGES) + 2 if histogram else 0, dtype=torch.float64)
        return torch.cat([head, counts, values.new_zeros(units, dtype=torch.float64)])
    low, high = torch.aminmax(values)  # NaN if there is one, inf if there is one
    clean = _all_finite(low, high)
    if clean:  # the values as they are: no non-finite count, no copy with zeros
        finite, count = values, low.new_tensor(float(values.numel()), dtype=torch.float64)
        nan = inf = count.new_zeros(())
    else:  # non-finite values (or not known without a host sync) count as zeros
        nan = torch.isnan(values).sum(dtype=torch.float64)
        inf = torch.isinf(values).sum(dtype=torch.float64)
        count = values.numel() - nan - inf
        finite = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        low, high = torch.aminmax(finite)
    absmax = torch.maximum(high, -low)
    moments = _moments(values, finite, absmax, count, clean)
    head = torch.cat([count[None], moments, torch.stack([absmax.double(), nan, inf])])
    nonzero = _nonzero(finite)  # a NaN is not activity
    if not histogram:
        return torch.cat([head, nonzero])
    return torch.cat([head, _histogram(finite, nan + inf), nonzero])


def batched(tensor: torch.Tensor) -> bool:
    """Whether :func:`batch_statistics` takes ``tensor``'s values (read as float64): a
    float32, float16 or bfloat16 tensor of 1 to 65,536 values, whose fourth powers
    cannot overflow or underflow in float64 (no scaling needed)."""
    return tensor.dtype in _BATCHED and 0 < tensor.numel() <= _SMALL


def batch_statistics(
    values: torch.Tensor, histogram: bool = False, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """The statistics vectors of several tensors at once: ``values`` is ``[tensors, rows,
    units]`` in float64 (each tensor's selected rows, as :func:`health_statistics` reads
    it, of a dtype :func:`batched` takes); ``[tensors, length]``, row ``b`` the figures of
    :func:`health_statistics` of ``values[b]``: the same sums, along the units then the
    rows, each tensor's own (on the CPU the same figures bit for bit, tested). One pass
    per figure for all the tensors, not one per tensor: a small
    tensor's statistics cost a few dozen operations whatever its size. ``values`` is
    overwritten (centred in place); ``scratch``, a float64 tensor of its shape, holds the
    magnitudes and squares (no fresh memory: on the CPU, large fresh blocks cost page
    faults).

    Examples:
        >>> x = torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[2.0, 2.0], [2.0, 2.0]]])
        >>> batch_statistics(x.double())[:, :2].tolist()  # count, mean
        [[4.0, 1.0], [4.0, 2.0]]
    """
    tensors, rows, units = values.shape
    magnitudes = torch.abs(values, out=scratch) if scratch is not None else values.abs()
    absmax = magnitudes.amax((1, 2))  # NaN or inf if a tensor has one
    if _all_finite_batch(absmax):
        finite = values  # no non-finite count, no copy with zeros
        count = values.new_full((tensors,), float(rows * units))
        nan = inf = values.new_zeros(tensors)
    else:  # non-finite values (or not known without a host sync) count as zeros
        nan = torch.isnan(values).sum((1, 2), dtype=torch.float64)
        inf = torch.isinf(values).sum((1, 2), dtype=torch.float64)
        count = rows * units - nan - inf
        finite = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        magnitudes = torch.abs(finite, out=magnitudes)
        absmax = magnitudes.amax((1, 2))
    parts = []
    if histogram:
        edges = torch.tensor(EDGES, dtype=torch.float64, device=values.device)
        bins = len(EDGES) + 1
        places = torch.bucketize(magnitudes.reshape(tensors, -1), edges, right=True)
        places += torch.arange(tensors, device=places.device)[:, None] * bins  # each its own
        counts = torch.bincount(places.flatten(), minlength=tensors * bins).double()
        counts = counts.reshape(tensors, bins)
        counts[:, 0] -= nan + inf
        parts += [counts, _batch_sum(magnitudes)[:, None]]
    nonzero = magnitudes.sign_().sum(1)  # |sign(x)|, as _nonzero; a NaN is not activity
    head = _batch_head(values, finite, count, absmax, nan, inf, magnitudes)
    return torch.cat([head, *parts, nonzero], dim=1)


def _all_finite_batch(absmax: torch.Tensor) -> bool:
    """Whether tensors of largest ``|x|`` ``absmax`` are all finite, where that costs no
    host sync (on the CPU); elsewhere ``False``: not known."""
    return absmax.device.type == "cpu" and bool(torch.isfinite(absmax).all())


def _batch_head(
    values: torch.Tensor, finite: torch.Tensor, count: torch.Tensor, absmax: torch.Tensor,
    nan: torch.Tensor, inf: torch.Tensor, scratch: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """:func:`_moments` of each tensor of ``[tensors, rows, units]`` float64 values, then
    the head of each statistics vector (``[tensors, HEAD]``). Float64 powers of values of
    float32's range neither overflow nor underflow: no scaling (which, a power of two, is
    exact: the same figures); the centre is the float64 mean itself. ``scratch`` (free,
    of the values' shape) holds the squares."""
    n = count.clamp(min=1)
    mean = _batch_sum(finite) / n
    if finite is values:
        centred = values.sub_(mean[:, None, None])
    else:  # from the values: a NaN or inf stays one, then has no part
        centred = (values - mean[:, None, None]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    square = torch.mul(centred, centred, out=scratch)
    s1, s2 = _batch_sum(centred), _batch_sum(square)
    s3, s4 = _batch_sum(centred.mul_(square)), _batch_sum(square.mul_(square))
    shift = s1 / n
    m2 = s2 - shift * s1
    m3 = s3 - 3 * shift * s2 + 2 * count * shift**3
    m4 = s4 - 4 * shift * s3 + 6 * shift**2 * s2 - 3 * count * shift**4
    return torch.stack([count, mean, m2, m3, m4, absmax, nan, inf], dim=1)


def _batch_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Each tensor's sum of ``[tensors, rows, units]``: along the units, then the rows
    (the order of :func:`_sum`)."""
    return tensor.sum(-1).sum(-1)


def _selected(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``values`` that ``rows`` keeps (all of them, on the CPU, when it keeps
    every one: no copy), along a flattened first dimension."""
    if rows is None:
        return values
    if rows.dim() == 0 or tuple(rows.shape) != tuple(values.shape[: rows.dim()]):
        raise ValueError(
            f"`rows` of shape {tuple(rows.shape)} is not a mask over the leading dimensions "
            f"of a tensor of shape {tuple(values.shape)}: give one of shape "
            f"{tuple(values.shape[:2])} (batch, sequence), or None"
        )
    if rows.device.type == "cpu" and bool(rows.all()):
        return values
    places = rows.to(values.device).reshape(-1).nonzero().squeeze(1)
    return values.flatten(0, rows.dim() - 1).index_select(0, places)  # faster than values[rows]


def _all_finite(low: torch.Tensor, high: torch.Tensor) -> bool:
    """Whether values of smallest ``low`` and largest ``high`` are all finite, where that
    costs no host sync (on the CPU); elsewhere ``False``: not known."""
    return low.device.type == "cpu" and bool(torch.isfinite(low) & torch.isfinite(high))


def _moments(
    values: torch.Tensor, finite: torch.Tensor, absmax: torch.Tensor, count: torch.Tensor,
    clean: bool,
) -> torch.Tensor:  # fmt: skip
    """The mean of the finite values and the centred sums of their second, third and
    fourth powers (float64); ``finite``: the values, non-finite ones as zeros.

    The values are scaled by a power of two (exact) to below 4 in magnitude, centred at
    their mean rounded to their dtype, and the powers of that summed (in their dtype along
    the last dimension, in float64 across it: no float64 copy); the sums are then shifted
    to the exact mean and scaled back (the shifted-data algorithm: stable, as the centre is
    within a rounding of the mean)."""
    scale = _power_of_two(2 - torch.frexp(absmax).exponent, values.dtype)
    scaled = finite * scale
    n = count.clamp(min=1)
    mean = _sum(scaled) / n
    centre = mean.to(values.dtype)
    if clean:
        centred = scaled.sub_(centre)
    else:  # from the values: a NaN or inf stays one, then has no part
        centred = torch.addcmul(-centre, values, scale, out=scaled)
        centred.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    square = centred * centred
    s1, s2 = _sum(centred), _sum(square)
    s3, s4 = _sum(centred.mul_(square)), _sum(square.mul_(square))
    shift = s1 / n  # the exact mean's place from the centre
    m2 = s2 - shift * s1
    m3 = s3 - 3 * shift * s2 + 2 * count * shift**3
    m4 = s4 - 4 * shift * s3 + 6 * shift**2 * s2 - 3 * count * shift**4
    unit = 1 / scale.double()
    return torch.stack([mean * unit, m2 * unit**2, m3 * unit**3, m4 * unit**4])


def _nonzero(finite: torch.Tensor) -> torch.Tensor:
    """The number of non-zero values of each unit (float64): the signs' magnitudes summed
    (faster on the CPU than a comparison), exact in float32 up to ``2**24`` rows."""
    if finite.shape[0] > 2**24:
        return torch.count_nonzero(finite, dim=0).double()
    return finite.sign().abs_().sum(0).double()


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a ``[rows, units]`` tensor: along the units in its dtype, across them in
    float64 (a float64 sum of it all would copy it to float64 on the CPU)."""
    return tensor.sum(-1).sum(dtype=torch.float64)


def _power_of_two(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** exponent`` in ``dtype`` (float32 or float64), exactly, on the exponent's
    device: the exponent's bits put in place (clamped to the normal numbers)."""
    integer, mantissa, bias = _LAYOUT[dtype]
    biased = (exponent.to(integer) + bias).clamp(1, 2 * bias)
    return (biased << mantissa).view(dtype)


def _histogram(finite: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """The counts of the finite ``|x|`` between :data:`EDGES`, then their sum (float64);
    ``finite`` holds the ``nonfinite`` values as zeros, taken back out of the first count."""
    edges = torch.tensor(EDGES, dtype=torch.float64, device=finite.device)
    if finite.dtype != torch.float64:  # the smallest value >= each edge: the same places
        rounded = edges.to(finite.dtype)
        edges = torch.where(rounded < edges, torch.nextafter(rounded, rounded + 1), rounded)
    magnitudes = finite.abs()
    places = torch.bucketize(magnitudes.flatten(), edges, right=True)  # 0: below the first
    counts = torch.bincount(places, minlength=len(EDGES) + 1).double()
    counts[0] -= nonfinite
    return torch.cat([counts, _sum(magnitudes)[None]])


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
    values, the fraction of units zero (or not finite) on every row (1.0 when no value is
    finite; NaN when there is no row, or no per-unit part), and the NaN and ±inf counts."""

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
    abs_sum: float = math.nan  # of |x|, with a histogram

    @classmethod
    def of(cls, vector: torch.Tensor, histogram: bool = False) -> HealthFigures:
        """Read a (merged) statistics vector, on any device (``histogram``: it has one)."""
        return cls.of_many(vector[None], histogram)[0]

    @classmethod
    def of_many(cls, vectors: torch.Tensor, histogram: bool = False) -> list[HealthFigures]:
        """Read statistics vectors of one length (``[n, length]``, on any device) in one
        transfer: the heads and each vector's number of dead units, not every unit."""
        lead = HEAD + (len(EDGES) + 2 if histogram else 0)  # with the sum of |x|
        vectors = vectors.detach().double()
        dead = (vectors[:, lead:] == 0).sum(1, dtype=torch.float64)  # -0.0 too, not NaN
        read = torch.cat([vectors[:, :lead], dead[:, None]], 1).cpu().tolist()
        units = vectors.shape[1] - lead
        return [cls.of_head(row[:-1], int(row[-1]), units, histogram) for row in read]

    @classmethod
    def of_head(
        cls, values: list[float], dead_units: int, units: int, histogram: bool = False
    ) -> HealthFigures:
        """The figures of a vector's head (``HEAD`` values, with ``histogram`` its counts
        and sum of ``|x|``), its per-unit part of ``units`` units ``dead_units`` zero."""
        count, mean, m2, _m3, m4, absmax, nan, inf = values[:HEAD]
        bins = len(EDGES) + 1 if histogram else 0
        counts = tuple(values[HEAD : HEAD + bins])
        abs_sum = values[HEAD + bins] if histogram else math.nan  # the histogram's last entry
        # non-finite values count as zeros: a unit with none finite is dead (no rows: NaN)
        seen = bool(units) and bool(count or nan or inf)
        dead = dead_units / units if seen else math.nan
        if not count:
            none = math.nan
            return cls(0, none, none, none, none, dead, int(nan), int(inf), counts)
        variance = m2 / count
        kurtosis = (m4 / count) / variance**2 if variance > 0 else math.nan
        rms = math.sqrt(variance + mean * mean)
        sums = (mean * count, (variance + mean * mean) * count)
        return cls(
            int(count), mean, rms, absmax, kurtosis, dead, int(nan), int(inf), counts, sums,
            abs_sum,
        )  # fmt: skip

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
