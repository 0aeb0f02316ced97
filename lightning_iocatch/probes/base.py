"""What every probe shares: which captured values it uses, pooling, padding rows, and
the metric base class that agrees on data-dependent state shapes across processes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_iocatch.token_mask import masks


def masked_by(features: Tensor, tokens: Tensor | None) -> bool:
    """Whether a probe applies the real-token mask ``tokens`` to ``features``: a tensor of
    at least three dimensions whose first two are the mask's ``(batch, seq)``. A
    ``(batch, d)`` tensor is one vector per sample (a pooled output, a head's logits), as
    :func:`pool_features` reads it, even where ``d`` happens to equal ``seq``."""
    return features.dim() >= 3 and masks(features, tokens)


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


def pool_features(features: Tensor, pool: str, tokens: Tensor | None = None) -> Tensor:
    """One row per sample: ``(B, ...)`` to ``(B, D)``; sequences are pooled over dim 1.

    ``"mean"`` averages over every dimension between the first and the last, ``"last"``
    takes the last position of dim 1, ``"flatten"`` keeps everything. With a bool
    ``(B, seq)`` mask of real tokens ``tokens`` that applies (:func:`masked_by`: at least
    three dimensions, the first two the mask's), ``"mean"`` averages over each sample's
    real tokens only, ``"last"`` takes each sample's last real token (right or left padding alike) and
    ``"flatten"`` zeroes the padding positions; a sample without a real token gets NaN
    (probes leave such samples out before pooling).

    Examples:
        >>> pool_features(torch.ones(2, 5, 3), "mean").shape, pool_features(torch.ones(2, 5, 3), "flatten").shape
        (torch.Size([2, 3]), torch.Size([2, 15]))
        >>> x = torch.arange(6.0).reshape(2, 3, 1)
        >>> real = torch.tensor([[True, True, False], [False, True, True]])
        >>> pool_features(x, "mean", real).flatten().tolist(), pool_features(x, "last", real).flatten().tolist()
        ([0.5, 4.5], [1.0, 5.0])
    """  # noqa: E501
    if masked_by(features, tokens):
        assert tokens is not None
        return _pool_real(features, pool, tokens.to(features.device))
    if features.dim() == 1:
        return features.unsqueeze(1)
    if features.dim() == 2 or pool == "flatten":
        return features.reshape(features.shape[0], -1)
    if pool == "mean":
        return features.mean(dim=tuple(range(1, features.dim() - 1)))
    return features[:, -1].reshape(features.shape[0], -1)


def _pool_real(features: Tensor, pool: str, tokens: Tensor) -> Tensor:
    """:func:`pool_features` of a ``(B, seq, ...)`` tensor over the real tokens only."""
    samples, seq = tokens.shape
    trailing = (1,) * (features.dim() - 2)
    real = tokens.view(samples, seq, *trailing)
    if pool == "flatten":
        return torch.where(real, features, 0).reshape(samples, -1)
    count = tokens.sum(1)
    if pool == "mean":
        inner = features
        if features.dim() > 3:
            inner = features.mean(dim=tuple(range(2, features.dim() - 1)))
        inner = inner if inner.dim() > 2 else inner.unsqueeze(-1)
        total = torch.where(tokens[:, :, None], inner, 0).sum(1)
        return total / count[:, None].to(total.dtype)  # 0 / 0: NaN
    order = torch.arange(seq, device=tokens.device)
    last = torch.where(tokens, order, -1).argmax(1)  # the last real position
    picked = features[torch.arange(samples, device=features.device), last]
    picked = picked.reshape(samples, -1)
    return torch.where((count == 0)[:, None], torch.nan, picked)


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


def _checked_tokens(tokens: Tensor | None, samples: int | None) -> Tensor | None:
    """``tokens`` as a bool ``(samples, seq)`` mask, or a ``ValueError`` naming the shape."""
    if tokens is None:
        return None
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        shown = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"`tokens` must be a (batch, seq) mask of real tokens, got {shown}")
    if samples is not None and tokens.shape[0] != samples:
        raise ValueError(
            f"`tokens` has {tokens.shape[0]} rows for a batch of {samples} samples: pass the "
            "batch's (batch, seq) mask of real tokens, e.g. batch['attention_mask']"
        )
    return tokens if tokens.dtype == torch.bool else tokens != 0


def _kept(
    repeated: Sequence[bool] | None,
    samples: int,
    device: torch.device,
    tokens: Tensor | None = None,
) -> Tensor | None:
    """The mask of rows that count: not padding, and with a real token where ``tokens``
    is given; ``None`` when every row is kept."""
    keep = None
    if repeated is not None and any(repeated):
        if len(repeated) != samples:
            raise ValueError(f"`repeated` has {len(repeated)} flags for {samples} samples")
        keep = ~torch.tensor(list(repeated), dtype=torch.bool, device=device)
    if tokens is not None and tokens.shape[0] == samples:
        some = tokens.any(1).to(device)
        if not bool(some.all()):
            keep = some if keep is None else keep & some
    return keep


def _rows(
    features: Any, indices: Any, repeated: Any, tokens: Tensor | None = None
) -> tuple[Tensor, Tensor | None] | None:
    """The usable ``features`` without the rows left out (padding, and samples without a
    real token where ``tokens`` is given), detached, with the rows of ``tokens`` where it
    applies to them (else ``None``); ``None`` when the features are not usable."""
    if not usable(features, _samples(indices, repeated)):
        return None
    values = features.detach()
    tokens = _checked_tokens(tokens, values.shape[0])
    tokens = None if tokens is None else tokens.to(values.device)
    keep = _kept(repeated, values.shape[0], values.device, tokens)
    applied = tokens if masked_by(values, tokens) else None
    if keep is None:
        return values, applied
    return values[keep], None if applied is None else applied[keep]


def _gather_objects(value: Any, group: Any = None) -> list[Any]:
    """``value`` of every process of ``group`` (all processes when ``None``), in rank order."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, value, group=group)
    return gathered


def _gather_tensors(tensor: Tensor, group: Any = None) -> Tensor:
    """``tensor`` of every process of ``group`` (all processes when ``None``), stacked in
    rank order; no gradient flows back. Lightning's ``strategy.all_gather`` does the same
    through the deprecated ``torch.distributed.nn.functional.all_gather`` (a FutureWarning)
    whatever its ``sync_grads``; this calls ``torch.distributed.all_gather`` itself."""
    tensor = tensor.detach().contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, tensor, group=group)
    return torch.stack(gathered)


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
