"""Token rows: one stored row per selected token of a sequence batch, or one per sample.

A language model's activations come as ``(batch, seq, ...)`` tensors, padding included.
:class:`TokenRows` says which tokens of a batch are kept: by default those where the
batch's ``attention_mask`` is 1 (or a ``mask(batch)`` function of your own), without the
first position (``drop_first``, the BOS token) and without tokens whose id is in
``drop_token_ids`` (special tokens). For each batch, :meth:`TokenRows.select` computes a
:class:`TokenSelection` on the batch's device: a capture transform
(:mod:`lightning_iocatch.capture.transform`) that the catcher applies to every captured
tensor whose first two dimensions are the batch's ``(batch, seq)``, *on the capture's
device, before the copy to the host*, so a GPU never copies padding:

- ``reduce=None``: ``(batch, seq, ...)`` becomes ``(tokens, ...)``, the selected tokens in
  (sample, position) order. Each row's coordinates are its sample's dataset index, its
  position in the sequence (:data:`~lightning_iocatch.store.names.POSITION_KEY`) and its
  token id (:data:`~lightning_iocatch.store.names.TOKEN_ID_KEY`, where the batch has
  ``input_ids`` or ``token_ids(batch)`` is given).
- ``reduce="mean" | "first" | "last"``: floating ``(batch, seq, ...)`` tensors become
  ``(batch, ...)``: the mean over the selected tokens, or the first or last selected token
  (with its position and token id as coordinates). Means are computed in float32 at
  least (float64 stays float64). A sample with no selected token gets NaN values and
  position and token id -1. Other tensors are kept as they are.

Tensors of other shapes (a pooled ``(batch, d)`` output, decoding steps of
``generate()`` with another sequence length, rotary tables ``(1, seq, d)`` in batches of
more than one sample) are not selected; the rule is the shape, so a rotary table in a
batch of one sample is. A sequence-first layout ``(seq, batch, ...)`` is not recognised.
The selection's own index tensors are moved here (once per batch, a few bytes per
token); captured values are copied by :mod:`lightning_iocatch.capture.snapshots` as ever.

In a plain loop (:class:`~lightning_iocatch.FeatureWriter` does this for you):

Examples:
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher
    >>> embed = nn.Embedding(10, 2)
    >>> batch = {"input_ids": torch.tensor([[1, 5, 6], [1, 7, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    >>> selection = TokenRows(drop_first=True).select(batch)
    >>> catcher = ModelIOCatcher(embed, "cpu")
    >>> with catcher(outputs=[""], transform=selection) as buf:
    ...     _ = embed(batch["input_ids"])
    >>> buf[""]["outputs"][0].shape, buf.transformed_keys()  # 3 tokens: (0, 1), (0, 2), (1, 1)
    (torch.Size([3, 2]), {'/outputs'})
    >>> selection.sample.tolist(), selection.position.tolist(), selection.token_id.tolist()
    ([0, 0, 1], [1, 2, 1], [5, 6, 7])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_iocatch.fingerprint import describe_function
from lightning_iocatch.token_mask import kept_tokens

__all__ = ["REDUCTIONS", "Reduce", "TokenRows", "TokenSelection"]

Reduce = Literal["mean", "first", "last"]
REDUCTIONS = ("mean", "first", "last")


def _function_name(fn: Callable[..., Any] | None, default: str) -> str | dict[str, Any]:
    """How a store records a selection function (a resume must give the same): ``default``
    for none given, else by what it computes (its code, closure values, a partial's
    arguments...: :func:`~lightning_iocatch.fingerprint.describe_function`)."""
    return default if fn is None else describe_function(fn)


@dataclass(frozen=True)
class TokenRows:
    """Which tokens of a sequence batch become rows (see the module docstring).

    Args:
        mask: ``mask(batch) -> (batch, seq)`` tensor, true for the tokens to keep; default:
            ``batch["attention_mask"]`` (the batch must then be a mapping holding it).
        token_ids: ``token_ids(batch) -> (batch, seq)`` integer tensor recorded with each
            row; default: ``batch["input_ids"]`` where the batch is a mapping holding it.
        drop_first: drop each sequence's first real token (BOS): the first where the
            padding mask is 1. Needs a padding mask: a batch without ``attention_mask``
            needs ``padding=``.
        drop_token_ids: drop tokens with these ids (special tokens); needs token ids.
        reduce: ``None`` for one row per token; ``"mean"``, ``"first"`` or ``"last"`` for
            one row per sample.
        padding: ``padding(batch) -> (batch, seq)`` tensor, 1 for real tokens and 0 for
            padding: where each sequence starts; default: ``batch["attention_mask"]``
            where the batch is a mapping holding it. Positions count from the first real
            token (left padding not counted); without a padding mask, from column 0.
    """

    mask: Callable[[Any], torch.Tensor] | None = None
    token_ids: Callable[[Any], torch.Tensor] | None = None
    drop_first: bool = False
    drop_token_ids: Iterable[int] = ()
    reduce: Reduce | None = None
    padding: Callable[[Any], torch.Tensor] | None = None
    _drop: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("mask", "token_ids", "padding"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"`{name}` must be a function of the batch, got {type(value).__name__}"
                )
        if not isinstance(self.drop_first, bool):
            raise TypeError(f"`drop_first` must be True or False, got {self.drop_first!r}")
        if isinstance(self.drop_token_ids, (str, bytes)) or not isinstance(
            self.drop_token_ids, Iterable
        ):
            raise TypeError(f"`drop_token_ids` must be a set of ints, got {self.drop_token_ids!r}")
        given = list(self.drop_token_ids)  # read once: it may be a generator
        try:
            if any(isinstance(i, bool) for i in given):
                raise TypeError
            drop = tuple(sorted({operator.index(i) for i in given}))
        except TypeError:
            raise TypeError(f"`drop_token_ids` must hold ints, got {given!r}") from None
        object.__setattr__(self, "_drop", drop)
        if self.reduce is not None and self.reduce not in REDUCTIONS:
            raise ValueError(f"`reduce` must be None or one of {REDUCTIONS}, got {self.reduce!r}")

    def settings(self) -> dict[str, Any]:
        """What a store records of this selection (a resume must use the same)."""
        settings = {
            "mask": _function_name(self.mask, "attention_mask"),
            "token_ids": _function_name(self.token_ids, "input_ids"),
            "drop_first": self.drop_first,
            "drop_token_ids": list(self._drop),
            "reduce": self.reduce,
        }
        if self.padding is not None:  # left out by default: stores written before it resume
            settings["padding"] = _function_name(self.padding, "attention_mask")
        return settings

    def select(self, batch: Any) -> TokenSelection:
        """The tokens of ``batch`` to keep, computed on the batch's device.

        Raises:
            ValueError: the batch has no mask or token ids where they are needed, or they
                are not ``(batch, seq)`` tensors of one shape.
        """
        keep, ids, start = self._kept(batch)
        return TokenSelection(keep, ids, self.reduce, start)

    def keep(self, batch: Any) -> torch.Tensor:
        """The bool ``(batch, seq)`` mask of the tokens of ``batch`` this selection keeps
        (what probes count with ``IOCaptureCallback(probe_tokens=TokenRows(...))``).

        Examples:
            >>> batch = {"attention_mask": torch.tensor([[1, 1, 0]])}
            >>> TokenRows(drop_first=True).keep(batch).tolist()
            [[False, True, False]]
        """
        return self._kept(batch)[0]

    def _kept(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return kept_tokens(
            batch,
            mask=self.mask,
            token_ids=self.token_ids,
            drop_first=self.drop_first,
            drop_token_ids=self._drop,
            padding=self.padding,
        )


class TokenSelection:
    """One batch's selected tokens: applied to captured tensors, with each row's coordinates.

    Attributes (on the CPU, one entry per row):
        sample: the row's position in the batch (``reduce=None``), or ``arange(batch)``.
        position: the token's position in its sequence, left padding not counted (``None``
            for ``reduce="mean"``; -1 for a sample without a selected token).
        token_id: the token's id (``None`` without token ids or for ``reduce="mean"``).
    """

    def __init__(
        self,
        keep: torch.Tensor,
        ids: torch.Tensor | None,
        reduce: Reduce | None,
        start: torch.Tensor | None = None,
    ) -> None:
        self.reduce = reduce
        self.shape = tuple(keep.shape)
        self._keep = keep
        self._on_device: dict[tuple[torch.device, str], torch.Tensor] = {}
        batch, seq = self.shape
        start = torch.zeros(batch, dtype=torch.int64) if start is None else start.cpu()
        self.position: torch.Tensor | None = None
        self.token_id: torch.Tensor | None = None
        if reduce is None:
            self._where = keep.flatten().nonzero().squeeze(1)  # one device sync per batch
            flat = self._where.cpu()
            self.sample = flat // seq if seq else flat
            self.position = flat % seq - start[self.sample] if seq else flat
            self.token_id = None if ids is None else ids.flatten()[self._where].cpu()
            return
        self.sample = torch.arange(batch)
        self._count = keep.sum(1)
        if reduce == "mean" or not seq:
            return
        order = torch.arange(seq, device=keep.device)
        scores = torch.where(keep, order if reduce == "last" else seq - order, -1)
        self._where = scores.argmax(1)
        empty = (self._count == 0).cpu()
        self.position = torch.where(empty, -1, self._where.cpu() - start)
        if ids is not None:
            picked = ids.gather(1, self._where[:, None]).squeeze(1).cpu()
            self.token_id = torch.where(empty, -1, picked)

    def __len__(self) -> int:
        """The number of rows each selected tensor gets."""
        return int(self.sample.numel())

    def capture(self, tensor: torch.Tensor, site: Any = None) -> torch.Tensor | None:
        """``tensor``'s selected rows (on its device), or ``None`` where it is not selected:
        the capture transform of :mod:`lightning_iocatch.capture.transform` (whatever the
        site)."""
        if tensor.dim() < 2 or tuple(tensor.shape[:2]) != self.shape:
            return None
        tensor = tensor.detach()
        if self.reduce is None:
            return tensor.flatten(0, 1).index_select(0, self._on(tensor.device, "_where"))
        if not tensor.is_floating_point():
            return None
        if not self.shape[1]:  # no token at all: every sample is empty
            return tensor.new_full((self.shape[0], *tensor.shape[2:]), torch.nan)
        keep = self._on(tensor.device, "_keep")
        count = self._on(tensor.device, "_count")
        trailing = (1,) * (tensor.dim() - 2)
        if self.reduce == "mean":
            wide = tensor.to(torch.promote_types(tensor.dtype, torch.float32))
            total = torch.where(keep.view(*self.shape, *trailing), wide, 0).sum(1)
            return total / count.view(-1, *trailing).to(total.dtype)  # 0 / 0: NaN
        where = self._on(tensor.device, "_where")
        index = where.view(-1, 1, *trailing).expand(-1, 1, *tensor.shape[2:])
        picked = tensor.gather(1, index).squeeze(1)
        return torch.where((count == 0).view(-1, *trailing), torch.nan, picked)

    def _on(self, device: torch.device, name: str) -> torch.Tensor:
        """This selection's tensor ``name`` (``_where``, ``_keep``, ``_count``) on ``device``,
        moved there once."""
        tensor: torch.Tensor = getattr(self, name)
        if tensor.device == device:
            return tensor
        if (device, name) not in self._on_device:
            self._on_device[(device, name)] = tensor.to(device)
        return self._on_device[(device, name)]
