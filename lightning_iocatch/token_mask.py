"""Which tokens of a sequence batch are real: the one rule that token rows and probes share.

A batch of a language model holds ``(batch, seq)`` token positions, padding included. By
default the real tokens are those where the batch's ``attention_mask`` is non-zero (the
batch must be a mapping holding it); a ``mask(batch)`` function replaces that rule, and
:func:`kept_tokens` can also drop each sequence's first real token and tokens by id.
:class:`~lightning_iocatch.store.tokens.TokenRows` selects the rows a store keeps with it,
and :class:`~lightning_iocatch.lightning.probe_sink.ProbeSink` the tokens its probes count.
A tensor is subject to a ``(batch, seq)`` mask only where its first two dimensions are
the mask's (:func:`masks`). This base module imports neither the store nor the probes.

Examples:
    >>> batch = {"input_ids": torch.tensor([[1, 5, 6], [1, 7, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    >>> real_tokens(batch).tolist()
    [[True, True, True], [True, True, False]]
    >>> keep, ids, start = kept_tokens(batch, drop_first=True)
    >>> keep.tolist(), start.tolist()
    ([[False, True, True], [False, True, False]], [0, 0])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["checked_mask", "kept_tokens", "masks", "real_tokens", "token_coordinates"]

MaskFn = Callable[[Any], torch.Tensor]


def masks(tensor: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` applies to ``tensor``: its first two dimensions are the mask's."""
    return mask is not None and tensor.dim() >= 2 and tuple(tensor.shape[:2]) == tuple(mask.shape)


def checked_mask(value: Any, where: str, who: str = "TokenRows") -> torch.Tensor:
    """``value`` as a bool ``(batch, seq)`` mask (non-zero is true), or a ``ValueError``
    naming ``who`` and ``where`` it came from."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{who}: {where} must be a (batch, seq) tensor, got {shown}")
    if value.dtype != torch.bool:
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"{who}: {where} must be bool or integer, got {value.dtype}")
        value = value != 0
    return value


def real_tokens(batch: Any, who: str = "TokenRows") -> torch.Tensor | None:
    """The default rule: ``batch["attention_mask"] != 0`` where the batch is a mapping
    holding ``attention_mask``; ``None`` (no mask: every position is real) otherwise."""
    if not isinstance(batch, Mapping) or "attention_mask" not in batch:
        return None
    return checked_mask(batch["attention_mask"], "batch['attention_mask']", who)


def kept_tokens(
    batch: Any,
    *,
    mask: MaskFn | None = None,
    token_ids: MaskFn | None = None,
    drop_first: bool = False,
    drop_token_ids: tuple[int, ...] = (),
    padding: MaskFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The tokens of ``batch`` to keep, their ids and where each sequence starts.

    Returns ``(keep, ids, start)``: the bool ``(batch, seq)`` mask on the batch's device,
    the token ids (``None`` where unknown and not needed) and per sample the column of its
    first real token (0 without a padding mask). The arguments are those of
    :class:`~lightning_iocatch.store.tokens.TokenRows`; ``mask`` is required where the
    batch has no ``attention_mask``.

    Raises:
        ValueError: the batch has no mask or token ids where they are needed, or they are
            not ``(batch, seq)`` tensors of one shape.
    """
    keep = _mask(batch, mask)
    ids = _token_ids(batch, token_ids, needed=bool(drop_token_ids))
    if ids is not None and tuple(ids.shape) != tuple(keep.shape):
        raise ValueError(
            f"TokenRows: the token ids have shape {tuple(ids.shape)}, the mask "
            f"{tuple(keep.shape)}; they must be the same (batch, seq)"
        )
    ids = None if ids is None else ids.to(keep.device)
    start = _first_real_token(batch, keep, padding, drop_first)
    keep = keep.clone()
    if drop_first and keep.shape[1]:
        keep &= torch.arange(keep.shape[1], device=keep.device)[None] != start[:, None]
    if ids is not None and drop_token_ids:
        keep &= ~torch.isin(ids, torch.tensor(drop_token_ids, device=ids.device))
    return keep, ids, start


def token_coordinates(
    batch: Any,
    mask: torch.Tensor,
    *,
    padding: MaskFn | None = None,
    token_ids: MaskFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's position in its sequence and its id, as token rows record them.

    Returns ``(positions, ids)``, both ``(batch, seq)`` int64 on the mask's device: the
    column minus the sequence's first real column (where the padding mask, ``padding(batch)``
    or the batch's ``attention_mask``, is first 1; column 0 without one), and the token ids
    (``token_ids(batch)`` or the batch's ``input_ids``; ``None`` where it has none).

    Examples:
        >>> batch = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])}
        >>> positions, ids = token_coordinates(batch, batch["attention_mask"] != 0)
        >>> positions.tolist(), ids.tolist()
        ([[-1, 0, 1]], [[0, 5, 6]])
    """  # noqa: E501
    start = _first_real_token(batch, mask, padding, drop_first=False)
    columns = torch.arange(mask.shape[1], device=mask.device)
    positions = columns[None, :] - start[:, None]
    ids = _token_ids(batch, token_ids, needed=False)
    if ids is not None and tuple(ids.shape) != tuple(mask.shape):
        raise ValueError(
            f"the token ids have shape {tuple(ids.shape)}, the mask of real tokens "
            f"{tuple(mask.shape)}; they must be the same (batch, seq)"
        )
    return positions, None if ids is None else ids.to(mask.device, torch.int64)


def _mask(batch: Any, mask: MaskFn | None) -> torch.Tensor:
    if mask is not None:
        return checked_mask(mask(batch), "`mask(batch)`")
    found = real_tokens(batch)
    if found is None:
        raise ValueError(
            "TokenRows selects tokens by the batch's 'attention_mask', but the batch is "
            f"a {type(batch).__name__} without one; pass `mask=` a function of the batch, "
            "e.g. TokenRows(mask=lambda batch: batch[1] == 1), or "
            "mask=lambda batch: torch.ones_like(batch['input_ids'], dtype=torch.bool) "
            "to keep every token"
        )
    return found


def _token_ids(batch: Any, token_ids: MaskFn | None, *, needed: bool) -> torch.Tensor | None:
    if token_ids is not None:
        ids = token_ids(batch)
    elif isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
    elif needed:
        raise ValueError(
            "TokenRows(drop_token_ids=...) needs the token ids: the batch has no "
            "'input_ids'; pass `token_ids=` a function of the batch"
        )
    else:
        return None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        raise ValueError(
            f"TokenRows: the token ids must be a (batch, seq) integer tensor, got {ids!r:.80}"
        )
    return ids


def _first_real_token(
    batch: Any, mask: torch.Tensor, padding_fn: MaskFn | None, drop_first: bool
) -> torch.Tensor:
    """Per sample, the column of its first real token (where the padding mask is first
    1); 0 without a padding mask, which ``drop_first`` refuses."""
    zeros = torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    padding: Any
    if padding_fn is not None:
        padding, where = padding_fn(batch), "`padding(batch)`"
    else:
        padding = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        where = "batch['attention_mask']"
        if not isinstance(padding, torch.Tensor) or padding.shape != mask.shape:
            padding = None
    if padding is None:
        if drop_first:
            raise ValueError(
                "TokenRows(drop_first=True) drops each sequence's first real token, but "
                f"the batch is a {type(batch).__name__} without an 'attention_mask' that "
                "says where its sequences start: pass `padding=` a function of the batch "
                "giving 1 for real tokens and 0 for padding, e.g. "
                "TokenRows(..., padding=lambda batch: batch[1])"
            )
        return zeros
    if not isinstance(padding, torch.Tensor) or padding.shape != mask.shape:
        shown = tuple(padding.shape) if isinstance(padding, torch.Tensor) else padding
        raise ValueError(
            f"TokenRows: {where} must be a tensor of the mask's shape {tuple(mask.shape)}, "
            f"got {shown!r:.80}"
        )
    if not mask.shape[1]:
        return zeros
    return (padding.to(mask.device) != 0).int().argmax(1)
