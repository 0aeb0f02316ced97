"""The dataset index of every sample of a batch, where Lightning knows or can rebuild it.

This is the one module that reads Lightning's private internals (the loops' combined
loaders, ``_IndexBatchSamplerWrapper.seen_batch_indices``); ``tests/lightning/test_indices.py``
fails loudly when a Lightning release moves them. Lightning's public route to the
indices, ``trainer.predict_loop.current_batch_indices``, is filled only for callbacks
that are ``BasePredictionWriter``s, and validation and test have none.

In predict, Lightning records the indices it draws (``_IndexBatchSamplerWrapper``). In
validation and test it does not; there they are rebuilt by walking a second iterator over
the loader's batch sampler, which is only sound when the sampler is deterministic: a
``SequentialSampler``, or the unshuffled ``DistributedSampler`` Lightning injects under DDP.

Which samples are padding comes from the same samplers. A ``DistributedSampler`` with
``drop_last=False`` (Lightning's choice for validation and test under DDP) pads its index
list by repeating its first indices until every process gets ``ceil(N / W)`` samples: the
``k``-th sample of process ``r`` is position ``r + k * W`` of the padded list, padding when
that position is ``>= N``. In predict Lightning uses an ``UnrepeatedDistributedSampler``,
which never pads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, TypeGuard

import lightning.pytorch as pl
from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSampler,
    _IndexBatchSamplerWrapper,
)
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

__all__ = ["BatchIndexer", "item_repeated", "lightning_logs_now", "missing_indices_reason"]


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


def missing_indices_reason(trainer: pl.Trainer, stage: str) -> str | None:
    """Why some dataloader of ``stage``'s loop will give no dataset indices, or ``None``.

    Call it when the loop starts (its dataloaders are set up then).
    """
    loop_loaders: list[Any] = []  # none outside a running loop: nothing to say then
    while (loader := _loader(trainer, stage, len(loop_loaders))) is not None:
        loop_loaders.append(loader)
    for dataloader_idx, loader in enumerate(loop_loaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        if isinstance(batch_sampler, _IndexBatchSamplerWrapper) or _is_deterministic(batch_sampler):
            continue
        what = type(getattr(loader, "dataset", loader)).__name__
        return (
            f"the {stage} dataloader {dataloader_idx} ({type(loader).__name__} over {what}) "
            "gives no dataset indices: its batches come from an IterableDataset, a "
            "shuffling sampler, or a batch sampler Lightning cannot wrap. Use a map-style "
            "Dataset in a DataLoader with `batch_size=` (or a batch sampler Lightning can "
            "re-create), or, to keep captures without indices, use `keep_in_memory=True` "
            "or a sink of your own"
        )
    return None


def _is_deterministic(batch_sampler: Any) -> TypeGuard[BatchSampler]:
    if not isinstance(batch_sampler, BatchSampler):
        return False
    sampler = batch_sampler.sampler
    return isinstance(sampler, SequentialSampler) or (
        type(sampler) is DistributedSampler and not sampler.shuffle
    )


class _Padding:
    """Which positions of a sampler's output repeat a sample drawn elsewhere."""

    def __init__(self, sampler: Any) -> None:
        self.known = isinstance(sampler, (SequentialSampler, UnrepeatedDistributedSampler))
        self.offset, self.step, self.first_padded = 0, 1, -1  # -1: no padding
        if type(sampler) is DistributedSampler and isinstance(sampler.dataset, Sized):
            self.known = True
            if not sampler.drop_last:
                self.offset, self.step = sampler.rank, sampler.num_replicas
                self.first_padded = len(sampler.dataset)

    def of(self, start: int, size: int) -> tuple[bool, ...] | None:
        """For the samples at positions ``start .. start + size - 1`` of the sampler's output."""
        if not self.known:
            return None
        if self.first_padded < 0:
            return (False,) * size
        return tuple(
            self.offset + (start + k) * self.step >= self.first_padded for k in range(size)
        )


def _padding_by_place(batch_sampler: Any, batch_idx: int) -> tuple[bool, ...] | None:
    """Which samples of batch ``batch_idx`` are padding, from their places alone, where the
    indices cannot be known (a shuffling ``DistributedSampler`` pads by place, whatever the
    order): every batch of a ``BatchSampler`` but the last is full."""
    if not isinstance(batch_sampler, BatchSampler) or not isinstance(batch_sampler.sampler, Sized):
        return None
    padding = _Padding(batch_sampler.sampler)
    start = batch_idx * batch_sampler.batch_size
    size = min(batch_sampler.batch_size, len(batch_sampler.sampler) - start)
    return padding.of(start, size) if size > 0 else None


class BatchIndexer:
    """Answers "which dataset indices are in batch ``batch_idx``?" during one loop.

    Batches must be asked for in increasing ``batch_idx`` order, as loops produce them.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._walkers: dict[int, _Walker | None] = {}
        self._starts: dict[int, list[int]] = {}  # predict: sampler position of each batch
        self._repeated: dict[int, tuple[int, tuple[bool, ...] | None]] = {}

    def __call__(
        self, trainer: pl.Trainer, batch_idx: int, dataloader_idx: int
    ) -> tuple[int, ...] | None:
        self._repeated.pop(dataloader_idx, None)
        loader = _loader(trainer, self.stage, dataloader_idx)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
            return self._recorded(batch_sampler, batch_idx, dataloader_idx)
        if dataloader_idx not in self._walkers:
            walker = _Walker(batch_sampler) if _is_deterministic(batch_sampler) else None
            self._walkers[dataloader_idx] = walker
        walker = self._walkers[dataloader_idx]
        if walker is None:
            self._repeated[dataloader_idx] = (
                batch_idx,
                _padding_by_place(batch_sampler, batch_idx),
            )
            return None
        found = walker.batch(batch_idx)
        if found is not None:
            start, indices = found
            self._repeated[dataloader_idx] = (batch_idx, walker.padding.of(start, len(indices)))
            return indices
        return None

    def _recorded(
        self, batch_sampler: _IndexBatchSamplerWrapper, batch_idx: int, dataloader_idx: int
    ) -> tuple[int, ...] | None:
        seen = batch_sampler.seen_batch_indices
        if batch_idx >= len(seen):
            return None
        starts = self._starts.setdefault(dataloader_idx, [0])
        while len(starts) <= batch_idx:
            starts.append(starts[-1] + len(seen[len(starts) - 1]))
        padding = _Padding(getattr(batch_sampler, "sampler", None))
        indices = tuple(seen[batch_idx])
        self._repeated[dataloader_idx] = (batch_idx, padding.of(starts[batch_idx], len(indices)))
        return indices

    def repeated(self, batch_idx: int, dataloader_idx: int) -> tuple[bool, ...] | None:
        """For the batch last asked for: which samples repeat one seen elsewhere (padding).

        ``None`` where unknown. Called right after :meth:`__call__` for the same batch.
        """
        last = self._repeated.get(dataloader_idx)
        return last[1] if last is not None and last[0] == batch_idx else None


class _Walker:
    """A second pass over a deterministic batch sampler, in step with the loop's own."""

    def __init__(self, batch_sampler: BatchSampler) -> None:
        self._batches: Iterator[list[int]] = iter(batch_sampler)
        self._next = 0
        self._position = 0  # sampler position of the next batch's first sample
        self.padding = _Padding(batch_sampler.sampler)

    def batch(self, batch_idx: int) -> tuple[int, tuple[int, ...]] | None:
        """The sampler position of the batch's first sample, and its indices."""
        if batch_idx < self._next:
            return None
        found: list[int] | None = None
        start = self._position
        while self._next <= batch_idx:
            found = next(self._batches, None)
            self._next += 1
            start = self._position
            self._position += len(found) if found is not None else 0
        return (start, tuple(found)) if found is not None else None


def item_repeated(trainer: pl.Trainer, stage: str, batch_idx: int, dataloader_idx: int) -> bool:
    """Whether item ``batch_idx`` of a loader without batching (``batch_size=None``: each
    item is a whole batch) repeats one another process reads (a ``DistributedSampler``'s
    padding); ``False`` for a loader that batches (see :class:`BatchIndexer`)."""
    loader = _loader(trainer, stage, dataloader_idx)
    if loader is None or getattr(loader, "batch_sampler", None) is not None:
        return False
    found = _Padding(getattr(loader, "sampler", None)).of(batch_idx, 1)
    return bool(found and found[0])


def lightning_logs_now(trainer: pl.Trainer) -> bool:
    """Whether Lightning sends this training step's logged values to the loggers (its
    ``log_every_n_steps`` counted in the batches that stepped, as its logger connector)."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
