"""The dataset index of every sample of a batch, where Lightning knows or can rebuild it.

In predict, Lightning records the indices it draws (``_IndexBatchSamplerWrapper``). In
validation and test it does not; there they are rebuilt by walking a second iterator over
the loader's batch sampler, which is only sound when the sampler is deterministic: a
``SequentialSampler``, or the unshuffled ``DistributedSampler`` Lightning injects under DDP.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeGuard

import lightning.pytorch as pl
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

__all__ = ["BatchIndexer"]


def _loader(trainer: pl.Trainer, stage: str, dataloader_idx: int) -> Any:
    if stage == "validate":
        fitting = trainer.state.fn == TrainerFn.FITTING
        loop: Any = trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop
    else:
        loop = trainer.predict_loop if stage == "predict" else trainer.test_loop
    combined = getattr(loop, "_combined_loader", None)
    if combined is None or dataloader_idx >= len(combined.flattened):
        return None
    return combined.flattened[dataloader_idx]


def _is_deterministic(batch_sampler: Any) -> TypeGuard[BatchSampler]:
    if not isinstance(batch_sampler, BatchSampler):
        return False
    sampler = batch_sampler.sampler
    return isinstance(sampler, SequentialSampler) or (
        type(sampler) is DistributedSampler and not sampler.shuffle
    )


class BatchIndexer:
    """Answers "which dataset indices are in batch ``batch_idx``?" during one loop.

    Batches must be asked for in increasing ``batch_idx`` order, as loops produce them.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._walkers: dict[int, _Walker | None] = {}

    def __call__(
        self, trainer: pl.Trainer, batch_idx: int, dataloader_idx: int
    ) -> tuple[int, ...] | None:
        loader = _loader(trainer, self.stage, dataloader_idx)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
            seen = batch_sampler.seen_batch_indices
            return tuple(seen[batch_idx]) if batch_idx < len(seen) else None
        if dataloader_idx not in self._walkers:
            walker = _Walker(batch_sampler) if _is_deterministic(batch_sampler) else None
            self._walkers[dataloader_idx] = walker
        walker = self._walkers[dataloader_idx]
        return walker.batch(batch_idx) if walker is not None else None

    def repeated(self, batch_idx: int, dataloader_idx: int) -> tuple[bool, ...] | None:
        """For the batch last asked for: which samples repeat one seen elsewhere (padding).

        ``None`` where unknown. Called right after :meth:`__call__` for the same batch.
        """
        return None


class _Walker:
    """A second pass over a deterministic batch sampler, in step with the loop's own."""

    def __init__(self, batch_sampler: BatchSampler) -> None:
        self._batches: Iterator[list[int]] = iter(batch_sampler)
        self._next = 0

    def batch(self, batch_idx: int) -> tuple[int, ...] | None:
        if batch_idx < self._next:
            return None
        found: list[int] | None = None
        while self._next <= batch_idx:
            found = next(self._batches, None)
            self._next += 1
        return tuple(found) if found is not None else None
