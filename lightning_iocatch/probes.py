"""Validation-time activation probes: torchmetrics metrics, usable without Lightning.

Pass prototypes to ``IOCaptureCallback(spec, probes=[...])``: its
:class:`~lightning_iocatch.probe_sink.ProbeSink` clones a per-tensor probe
(:class:`ActivationStats`, :class:`LinearProbe`) for every captured tensor and dataloader
and a cross-tensor probe (:class:`LayerCKA`) for every dataloader, feeds them each
validation (or test) batch, and computes, logs and resets them at the end of the epoch.
This module never imports Lightning: the metrics can be used and tested on their own.

A probe's ``update(features, batch=None, indices=None, repeated=None)`` takes a captured
tensor (or, when ``per_tensor`` is False, a mapping of them by flat key), the batch as
the step received it, the samples' dataset indices and, per sample, whether it is padding
that repeats a sample seen elsewhere; ``compute()`` returns a dict of named scalars.

What probes consume (:func:`usable`): floating-point tensors with a batch dimension, that
is whose first dimension equals the batch's number of samples (``len(indices)``, else
``len(repeated)``; with neither, every floating tensor of at least one dimension counts).
Everything else is ignored without error: bool masks, integer ids, ``None``, objects
without tensors, and tensors without a batch dimension such as rotary ``cos``/``sin``
of shape ``(1, seq, dim)``. A tensor whose first dimension happens to equal the number
of samples cannot be told apart from a batched one; through ``IOCaptureCallback``, a key
is only probed when its tensor had the batch dimension in every batch (of every process)
that captured it, so a rotary table is left out as soon as one batch has two samples.
Rows flagged in ``repeated`` are dropped before anything is counted.

Every count and sum is accumulated in float64 from the values themselves (float16 and
bfloat16 captures are cast before any arithmetic), so reduced-precision captures neither
overflow nor lose precision.

Across processes, state tensors that torchmetrics syncs have shapes that do not depend on
the data, except where they cannot (feature widths, unit counts, the keys
:class:`LayerCKA` pairs): there, before any state is synced, the processes exchange
those shapes (``torch.distributed.all_gather_object``) and every process pads or
restricts its states to the agreed ones. A process that saw no data takes part with
empty states. Every value then equals the one a single process computes on the same
samples, up to the rounding of another summation order. Not protected against: padding
that is not flagged (a shuffling or custom sampler, whose indices are unknown, is padded
too) is counted twice, and a value that depends on which samples share a batch (a module
called for a whole batch when one of its samples needs it) differs with the batching.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "POOLS",
    "ActivationStats",
    "LayerCKA",
    "LinearProbe",
    "pool_features",
    "usable",
]

POOLS = ("mean", "last", "flatten")
_MASK64 = (1 << 64) - 1


def usable(value: Any, samples: int | None) -> bool:
    """Whether probes use ``value``: a floating tensor whose first dim is the ``samples``.

    ``samples`` is the batch's number of samples; ``None`` (unknown) accepts every
    floating tensor with at least one dimension.

    Example:
        >>> usable(torch.zeros(4, 7), 4), usable(torch.zeros(1, 7), 4), usable(torch.ones(4).bool(), 4)
        (True, False, False)
    """  # noqa: E501
    return (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and value.dim() > 0
        and (samples is None or value.shape[0] == samples)
    )


def pool_features(features: Tensor, pool: str) -> Tensor:
    """One row per sample: ``(B, ...)`` to ``(B, D)``; sequences are pooled over dim 1.

    ``"mean"`` averages over every dimension between the first and the last, ``"last"``
    takes the last position of dim 1, ``"flatten"`` keeps everything.

    Example:
        >>> pool_features(torch.ones(2, 5, 3), "mean").shape, pool_features(torch.ones(2, 5, 3), "flatten").shape
        (torch.Size([2, 3]), torch.Size([2, 15]))
    """  # noqa: E501
    if features.dim() == 1:
        return features.unsqueeze(1)
    if features.dim() == 2 or pool == "flatten":
        return features.reshape(features.shape[0], -1)
    if pool == "mean":
        return features.mean(dim=tuple(range(1, features.dim() - 1)))
    return features[:, -1].reshape(features.shape[0], -1)


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise ValueError(f"`pool` must be one of {POOLS}, got {pool!r}")


def _samples(indices: Sequence[int] | None, repeated: Sequence[bool] | None) -> int | None:
    if indices is not None:
        return len(indices)
    return len(repeated) if repeated is not None else None


def _kept(repeated: Sequence[bool] | None, samples: int, device: torch.device) -> Tensor | None:
    """The mask of rows that are not padding; ``None`` when every row is kept."""
    if repeated is None or not any(repeated):
        return None
    if len(repeated) != samples:
        raise ValueError(f"`repeated` has {len(repeated)} flags for {samples} samples")
    return ~torch.tensor(list(repeated), dtype=torch.bool, device=device)


def _rows(features: Any, indices: Any, repeated: Any) -> Tensor | None:
    """The usable ``features`` without padding rows, detached; ``None`` when not usable."""
    if not usable(features, _samples(indices, repeated)):
        return None
    values = features.detach()
    keep = _kept(repeated, values.shape[0], values.device)
    return values if keep is None else values[keep]


def _gather_objects(value: Any, group: Any = None) -> list[Any]:
    """``value`` of every process of ``group`` (all processes when ``None``), in rank order."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, value, group=group)
    return gathered


class _ProbeMetric(Metric):
    """A metric whose data-dependent state shapes are agreed across processes before a sync.

    Subclasses describe those shapes with :meth:`_layout` (a small picklable value,
    ``None`` when no data was seen) and reshape their states to the agreement of every
    process in :meth:`_align`, which every process runs on the same gathered list.
    """

    per_tensor: ClassVar[bool] = True
    full_state_update: bool = False
    is_differentiable: bool = False

    def _layout(self) -> Any:
        return None

    def _align(self, layouts: list[Any]) -> None:
        """Pad or restrict the states to the shapes agreed from every process's layout."""

    def sync(
        self,
        dist_sync_fn: Callable | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable | None = None,
    ) -> None:
        available = distributed_available or self.distributed_available_fn
        if should_sync and not self._is_synced and callable(available) and available():
            # before torchmetrics caches the local states: what it restores after compute
            # is then the aligned states, consistent with the aligned layout
            group = process_group or self.process_group
            self._align(_gather_objects(self._layout(), group))
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)


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
    rows flagged in ``repeated``; anything else is ignored.

    Example:
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
    ) -> None:
        values = _rows(features, indices, repeated)
        if values is None or values.numel() == 0:
            return
        flat = values.to(torch.float64, copy=True).reshape(-1)  # cast the values, not the sums
        self.zeros = self.zeros + (flat.numel() - torch.count_nonzero(flat))
        mean = flat.mean()
        deviations = flat.sub_(mean)  # two passes over the float64 copy, in place
        row = torch.stack([mean.new_tensor(float(flat.numel())), mean, deviations @ deviations])
        self.moments = _chan(self.moments[0], row)[None]
        units = values.reshape(-1, values.shape[-1] if values.dim() > 1 else 1)
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


def _unit_hash(index: int) -> float:
    """SplitMix64 of a dataset index, as a number in [0, 1): the same on every process."""
    z = (index + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) / 2.0**64


def _content_hash(row: Tensor) -> tuple[float, float]:
    """Two independent numbers in [0, 1) from a row's float32 bytes."""
    digest = hashlib.blake2b(row.to(torch.float32).cpu().numpy().tobytes(), digest_size=16)
    data = digest.digest()
    return (
        int.from_bytes(data[:8], "little") / 2.0**64,
        int.from_bytes(data[8:], "little") / 2.0**64,
    )


def _smallest(keys: Tensor, count: int) -> Tensor:
    """Positions of the ``count`` smallest ``(score, tie-break)`` rows of ``keys``."""
    order = torch.argsort(keys[:, 1], stable=True)
    order = order[torch.argsort(keys[order, 0], stable=True)]
    return order[:count]


_CONFLICT = "conflict"


class LinearProbe(_ProbeMetric):
    """A ridge-regularised linear probe on one captured tensor, fitted from streamed statistics.

    Args:
        target: ``target(batch) -> Tensor`` of labels: class ids for classification,
            values (``(B,)`` or ``(B, K)``) for regression.
        task: ``"classification"`` (reports ``{name}_acc``) or ``"regression"``
            (``{name}_r2``), both on the held-out samples.
        num_classes: number of classes (classification).
        pool: how sequence features become one row per sample (see :func:`pool_features`).
        holdout: fraction of samples held out for scoring, chosen per sample from a hash
            score of its dataset index (or, where indices are unknown, of its pooled
            features), so the split is the same whatever the number of processes.
        max_holdout: held-out samples scored: those with the smallest ``(score, index)``
            over all processes, the same ones whatever the number of processes. Held-out
            samples past the cap are neither scored nor trained on. A process keeps at
            most ``2 * max_holdout`` pooled held-out rows; the rest are folded into
            ``X^T X`` and ``X^T Y`` and dropped.
        holdout_dtype: dtype of the kept held-out features (``torch.float16`` halves them).
        ridge: L2 penalty, relative to the mean diagonal of ``X^T X``.
        name: prefix of the reported value.

    Takes floating tensors with a batch dimension (see :func:`usable`), without the rows
    flagged in ``repeated``. The pooled width must stay the same: a tensor whose width
    changes between batches (or processes) reports NaN, with a warning.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> probe = LinearProbe(lambda batch: batch, num_classes=2, holdout=0.5)
        >>> x = torch.randn(200, 3)
        >>> probe.update(x, batch=(x[:, 0] > 0).long(), indices=list(range(200)))
        >>> probe.compute()["probe_acc"] > 0.9
        tensor(True)
    """

    gram: Tensor
    cross: Tensor
    conflicts: Tensor
    held_x: list[Tensor]
    held_y: list[Tensor]
    held_key: list[Tensor]

    def __init__(
        self,
        target: Callable[[Any], Tensor],
        task: str = "classification",
        num_classes: int | None = None,
        pool: str = "mean",
        holdout: float = 0.2,
        max_holdout: int = 10_000,
        holdout_dtype: torch.dtype = torch.float32,
        ridge: float = 1e-3,
        name: str = "probe",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(target):
            raise TypeError("`target` must be a callable: target(batch) -> labels tensor")
        if task not in ("classification", "regression"):
            raise ValueError(f"`task` must be 'classification' or 'regression', got {task!r}")
        if task == "classification" and (num_classes is None or num_classes < 2):
            raise ValueError(f"classification needs `num_classes` >= 2, got {num_classes!r}")
        _check_pool(pool)
        if not 0 < holdout < 1:
            raise ValueError(f"`holdout` must be a fraction in (0, 1), got {holdout}")
        if max_holdout < 1 or ridge < 0:
            raise ValueError("`max_holdout` must be >= 1 and `ridge` >= 0")
        self.target, self.task, self.num_classes = target, task, num_classes
        self.pool, self.holdout, self.max_holdout = pool, holdout, max_holdout
        self.holdout_dtype, self.ridge, self.name = holdout_dtype, ridge, name
        self.add_state("gram", torch.zeros(0, 0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("cross", torch.zeros(0, 0, dtype=torch.float64), dist_reduce_fx="sum")
        # batches whose width differed from the first one's
        self.add_state("conflicts", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        # held-out rows: pooled features, labels (class ids or values, float64) and
        # their (score, tie-break) keys; before a sync each process keeps its smallest
        self.add_state("held_x", [], dist_reduce_fx="cat")
        self.add_state("held_y", [], dist_reduce_fx="cat")
        self.add_state("held_key", [], dist_reduce_fx="cat")

    def _keys(self, rows: Tensor, indices: Sequence[int] | None) -> Tensor:
        if indices is not None:
            keys = [(_unit_hash(int(i)), float(i)) for i in indices]
        else:
            keys = [_content_hash(row) for row in rows]
        return torch.tensor(keys, dtype=torch.float64, device=rows.device).reshape(-1, 2)

    def _labels(self, labels: Tensor) -> Tensor:
        if self.task == "classification":
            return labels.reshape(-1, 1).long().double()
        return labels.double().reshape(labels.shape[0], -1)

    def _targets(self, labels: Tensor) -> Tensor:
        if self.task == "classification":
            assert self.num_classes is not None
            return torch.nn.functional.one_hot(labels.long().reshape(-1), self.num_classes).double()
        return labels

    def update(
        self,
        features: Tensor,
        batch: Any = None,
        indices: Sequence[int] | None = None,
        repeated: Sequence[bool] | None = None,
    ) -> None:
        if not usable(features, _samples(indices, repeated)):
            return
        samples = features.shape[0]
        labels = torch.as_tensor(self.target(batch))
        if labels.dim() == 0 or labels.shape[0] != samples:
            raise ValueError(f"`target(batch)` gave {tuple(labels.shape)} for {samples} samples")
        values = features.detach().to(torch.float64)  # before pooling: float16 sums overflow
        labels = self._labels(labels.to(features.device))
        keep = _kept(repeated, samples, features.device)
        if keep is not None:
            values, labels = values[keep], labels[keep]
            if indices is not None:
                indices = [i for i, kept in zip(indices, keep.tolist(), strict=True) if kept]
        if values.shape[0] == 0:
            return
        rows = pool_features(values, self.pool)
        width = rows.shape[1] + 1
        outputs = self._targets(labels[:1]).shape[1]
        if self.gram.numel() == 0 and not self.conflicts:
            self.gram = rows.new_zeros(width, width)
            self.cross = rows.new_zeros(width, outputs)
        if (self.gram.shape[0], self.cross.shape[1]) != (width, outputs) or self.conflicts:
            self.conflicts = self.conflicts + 1
            return
        keys = self._keys(rows, indices)
        held = keys[:, 0] < self.holdout
        train = torch.cat([rows[~held], rows.new_ones(int((~held).sum()), 1)], dim=1)
        self.gram = self.gram + train.T @ train
        self.cross = self.cross + train.T @ self._targets(labels[~held])
        if bool(held.any()):
            self.held_x.append(rows[held].to(self.holdout_dtype))
            self.held_y.append(labels[held])
            self.held_key.append(keys[held])
            if sum(part.shape[0] for part in self.held_key) > 2 * self.max_holdout:
                self._keep_smallest()

    def _keep_smallest(self) -> None:
        """Keep the ``max_holdout`` held-out rows of smallest key, as one tensor each."""
        keys = _cat(self.held_key)
        chosen = _smallest(keys, self.max_holdout)
        self.held_x = [_cat(self.held_x)[chosen]]
        self.held_y = [_cat(self.held_y)[chosen]]
        self.held_key = [keys[chosen]]

    def _layout(self) -> tuple[int, int] | str | None:
        if self.conflicts:
            return _CONFLICT
        return tuple(self.cross.shape) if self.gram.numel() else None  # type: ignore[return-value]

    def _align(self, layouts: list[Any]) -> None:
        shapes = {layout for layout in layouts if layout is not None}
        if len(shapes) > 1 or _CONFLICT in shapes:  # every process decides alike
            self.conflicts = self.conflicts + (0 if self.conflicts else 1)
            shapes = set()
        (width, outputs) = shapes.pop() if shapes else (1, 1)
        if self.gram.numel() == 0 or self.conflicts:
            self.gram = self.gram.new_zeros(width, width)
            self.cross = self.cross.new_zeros(width, outputs)
        labels = outputs if self.task == "regression" else 1
        device = self.gram.device
        if self.held_key and not self.conflicts:
            self._keep_smallest()
        else:  # typed, shaped empties: torchmetrics would send float32 vectors
            self.held_x = [torch.zeros(0, width - 1, dtype=self.holdout_dtype, device=device)]
            self.held_y = [torch.zeros(0, labels, dtype=torch.float64, device=device)]
            self.held_key = [torch.zeros(0, 2, dtype=torch.float64, device=device)]

    def compute(self) -> dict[str, Tensor]:
        key = f"{self.name}_acc" if self.task == "classification" else f"{self.name}_r2"
        nan = {key: torch.tensor(math.nan, dtype=torch.float64)}
        if self.conflicts:
            warnings.warn(
                f"{type(self).__name__}: the pooled feature width changed between batches or "
                "processes; a linear probe needs one width: choose `pool` so that it is fixed",
                stacklevel=2,
            )
            return nan
        held_keys = _cat(self.held_key)
        if self.gram.numel() == 0 or held_keys.numel() == 0:
            warnings.warn(f"{type(self).__name__}: no training or held-out samples", stacklevel=2)
            return nan
        chosen = _smallest(held_keys.reshape(-1, 2), self.max_holdout)
        held_x = _cat(self.held_x)[chosen].double()
        labels = _cat(self.held_y)[chosen]
        dim = self.gram.shape[0] - 1
        penalty = self.ridge * self.gram.diagonal()[:dim].mean().clamp_min(1e-12)
        regulariser = torch.diag(torch.cat([penalty.expand(dim), penalty.new_zeros(1)]))
        weights = torch.linalg.lstsq(self.gram + regulariser, self.cross).solution
        x = torch.cat([held_x, held_x.new_ones(held_x.shape[0], 1)], dim=1)
        predicted = x @ weights
        if self.task == "classification":
            return {key: (predicted.argmax(dim=1) == labels.reshape(-1)).double().mean()}
        residual = ((labels - predicted) ** 2).sum()
        total = ((labels - labels.mean(dim=0)) ** 2).sum()
        return {key: 1 - residual / total}


def _cat(state: Tensor | list[Tensor]) -> Tensor:
    """A list state before sync, a tensor after: one tensor either way."""
    if isinstance(state, Tensor):
        return state
    return torch.cat(state) if state else torch.zeros(0)


class LayerCKA(_ProbeMetric):
    """Linear CKA between every pair of captured tensors, exact from streamed statistics.

    Features are pooled per sample (see :func:`pool_features`); for every pair of
    tensors, ``CKA(X, Y) = ||X_c^T Y_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F)`` with
    ``X_c`` the centred features, computed from the running sums of ``Z^T Z`` and ``Z``
    over the concatenated features ``Z = [X | Y | ...]``: memory is ``(sum of feature
    dims)^2`` float64 numbers. ``compute()`` returns ``cka/{a}~{b}``.

    The tensors paired are the keys present, with one pooled width, in every batch of
    every process that had batches (a batch of padding only does not count), in sorted
    order: a key missing from a batch, or whose width changes, is dropped from then on,
    never paired with another tensor. Each batch takes the usable tensors of the mapping
    (see :func:`usable`) without the rows flagged in ``repeated``.

    Example:
        >>> cka = LayerCKA()
        >>> x = torch.randn(50, 4)
        >>> cka.update({"a": x, "b": 3 * x @ torch.linalg.qr(torch.randn(4, 4))[0]})
        >>> round(float(cka.compute()["cka/a~b"]), 6)
        1.0
    """

    per_tensor: ClassVar[bool] = False
    gram: Tensor
    sums: Tensor
    count: Tensor
    pending: list[Tensor]

    def __init__(self, pool: str = "mean", fold_rows: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_pool(pool)
        self.pool = pool
        self.fold_rows = fold_rows
        self.layout: dict[str, int] = {}  # key -> pooled width, in sorted key order
        self.seen = False  # whether a batch (not only padding) was seen
        self.add_state("gram", torch.zeros(0, 0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sums", torch.zeros(0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        # rows not yet folded into the gram (fewer than fold_rows a process): one large
        # matrix product instead of one a batch; folded before a sync
        self.add_state("pending", [], dist_reduce_fx="cat")

    def update(
        self,
        features: Mapping[str, Tensor],
        batch: Any = None,
        indices: Sequence[int] | None = None,
        repeated: Sequence[bool] | None = None,
    ) -> None:
        samples = _samples(indices, repeated)
        if samples is None:
            samples = _most_common_rows(features)
        if repeated is not None and len(repeated) == samples and all(repeated):
            return  # padding only: not part of the data
        wanted = sorted(features) if not self.seen else list(self.layout)
        pooled: dict[str, Tensor] = {}
        for key in wanted:
            tensor = features.get(key)
            if not usable(tensor, samples):
                continue
            assert tensor is not None
            values = tensor.detach()
            keep = _kept(repeated, values.shape[0], values.device)
            values = values if keep is None else values[keep]
            pooled[key] = pool_features(values.to(torch.float64), self.pool)
        widths = {key: rows.shape[1] for key, rows in pooled.items()}
        if not self.seen:
            self.seen = True
            self._restrict(widths)
        elif widths != self.layout:
            self._restrict({k: w for k, w in self.layout.items() if widths.get(k) == w})
        rows = [pooled[key] for key in self.layout]
        if not rows:
            return
        self.pending.append(torch.cat(rows, dim=1))
        if sum(part.shape[0] for part in self.pending) >= self.fold_rows:
            self.gram, self.sums, self.count = self._folded()
            self.pending = []

    def _restrict(self, layout: dict[str, int]) -> None:
        """Keep the statistics of the keys of ``layout`` (a sub-layout, or the first one)."""
        if not self.layout:
            width = sum(layout.values())
            self.gram = self.gram.new_zeros(width, width)
            self.sums = self.sums.new_zeros(width)
        else:
            self.gram, self.sums, self.count = self._folded()
            starts, start = {}, 0
            for key, width in self.layout.items():
                starts[key], start = start, start + width
            columns = [i for key in layout for i in range(starts[key], starts[key] + layout[key])]
            index = torch.tensor(columns, dtype=torch.long, device=self.gram.device)
            self.gram = self.gram[index][:, index]
            self.sums = self.sums[index]
        self.pending = []
        self.layout = dict(layout)

    def _folded(self) -> tuple[Tensor, Tensor, Tensor]:
        """The gram, sums and count with the pending rows folded in."""
        z = _cat(self.pending).to(torch.float64)
        if z.numel() == 0:
            return self.gram, self.sums, self.count
        return self.gram + z.T @ z, self.sums + z.sum(dim=0), self.count + z.shape[0]

    def _layout(self) -> dict[str, int] | None:
        return dict(self.layout) if self.seen else None

    def _align(self, layouts: list[Any]) -> None:
        seen = [layout for layout in layouts if layout is not None]
        if seen:
            common = {k: w for k, w in sorted(seen[0].items()) if all(s.get(k) == w for s in seen)}
            if not self.seen:
                self.seen, self.layout = True, {}
            self._restrict(common)
        width = self.gram.shape[0]
        self.pending = [self.gram.new_zeros(0, width)]

    def reset(self) -> None:
        super().reset()
        self.layout = {}
        self.seen = False

    def compute(self) -> dict[str, Tensor]:
        gram, sums, count = self._folded()
        if not count:
            return {}
        centred = gram - torch.outer(sums, sums) / count
        spans, start = {}, 0
        for key, width in self.layout.items():
            spans[key], start = slice(start, start + width), start + width
        norms = {key: centred[span, span].norm() for key, span in spans.items()}
        keys = list(spans)
        result = {}
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                cross = centred[spans[a], spans[b]].norm() ** 2
                result[f"cka/{a}~{b}"] = cross / (norms[a] * norms[b])
        return result


def _most_common_rows(features: Mapping[str, Tensor]) -> int | None:
    counts: dict[int, int] = {}
    for tensor in features.values():
        if usable(tensor, None):
            counts[tensor.shape[0]] = counts.get(tensor.shape[0], 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None
