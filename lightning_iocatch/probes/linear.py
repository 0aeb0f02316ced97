"""LinearProbe: a ridge probe fitted from streamed statistics, scored on held-out samples."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_iocatch.probes.base import (
    _cat,
    _check_pool,
    _checked_tokens,
    _kept,
    _ProbeMetric,
    _samples,
    masked_by,
    pool_features,
    usable,
)

_MASK64 = (1 << 64) - 1


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
            most ``2 * max_holdout`` pooled held-out rows.
        holdout_dtype: dtype of the kept held-out features (``torch.float16`` halves them).
        ridge: L2 penalty, relative to the mean diagonal of ``X^T X``.
        name: prefix of the reported value.

    Takes floating tensors with a batch dimension (see :func:`usable`), without the rows
    flagged in ``repeated``. With ``tokens``, a bool ``(batch, seq)`` mask of real tokens,
    a tensor of at least three dimensions whose first two are the mask's is pooled over
    the real tokens only (``pool="last"``: each sample's last real token, under right or
    left padding); a sample without a real token is left out, as a ``repeated`` one is.
    The pooled width must stay the same: a tensor whose width changes between batches (or
    processes) reports NaN, with a warning.

    Examples:
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
        if isinstance(max_holdout, bool) or not isinstance(max_holdout, int) or max_holdout < 1:
            raise ValueError(f"`max_holdout` must be an int >= 1, got {max_holdout!r}")
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or ridge < 0:
            raise ValueError(f"`ridge` must be a number >= 0, got {ridge!r}")
        if not isinstance(holdout_dtype, torch.dtype) or not holdout_dtype.is_floating_point:
            raise ValueError(
                f"`holdout_dtype` must be a floating torch dtype, got {holdout_dtype!r}"
            )
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
        tokens: Tensor | None = None,
    ) -> None:
        if not usable(features, _samples(indices, repeated)):
            return
        samples = features.shape[0]
        real = _checked_tokens(tokens, samples)
        real = None if real is None else real.to(features.device)
        labels = torch.as_tensor(self.target(batch))
        if labels.dim() == 0 or labels.shape[0] != samples:
            raise ValueError(f"`target(batch)` gave {tuple(labels.shape)} for {samples} samples")
        if self.task == "classification" and (
            labels.dim() != 1 or not torch.equal(labels, labels.round())
        ):
            raise ValueError(
                f"classification needs `target(batch)` to give whole class ids of shape "
                f"({samples},), got shape {tuple(labels.shape)} (for one-hot targets pass "
                "`labels.argmax(dim=1)`)"
            )
        values = features.detach().to(torch.float64)  # before pooling: float16 sums overflow
        labels = self._labels(labels.to(features.device))
        keep = _kept(repeated, samples, features.device, real)
        real = real if masked_by(values, real) else None
        if keep is not None:
            values, labels = values[keep], labels[keep]
            real = None if real is None else real[keep]
            if indices is not None:
                indices = [i for i, kept in zip(indices, keep.tolist(), strict=True) if kept]
        if values.shape[0] == 0:
            return
        rows = pool_features(values, self.pool, real)
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
