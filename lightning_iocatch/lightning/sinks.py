"""The sink protocol: where each batch's captures go, and the in-memory sink.

:class:`~lightning_iocatch.IOCaptureCallback` hands every batch's captures to each of its
sinks. A sink sees the start of every armed loop, one :class:`BatchCaptures` per batch,
and either the end of the loop or the exception that stopped it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_iocatch.capture.catcher import CaptureBuffer
from lightning_iocatch.store.tokens import TokenSelection

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["STAGES", "BatchCaptures", "CaptureSink", "MemorySink"]

STAGES = ("validate", "test", "predict")


@dataclass(frozen=True)
class BatchCaptures:
    """One batch's captures, in the reference buffer layout, and where they came from.

    Attributes:
        stage: ``"validate"`` (also inside ``trainer.fit``), ``"test"`` or ``"predict"``.
        batch_idx: the batch's index within its dataloader, on this process.
        dataloader_idx: which dataloader the batch came from.
        captures: ``captures[name]["inputs" | "outputs"]``, one entry per call of the module.
        indices: the dataset index of each sample of the batch: recorded by Lightning in
            predict, rebuilt from a deterministic sampler in validation and test; ``None``
            where unknown (e.g. a shuffling sampler).
        batch: the batch as the step received it (e.g. to read labels from).
        repeated: per sample, whether it repeats a sample of this loop seen elsewhere (the
            padding a ``DistributedSampler`` adds so that every process gets as many
            samples); ``None`` where unknown.
        tokens: the token selection the captures were made with (a writer's ``tokens``
            in predict): selected tensors have one row per token; ``None`` otherwise.
    """

    stage: str
    batch_idx: int
    dataloader_idx: int
    captures: CaptureBuffer
    indices: tuple[int, ...] | None = None
    batch: Any = None
    repeated: tuple[bool, ...] | None = None
    tokens: TokenSelection | None = None


class CaptureSink:
    """Base class of everything that consumes captures; every method is optional.

    Examples:
        >>> class CountingSink(CaptureSink):
        ...     def __init__(self) -> None:
        ...         self.batches = 0
        ...
        ...     def on_batch(self, batch: BatchCaptures) -> None:
        ...         self.batches += 1
    """

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """An armed loop starts; ``stage`` is one of :data:`STAGES`."""

    def skip_batch(self, stage: str, dataloader_idx: int, indices: tuple[int, ...] | None) -> bool:
        """Whether this sink already has the batch (e.g. a resumed dump).

        In predict, a batch that every sink skips is not computed at all.
        """
        return False

    def on_batch(self, batch: BatchCaptures) -> None:
        """One batch's captures, right after the step that produced them."""

    def on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The epoch of an armed validation or test loop ends: the place to log."""

    def on_loop_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The armed loop finished normally."""

    def on_exception(self, stage: str, exception: BaseException) -> None:
        """The armed loop raised ``exception``; the run is over."""


class MemorySink(CaptureSink):
    """Keeps the latest run of each stage in memory, in the reference buffer layout.

    ``captures[stage][dataloader_idx][name]["outputs"]`` holds one entry per call, batch
    after batch; ``indices[stage][dataloader_idx]`` one tuple of dataset indices per
    batch (or ``None`` where unknown). A stage is cleared when its loop starts again.
    """

    def __init__(self) -> None:
        self.captures: dict[str, dict[int, CaptureBuffer]] = {}
        self.indices: dict[str, dict[int, list[tuple[int, ...] | None]]] = {}

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.captures[stage] = {}
        self.indices[stage] = {}

    def on_batch(self, batch: BatchCaptures) -> None:
        buffer = self.captures[batch.stage].setdefault(
            batch.dataloader_idx, CaptureBuffer.empty(batch.captures)
        )
        for name, kinds in batch.captures.items():
            for kind, entries in kinds.items():
                buffer[name][kind].extend(entries)
        self.indices[batch.stage].setdefault(batch.dataloader_idx, []).append(batch.indices)
