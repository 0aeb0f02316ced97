"""What every probe shares: which captured values it uses, pooling, padding rows, and
the metric base class that agrees on data-dependent state shapes across processes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric

POOLS = ("mean", "last", "flatten")
"""How a probe makes one vector per sample of a ``[batch, seq, ...]`` tensor."""


def usable(value: Any, samples: int | None) -> bool:
    """Whether probes use ``value``: a floating tensor whose first dim is the ``samples``.

    ``samples`` is the batch's number of samples; ``None`` (unknown) accepts every
    floating tensor with at least one dimension.

    Examples:
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

    Examples:
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


def _most_common_rows(features: Mapping[str, Tensor]) -> int | None:
    """The most common first dimension of the usable tensors (the first seen on a tie)."""
    counts = Counter(tensor.shape[0] for tensor in features.values() if usable(tensor, None))
    return counts.most_common(1)[0][0] if counts else None


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


def _cat(state: Tensor | list[Tensor]) -> Tensor:
    """A list state before sync, a tensor after: one tensor either way."""
    if isinstance(state, Tensor):
        return state
    return torch.cat(state) if state else torch.zeros(0)
