"""The per-batch work of :class:`~lightning_iocatch.lightning.callback.IOCaptureCallback`.

At a batch's start: its dataset indices looked up once (for its end too), in predict the
decision to skip a batch every sink has and the batch's token selection, and the edits
given the indices. At its end: the batch's captures taken (or computed by the gradient
pass) and handed to every sink as a :class:`~lightning_iocatch.lightning.sinks.BatchCaptures`.

:class:`BatchSteps` is a base of the callback and works on the callback's own state (the
loop's session and stage, its sinks), which the callback's hooks open and close; a
subclass may change a step (``_decide_skip``) as it could when the steps were the
callback's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_iocatch.capture.catcher import CaptureSession
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.store_patch import refuse_left_padding
from lightning_iocatch.lightning.batch_indices import BatchIndexer
from lightning_iocatch.lightning.gradient_pass import GradientPass
from lightning_iocatch.lightning.sinks import BatchCaptures, CaptureSink
from lightning_iocatch.store.tokens import TokenRows, TokenSelection

__all__ = ["BatchSteps", "LookedUp"]

LookedUp = tuple[int, int, tuple[int, ...] | None, tuple[bool, ...] | None]
"""(batch_idx, dataloader_idx, dataset indices, which repeat a sample) of the current batch."""


class BatchSteps:
    """A batch's start and end, on the state of the callback that has this base."""

    edits: list[Edit]
    _sinks: list[CaptureSink]
    _gradients: GradientPass | None
    _token_rows: TokenRows | None
    _session: CaptureSession | None
    _stage: str | None
    _indexer: BatchIndexer | None
    _looked_up: LookedUp | None
    _skip_step: bool
    _forwards_gather: bool

    def _batch_start(
        self, stage: str, trainer: pl.Trainer, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        """Look the batch's dataset indices up, once (a BatchIndexer walks the sampler in
        step with the loop: asked twice for a batch, it finds nothing the second time), for
        the batch's end too; in predict, decide whether to skip the batch and select its
        tokens; then give the edits the indices (a StorePatch reads the batch's rows)."""
        self._skip_step, self._looked_up = False, None
        if self._session is None or self._indexer is None or self._stage != stage:
            return
        indices = self._indexer(trainer, batch_idx, dataloader_idx)
        repeated = self._indexer.repeated(batch_idx, dataloader_idx)
        self._looked_up = (batch_idx, dataloader_idx, indices, repeated)
        if stage == "predict":
            self._decide_skip(trainer, dataloader_idx, indices)
            self._select_tokens(batch)
        if self.edits:
            refuse_left_padding(self.edits, batch)
            if self._gradients is None:  # else set in the pass, once its session is open
                self._session.set_batch_indices(indices)
        if self._gradients is not None and not self._skip_step:
            self._gradients.keep(batch)

    def _decide_skip(
        self, trainer: pl.Trainer, dataloader_idx: int, indices: tuple[int, ...] | None
    ) -> None:
        """Skip a batch every sink has; where each forward gathers parameters from every
        process (FSDP, DeepSpeed), only a batch that every process skips, or the others
        would wait for it. (The processes of a tensor-parallel group see the same batches
        and decide alike.)"""
        self._skip_step = bool(self._sinks) and all(
            sink.skip_batch("predict", dataloader_idx, indices) for sink in self._sinks
        )
        if self._forwards_gather:
            self._skip_step = trainer.strategy.reduce_boolean_decision(self._skip_step, all=True)

    def _select_tokens(self, batch: Any) -> None:
        """Capture this predict batch through its token selection (a writer's ``tokens``),
        a transform the batch's buffer carries (captures between batches are dropped)."""
        if self._token_rows is None or self._session is None or self._stage != "predict":
            return
        selection = None if self._skip_step else self._token_rows.select(batch)
        self._session.take(transform=selection)

    def _batch_end(
        self,
        stage: str,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if self._session is None or self._stage != stage:
            return
        looked_up, self._looked_up = self._looked_up, None
        indices, repeated = None, None  # looked up at the batch's start, never twice
        if looked_up is not None and looked_up[:2] == (batch_idx, dataloader_idx):
            indices, repeated = looked_up[2:]
        if self._gradients is not None and not self._skip_step:
            captures = self._gradients.run(self._session, trainer, pl_module, stage, indices)
        else:
            captures = self._session.take()
        tokens = captures.transform  # what this batch was captured with
        if self._skip_step:
            return  # captured only because another callback needed the forward
        selection = tokens if isinstance(tokens, TokenSelection) else None
        record = BatchCaptures(
            stage, batch_idx, dataloader_idx, captures, indices, batch, repeated, selection
        )
        for sink in self._sinks:
            sink.on_batch(record)
