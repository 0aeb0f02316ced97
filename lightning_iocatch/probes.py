"""Validation-time activation probes: torchmetrics metrics fed by IOCaptureCallback.

Pass prototypes to ``IOCaptureCallback(spec, probes=[...])``. The callback clones a
per-tensor probe (:class:`ActivationStats`, :class:`LinearProbe`) for every captured
tensor and dataloader, and a cross-tensor probe (:class:`LayerCKA`) for every
dataloader; it moves them to the LightningModule's device, feeds them each validation
(or test) batch, and at the end of the epoch computes them (torchmetrics syncs their
states across processes), logs the values through Lightning and resets them.

A probe is a ``torchmetrics.Metric`` whose ``update(features, batch=None, indices=None)``
takes a captured tensor (or, when ``per_tensor`` is False, a dict of them by flat key),
the batch as the step received it, and the samples' dataset indices; ``compute()``
returns a dict of named scalars.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
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
]

POOLS = ("mean", "last", "flatten")
_MASK64 = (1 << 64) - 1


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


class ActivationStats(Metric):
    """Statistics of one captured tensor over an epoch, every element counted.

    ``compute()`` returns ``mean``, ``std`` (population), ``rms``, ``absmax``, ``zero_frac``
    (fraction of elements exactly zero) and ``dead_frac`` (fraction of units of the last
    dimension that were zero for every sample and position of the epoch). Each batch's
    mean and variance come from ``torch.var_mean`` (no naive sum of squares) and are
    merged in float64 with Chan's formula, so large counts and means lose no precision.

    Example:
        >>> stats = ActivationStats()
        >>> stats.update(torch.tensor([[0.0, 1.0], [0.0, 3.0]]))
        >>> {k: round(float(v), 3) for k, v in stats.compute().items()}
        {'mean': 1.0, 'std': 1.225, 'rms': 1.581, 'absmax': 3.0, 'zero_frac': 0.5, 'dead_frac': 0.5}
    """

    per_tensor: ClassVar[bool] = True
    full_state_update: bool = False
    is_differentiable: bool = False
    moments: Tensor
    absmax: Tensor
    zeros: Tensor
    alive: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # rows of (count, mean, M2); one row a process, concatenated when synced
        self.add_state("moments", torch.zeros(0, 3, dtype=torch.float64), dist_reduce_fx="cat")
        self.add_state("absmax", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("zeros", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("alive", torch.zeros(0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, features: Tensor, batch: Any = None, indices: Any = None) -> None:
        values = features.detach()
        if values.numel() == 0:
            return
        if not values.is_floating_point():
            values = values.double()
        # torch.var_mean is not a naive sum of squares (CPU accumulates in double, CUDA
        # uses Welford); the per-batch results are merged in float64 below.
        var, mean = torch.var_mean(values, correction=0)
        count = float(values.numel())
        row = torch.stack([mean.new_tensor(count), mean, var * count]).to(torch.float64)
        self.moments = row[None] if self.moments.numel() == 0 else _chan(self.moments[0], row)[None]
        low, high = torch.aminmax(values)
        self.absmax = torch.maximum(self.absmax, torch.maximum(-low, high).to(torch.float64))
        units = values.reshape(-1, values.shape[-1] if values.dim() > 1 else 1)
        nonzero = torch.count_nonzero(units, dim=0)  # per unit, one pass
        self.zeros = self.zeros + (count - nonzero.sum())
        alive = (nonzero > 0).to(torch.float64)
        self.alive = alive if self.alive.numel() == 0 else torch.maximum(self.alive, alive)

    def compute(self) -> dict[str, Tensor]:
        if self.moments.numel() == 0:
            nan = torch.tensor(math.nan, dtype=torch.float64)
            return dict.fromkeys(("mean", "std", "rms", "absmax", "zero_frac", "dead_frac"), nan)
        rows = self.moments.reshape(-1, 3)  # synced tensor states arrive stacked by process
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


def _chan(a: Tensor, b: Tensor) -> Tensor:
    """Merge two (count, mean, M2) rows (Chan, Golub and LeVeque)."""
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


def _content_hash(row: Tensor) -> float:
    digest = hashlib.blake2b(row.to(torch.float32).cpu().numpy().tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") / 2.0**64


class LinearProbe(Metric):
    """A ridge-regularised linear probe on one captured tensor, fitted from streamed statistics.

    Args:
        target: ``target(batch) -> Tensor`` of labels: class ids for classification,
            values (``(B,)`` or ``(B, K)``) for regression.
        task: ``"classification"`` (reports ``{name}_acc``) or ``"regression"``
            (``{name}_r2``), both on the held-out samples.
        num_classes: number of classes (classification).
        pool: how sequence features become one row per sample (see :func:`pool_features`).
        holdout: fraction of samples held out for scoring, chosen per sample from a hash of
            its dataset index (or, where indices are unknown, of its pooled features), so
            the split is the same whatever the number of processes.
        max_holdout: held-out samples kept per process (their pooled features are the only
            ones stored; the rest are folded into ``X^T X`` and ``X^T Y`` and dropped).
        holdout_dtype: dtype of the kept held-out features (``torch.float16`` halves them).
        ridge: L2 penalty, relative to the mean diagonal of ``X^T X``.
        name: prefix of the reported value.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> probe = LinearProbe(lambda batch: batch, num_classes=2, holdout=0.5)
        >>> x = torch.randn(200, 3)
        >>> probe.update(x, batch=(x[:, 0] > 0).long(), indices=list(range(200)))
        >>> probe.compute()["probe_acc"] > 0.9
        tensor(True)
    """

    per_tensor: ClassVar[bool] = True
    full_state_update: bool = False
    is_differentiable: bool = False
    gram: Tensor
    cross: Tensor
    held_x: list[Tensor]
    held_y: list[Tensor]

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
        self.add_state("held_x", [], dist_reduce_fx="cat")
        self.add_state("held_y", [], dist_reduce_fx="cat")

    def _targets(self, labels: Tensor) -> Tensor:
        if self.task == "classification":
            assert self.num_classes is not None
            return torch.nn.functional.one_hot(labels.long().reshape(-1), self.num_classes).double()
        return labels.double().reshape(labels.shape[0], -1)

    def _held_out(self, rows: Tensor, indices: Sequence[int] | None) -> Tensor:
        if indices is not None and len(indices) == rows.shape[0]:
            scores = [_unit_hash(int(i)) for i in indices]
        else:
            scores = [_content_hash(row) for row in rows]
        return torch.tensor([score < self.holdout for score in scores], device=rows.device)

    def update(self, features: Tensor, batch: Any = None, indices: Any = None) -> None:
        rows = pool_features(features.detach(), self.pool).to(torch.float64)
        labels = torch.as_tensor(self.target(batch)).to(rows.device)
        if labels.shape[0] != rows.shape[0]:
            raise ValueError(
                f"`target(batch)` gave {labels.shape[0]} labels for {rows.shape[0]} samples"
            )
        held = self._held_out(rows, indices)
        train = torch.cat([rows[~held], rows.new_ones(int((~held).sum()), 1)], dim=1)
        targets = self._targets(labels[~held])
        if self.gram.numel() == 0:
            self.gram = rows.new_zeros(train.shape[1], train.shape[1])
            self.cross = rows.new_zeros(train.shape[1], targets.shape[1])
        self.gram = self.gram + train.T @ train
        self.cross = self.cross + train.T @ targets
        room = self.max_holdout - sum(part.shape[0] for part in self.held_x)
        if room > 0 and bool(held.any()):
            self.held_x.append(rows[held][:room].to(self.holdout_dtype))
            self.held_y.append(labels[held][:room])

    def compute(self) -> dict[str, Tensor]:
        key = f"{self.name}_acc" if self.task == "classification" else f"{self.name}_r2"
        held_x = _cat(self.held_x)
        if self.gram.numel() == 0 or held_x.numel() == 0:
            warnings.warn(f"{type(self).__name__}: no training or held-out samples", stacklevel=2)
            return {key: torch.tensor(math.nan, dtype=torch.float64)}
        dim = self.gram.shape[0] - 1
        penalty = self.ridge * self.gram.diagonal()[:dim].mean().clamp_min(1e-12)
        regulariser = torch.diag(torch.cat([penalty.expand(dim), penalty.new_zeros(1)]))
        weights = torch.linalg.lstsq(self.gram + regulariser, self.cross).solution
        x = torch.cat([held_x.double(), held_x.new_ones(held_x.shape[0], 1).double()], dim=1)
        predicted = x @ weights
        labels = _cat(self.held_y)
        if self.task == "classification":
            return {key: (predicted.argmax(dim=1) == labels.long().reshape(-1)).double().mean()}
        truth = labels.double().reshape(labels.shape[0], -1)
        residual = ((truth - predicted) ** 2).sum()
        total = ((truth - truth.mean(dim=0)) ** 2).sum()
        return {key: 1 - residual / total}


def _cat(state: Tensor | list[Tensor]) -> Tensor:
    """A list state before sync, a tensor after: one tensor either way."""
    if isinstance(state, Tensor):
        return state
    return torch.cat(state) if state else torch.zeros(0)


class LayerCKA(Metric):
    """Linear CKA between every pair of captured tensors, exact from streamed statistics.

    Features are pooled per sample (see :func:`pool_features`); for every pair of
    tensors with one row per sample, ``CKA(X, Y) = ||X_c^T Y_c||_F^2 / (||X_c^T X_c||_F
    ||Y_c^T Y_c||_F)`` with ``X_c`` the centred features, computed from the running sums
    of ``Z^T Z`` and ``Z`` over the concatenated features ``Z = [X | Y | ...]``: memory is
    ``(sum of feature dims)^2`` float64 numbers. ``compute()`` returns ``cka/{a}~{b}``.

    Example:
        >>> cka = LayerCKA()
        >>> x = torch.randn(50, 4)
        >>> cka.update({"a": x, "b": 3 * x @ torch.linalg.qr(torch.randn(4, 4))[0]})
        >>> round(float(cka.compute()["cka/a~b"]), 6)
        1.0
    """

    per_tensor: ClassVar[bool] = False
    full_state_update: bool = False
    is_differentiable: bool = False
    gram: Tensor
    sums: Tensor
    count: Tensor
    pending: list[Tensor]

    def __init__(self, pool: str = "mean", fold_rows: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_pool(pool)
        self.pool = pool
        self.fold_rows = fold_rows
        self.layout: dict[str, slice] = {}
        self.add_state("gram", torch.zeros(0, 0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sums", torch.zeros(0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        # rows not yet folded into the gram (fewer than fold_rows a process): one large
        # matrix product instead of one a batch; synced like the rest
        self.add_state("pending", [], dist_reduce_fx="cat")

    def update(self, features: dict[str, Tensor], batch: Any = None, indices: Any = None) -> None:
        samples = len(indices) if indices is not None else _most_common_rows(features)
        pooled = {
            key: pool_features(tensor.detach(), self.pool).to(torch.float64)
            for key, tensor in sorted(features.items())
            if tensor.dim() > 0 and tensor.shape[0] == samples
        }
        if not self.layout:
            start = 0
            for key, rows in pooled.items():
                self.layout[key] = slice(start, start + rows.shape[1])
                start += rows.shape[1]
        if list(pooled) != list(self.layout):
            raise ValueError(
                f"LayerCKA saw tensors {list(pooled)} after {list(self.layout)}; every batch "
                "must capture the same tensors"
            )
        rows = torch.cat(list(pooled.values()), dim=1)
        if self.gram.numel() == 0:  # the same shapes on every process, for the sync
            self.gram = rows.new_zeros(rows.shape[1], rows.shape[1])
            self.sums = rows.new_zeros(rows.shape[1])
        self.pending.append(rows)
        if sum(part.shape[0] for part in self.pending) >= self.fold_rows:
            self.gram, self.sums, self.count = self._folded()
            self.pending = []

    def _folded(self) -> tuple[Tensor, Tensor, Tensor]:
        """The gram, sums and count with the pending rows folded in."""
        z = _cat(self.pending).to(torch.float64)
        if z.numel() == 0:
            return self.gram, self.sums, self.count
        return self.gram + z.T @ z, self.sums + z.sum(dim=0), self.count + z.shape[0]

    def compute(self) -> dict[str, Tensor]:
        gram, sums, count = self._folded()
        centred = gram - torch.outer(sums, sums) / count
        keys = list(self.layout)
        norms = {key: centred[self.layout[key], self.layout[key]].norm() for key in keys}
        result = {}
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                cross = centred[self.layout[a], self.layout[b]].norm() ** 2
                result[f"cka/{a}~{b}"] = cross / (norms[a] * norms[b])
        return result


def _most_common_rows(features: dict[str, Tensor]) -> int:
    counts: dict[int, int] = {}
    for tensor in features.values():
        if tensor.dim() > 0:
            counts[tensor.shape[0]] = counts.get(tensor.shape[0], 0) + 1
    return max(counts, key=counts.__getitem__)
