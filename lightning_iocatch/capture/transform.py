"""The transform seam: the one place a session changes what it captures.

A :class:`CaptureTransform` is given explicitly to a session for the captures of one batch
(``catcher(..., transform=t)``, or ``session.take(transform=t)`` for the next batch); the
engine keeps no other per-batch state. In each capture hook every captured tensor goes
through it, on the tensor's own device, before the copy off the model: what it returns
is copied instead of the tensor (``None``: the tensor as it is). The batch's buffer
records which values the transform changed, by flat key
(:meth:`~lightning_iocatch.capture.buffer.CaptureBuffer.transformed_keys`), so that a
consumer knows which of its tensors have the transform's shape: no value is tagged by
identity.

Token selection (:class:`~lightning_iocatch.store.tokens.TokenSelection`: a sequence
tensor becomes the rows of its selected tokens) is such a transform; the capture engine
knows it only through this protocol.

Edits of the forward (:mod:`~lightning_iocatch.capture.edits`) are decided in the same
hooks, at the same place (a module, its inputs or outputs, a call): a session's edits give
the value the forward continues with, and its captures read that value, through the
batch's transform.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher
    >>> class FirstRow:
    ...     def capture(self, tensor, site):
    ...         return tensor[:1] if site.kind == "outputs" else None
    >>> net = nn.Sequential(nn.Linear(2, 3))
    >>> catcher = ModelIOCatcher(net, "cpu")
    >>> with catcher(outputs=["0"], transform=FirstRow()) as buf:
    ...     _ = net(torch.ones(4, 2))
    >>> buf["0"]["outputs"][0].shape, buf.transformed_keys()
    (torch.Size([1, 3]), {'0/outputs'})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

__all__ = ["CaptureTransform", "Kind", "Site"]

Kind = Literal["inputs", "outputs", "grad_inputs", "grad_outputs"]


@dataclass(frozen=True)
class Site:
    """Where a value is captured: a module's name (as the session resolved it), whether it
    is the module's inputs or outputs (or their gradients: ``grad_inputs``,
    ``grad_outputs``), and which call of the module in the forward."""

    module: str
    kind: Kind
    call: int


class CaptureTransform(Protocol):
    """A per-capture change, applied on the capture's device before the copy."""

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor | None:
        """What to copy instead of ``tensor`` (computed on its device, detached), or
        ``None`` to copy ``tensor`` as it is."""
        ...
