"""StoreDataModule: train on a feature store with ``Trainer.fit``, a new order every epoch.

The Lightning face of :class:`~lightning_iocatch.store.training.StoreRows`. Lightning calls
``set_epoch`` on a DataLoader's sampler, never on an ``IterableDataset``; the train
DataLoader here sets the dataset's epoch to ``trainer.current_epoch`` each time an epoch
starts iterating it (the epoch reaches running workers too, so ``persistent_workers=True``
works). Lightning does not give an ``IterableDataset`` a ``DistributedSampler``: each rank
reads its own share, by ``torch.distributed``'s rank.

**Resuming mid-epoch.** Lightning saves ``state_dict()`` in every checkpoint: where the
current epoch stands after the batches the fit loop has processed
(``trainer.fit_loop.epoch_loop.batch_progress``), and ``Trainer.fit(ckpt_path=...)``
restores it, so the resumed run reads the rest of that epoch, each row once over both runs,
with any number of processes, workers or batch size (see
:class:`~lightning_iocatch.store.training.StoreRows`). Lightning counts a resumed epoch's
batches on from the batches done before; when the global batch changed, the loader's length
is the larger of a whole epoch's and the resumed epoch's batches, and the epoch ends when
the rows do. A loader sized before the checkpoint was restored
(``trainer.estimated_stepping_batches`` read in ``setup``), with a global batch now larger,
would end the resumed epoch early: that is refused when the epoch starts.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_iocatch.checks import check_bool, check_int
from lightning_iocatch.errors import StoreError
from lightning_iocatch.lightning.process_group_exit import destroy_gloo_group_at_exit
from lightning_iocatch.store.reader import OnDuplicate
from lightning_iocatch.store.training import SHUFFLE_ROWS, Incomplete, StoreRows

if TYPE_CHECKING:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["StoreDataModule"]


class _EpochLoader(DataLoader):
    """A DataLoader of a StoreRows that sets its epoch from ``trainer`` as each epoch starts,
    and whose length covers a resumed epoch (see the module docstring)."""

    trainer: pl.Trainer | None = None

    def __len__(self) -> int:
        data = self.dataset
        assert isinstance(data, StoreRows)
        if self.trainer is not None:
            data.set_epoch(self.trainer.current_epoch)
        return max(data.epoch_length(), data.batches_done + len(data))

    def __iter__(self) -> _Deferred:  # type: ignore[override]
        """The DataLoader's iterator, started at the first batch: Lightning makes a train
        loader's iterator before it restores a checkpoint (and keeps it for the resumed
        epoch), and workers would read the epoch's start before it is restored."""
        return _Deferred(self._start)

    def _start(self) -> _BaseDataLoaderIter:
        data = self.dataset
        assert isinstance(data, StoreRows)
        if self.trainer is not None:
            data.set_epoch(self.trainer.current_epoch)
            _check_sized_after_restore(self.trainer, data)
        return super().__iter__()


class _Deferred(Iterator[Any]):
    """An iterator that calls ``start`` for the one it hands out, at the first ``next``."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start: Callable[[], Iterator[Any]] | None = start
        self._started: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._started is None:
            assert self._start is not None
            self._started, self._start = self._start(), None
        return next(self._started)


def _check_sized_after_restore(trainer: pl.Trainer, data: StoreRows) -> None:
    """Refuse a resumed epoch that Lightning would end before its rows are read."""
    needed = data.batches_done + len(data)
    sized = trainer.num_training_batches
    limit = trainer.limit_train_batches
    capped = needed if limit == 1.0 else min(needed, limit) if isinstance(limit, int) else None
    if data.batches_done and capped is not None and sized < capped:
        raise StoreError(
            f"this resumed epoch needs {needed} batches, {data.batches_done} of them done "
            f"before the checkpoint, but the train loader was sized ({sized} batches) before "
            "the checkpoint was restored (trainer.estimated_stepping_batches read in setup?) "
            "and the global batch is now larger: read it in configure_optimizers, or resume "
            "with the same number of processes and batch_size"
        )


class StoreDataModule(pl.LightningDataModule):
    """Batches of a feature store's rows for ``Trainer.fit``: shuffled, each row once per epoch.

    Args:
        path: the store directory, or its fsspec URL (``s3://bucket/run``).
        keys: the key or keys to read (each batch is a dict by key).
        batch_size: rows per batch, per process.
        num_workers: DataLoader worker processes per rank; each reads its own share.
        persistent_workers: keep the workers between epochs (they still get each epoch).
        pin_memory: pin batches for faster copies to the GPU.
        multiprocessing_context: how workers start (``"fork"``, ``"spawn"``,
            ``"forkserver"``; default: the platform's), as a ``DataLoader``'s. Every start
            method reads each row once: the rank is resolved in the main process.
        shuffle, seed, shuffle_rows, drop_last, with_indices, dtype, incomplete,
            on_duplicate, dataloader_idx, storage_options: as
            :class:`~lightning_iocatch.store.training.StoreRows`'s.

    The store is opened (and every argument checked) here; at ``setup`` every rank checks
    that it sees the same rows of the store as rank 0, and all raise the same error if not.
    Each rank yields ``len(self.dataset)`` batches per epoch, the same on every rank. A run
    resumed from a checkpoint taken mid-epoch reads the rest of that epoch (see the module
    docstring).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_iocatch.store.writer import ShardWriter
        >>> from lightning_iocatch.store.plan import prepare_store
        >>> path = Path(tempfile.mkdtemp()) / "store"
        >>> plan = prepare_store(path, "create", {"spec": None, "stage": "predict", "dtype": None})
        >>> writer = ShardWriter(path, rank=0, plan=plan)
        >>> _ = writer.write({"h/outputs": torch.randn(30, 4)}, indices=list(range(30)))
        >>> writer.close()
        >>> data = StoreDataModule(path, "h/outputs", batch_size=8, num_workers=0)
        >>> len(data.dataset), next(iter(data.train_dataloader()))["h/outputs"].shape
        (4, torch.Size([8, 4]))

    Then ``Trainer(...).fit(model, datamodule=data)``: ``training_step`` gets
    ``batch["h/outputs"]``. Lightning warns that an ``IterableDataset`` with ``__len__``
    may be inaccurate with several workers; this one's length is exact.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: str | Sequence[str],
        *,
        batch_size: int,
        num_workers: int = 0,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        multiprocessing_context: str | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_rows: int = SHUFFLE_ROWS,
        drop_last: bool = False,
        with_indices: bool = False,
        dtype: torch.dtype | str | None = None,
        incomplete: Incomplete = "error",
        on_duplicate: OnDuplicate = "error",
        dataloader_idx: int = 0,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self.persistent_workers = check_bool("persistent_workers", persistent_workers)
        if persistent_workers and not num_workers:
            raise ValueError("`persistent_workers=True` needs `num_workers` of 1 or more")
        self.pin_memory = check_bool("pin_memory", pin_memory)
        methods = multiprocessing.get_all_start_methods()
        if multiprocessing_context is not None and multiprocessing_context not in methods:
            raise ValueError(
                f"`multiprocessing_context` must be None or one of {methods}, got "
                f"{multiprocessing_context!r}"
            )
        if multiprocessing_context is not None and not num_workers:
            raise ValueError("`multiprocessing_context` needs `num_workers` of 1 or more")
        self.multiprocessing_context = multiprocessing_context
        self.dataset = StoreRows(
            path,
            keys,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            shuffle_rows=shuffle_rows,
            drop_last=drop_last,
            with_indices=with_indices,
            dtype=dtype,
            incomplete=incomplete,
            on_duplicate=on_duplicate,
            dataloader_idx=dataloader_idx,
            storage_options=storage_options,
        )

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            destroy_gloo_group_at_exit()  # see process_group_exit
            self._agree(self.trainer.strategy)

    def _agree(self, strategy: pl.strategies.Strategy) -> None:
        """Every rank must read the same blocks, or the shares would overlap or leave rows."""
        mine = self.dataset._digest
        first = strategy.broadcast(mine, src=0)
        if not strategy.reduce_boolean_decision(mine == first, all=True):
            raise StoreError(
                f"not every process sees the same rows in {self.dataset.path} (a store still "
                "being written, or node-local copies that differ): every process must read "
                "one finished store"
            )

    def train_dataloader(self) -> DataLoader:
        loader = _EpochLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=self.persistent_workers,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.multiprocessing_context,
        )
        loader.trainer = self.trainer
        return loader

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands after the batches the fit loop has processed (saved
        in Lightning's checkpoints); ``{}`` outside ``fit``."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        self.dataset.set_epoch(trainer.current_epoch)
        processed = progress.processed  # type: ignore[attr-defined]  # a _ProcessedTracker
        return {"store_rows": self.dataset.state_dict(batches=processed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the checkpoint's epoch after the rows it had consumed."""
        if "store_rows" in state_dict:
            self.dataset.load_state_dict(state_dict["store_rows"])
