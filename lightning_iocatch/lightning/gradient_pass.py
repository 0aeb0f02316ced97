"""The gradient pass of :class:`~lightning_iocatch.lightning.callback.IOCaptureCallback`.

Lightning's validation, test and predict loops run under ``inference_mode``, where no
gradient can be recorded. A callback whose spec asks for gradients (``grad_outputs[...]``,
``grad_inputs[...]``) therefore leaves the step's own forward untouched (its session is
not open then) and runs one pass of its own at the batch's end:

1. the batch as the loader gave it (cloned at the batch's start, outside inference mode,
   before the step can write into it);
2. ``forward(pl_module, batch)`` in the loop's precision (the precision plugin's step
   context: autocast under ``bf16-mixed``) and under
   :func:`~lightning_iocatch.capture.gradients.recording_gradients`, with the session open
   apart from every other session on the model (another callback's session neither
   captures nor edits this pass, and this pass adds no call to its buffer);
3. the loss: the sum over the batch of each sample's loss (``loss(output(out), batch)``
   returns per-sample losses, or per-sample ``(sums, counts)`` as
   :func:`~lightning_iocatch.lightning.effect_terms.next_token_loss` does), so each
   sample's gradient is its own whatever the batch size or the number of processes;
4. ``torch.autograd.grad(total, session.gradient_edges())``: no parameter's ``.grad``
   or ``requires_grad`` changes; then ``session.take()``, the batch's captures (the spec's
   activations and gradients of this one forward), handed to the sinks as ever. A loss
   whose backward reaches none of the sites (computed around them) is refused, naming
   ``loss=``: its gradients would be nothing.

The loss, forward and output functions mean what they mean for
:class:`~lightning_iocatch.lightning.effects.InterventionEffects`, with the same defaults.

Examples:
    >>> gradients = GradientPass()
    >>> gradients.loss.__name__, gradients.forward.__name__, gradients.output.__name__
    ('next_token_loss', 'default_forward', 'default_output')
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.gradients import recording_gradients
from lightning_iocatch.capture.session import CaptureSession
from lightning_iocatch.capture.snapshots import map_tensors
from lightning_iocatch.lightning.effect_terms import (
    LossFn,
    call_forward,
    default_forward,
    default_output,
    loss_sums,
    next_token_loss,
)

__all__ = ["ForwardFn", "GradientPass", "LossFn", "OutputFn", "step_context"]

ForwardFn = Callable[[pl.LightningModule, Any], Any]
OutputFn = Callable[[Any], torch.Tensor]


class GradientPass:
    """One batch's forward and backward for the gradients a session asks for.

    Args:
        loss: ``loss(logits, batch)`` -> per-sample losses, or per-sample ``(sums,
            counts)``; default :func:`~lightning_iocatch.lightning.effect_terms.next_token_loss`.
        forward: ``forward(pl_module, batch)`` runs the model; default
            :func:`~lightning_iocatch.lightning.effect_terms.default_forward`.
        output: the logits of what ``forward`` returns; default
            :func:`~lightning_iocatch.lightning.effect_terms.default_output`.
    """

    def __init__(
        self,
        loss: LossFn | None = None,
        forward: ForwardFn | None = None,
        output: OutputFn | None = None,
    ) -> None:
        self.loss: LossFn = loss or next_token_loss
        self.forward: ForwardFn = forward or default_forward
        self.output: OutputFn = output or default_output
        self._given: Any = None

    def keep(self, batch: Any) -> None:
        """Keep the batch as the loader gave it, as tensors that can be saved for backward
        (a clone made outside inference mode), before the step may write into it."""
        with torch.inference_mode(False):
            self._given = map_tensors(batch, torch.clone)

    def run(
        self,
        session: CaptureSession,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        stage: str,
        indices: tuple[int, ...] | None,
    ) -> CaptureBuffer:
        """The batch's captures: ``session`` open, apart from other sessions on the model,
        around one forward in ``stage``'s step context and the backward of the summed loss."""
        batch, self._given = self._given, None
        if batch is None:
            raise RuntimeError("GradientPass.run without a batch kept at the batch's start")
        context = step_context(trainer, stage)
        with session.catcher.coordinator.apart(pl_module):
            session.open()
            try:
                if session.edits:  # after open(), which resets the batch's edits
                    session.set_batch_indices(indices)
                with recording_gradients():
                    with context():
                        out = self._forward(pl_module, batch)
                    total = self._total(self.output(out), batch)
                    edges = session.gradient_edges()
                    if edges and not _reaches(total, edges):  # else: the hooks have them
                        raise ValueError(
                            "the loss does not depend on the values whose gradients "
                            f"{session.grad_outputs + session.grad_inputs} are asked for "
                            "(its backward, which IOCaptureCallback ran, reached none of "
                            "them): give a `loss=` computed from the forward's output"
                        )
                    del out  # the logits go before the captures are copied
                return session.take()
            except BaseException:
                session.discard_gradients()  # the error says why: not "no backward reached"
                raise
            finally:
                session.close()  # a second close does nothing

    def _forward(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        return call_forward(self.forward, pl_module, batch, "IOCaptureCallback")

    def _total(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        """The sum over the batch of each sample's loss (of its terms' sum)."""
        sums = loss_sums(self.loss(logits, batch))
        if not isinstance(sums, torch.Tensor) or sums.dim() != 1:
            shape = tuple(sums.shape) if isinstance(sums, torch.Tensor) else type(sums).__name__
            raise ValueError(
                f"IOCaptureCallback's `loss` returned {shape}: it must return one loss per "
                "sample (a tensor of shape (batch,)), or per-sample (sums, counts); the "
                "gradients are of their sum, so that each sample's gradient is its own"
            )
        return sums.sum()


def _reaches(total: torch.Tensor, edges: list[Any]) -> bool:
    """Run the backward of ``total`` to ``edges`` (the sites' hooks get their gradients);
    whether it reached any of them (a loss with a ``grad_fn`` may still go around them)."""
    if not total.requires_grad:
        return False
    found = torch.autograd.grad(total, edges, allow_unused=True)
    return any(grad is not None for grad in found)


def step_context(trainer: pl.Trainer, stage: str) -> Callable[[], AbstractContextManager[Any]]:
    """The precision plugin's context of ``stage``'s step (autocast under mixed precision)."""
    precision = trainer.strategy.precision_plugin
    contexts = {
        "validate": precision.val_step_context,
        "test": precision.test_step_context,
        "predict": precision.predict_step_context,
    }
    return contexts[stage]
