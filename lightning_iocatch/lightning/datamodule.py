"""StoreDataModule: train on a feature store with ``Trainer.fit``, a new order every epoch.

The Lightning face of :class:`~lightning_iocatch.store.training.StoreRows`. Lightning calls
``set_epoch`` on a DataLoader's sampler, never on an ``IterableDataset``; the train
DataLoader here sets the dataset's epoch to ``trainer.current_epoch`` each time an epoch
starts iterating it (the epoch reaches running workers too, so ``persistent_workers=True``
works). Lightning does not give an ``IterableDataset`` a ``DistributedSampler``: each rank
reads the share of its data-parallel place, which ``setup`` takes from the strategy as
Lightning's samplers do (``trainer.distributed_sampler_kwargs``): under
``ModelParallelStrategy`` the ranks of one tensor-parallel group read the same rows, and
the saved position counts steps of the data-parallel world.

**Resuming mid-epoch.** Lightning saves ``state_dict()`` in every checkpoint: where the
current epoch stands after the batches the fit loop has processed
(``trainer.fit_loop.epoch_loop.batch_progress``), and ``Trainer.fit(ckpt_path=...)``
restores it, so the resumed run reads the rest of that epoch, each row once over both runs,
with any number of processes, workers or batch size (see
:class:`~lightning_iocatch.store.training.StoreRows`), then whole epochs. How the train
loader tells Lightning the resumed epoch's length, and what it refuses: see
:mod:`~lightning_iocatch.lightning.epoch_loader`.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_iocatch.checks import check_bool, check_int
from lightning_iocatch.errors import StoreError
from lightning_iocatch.lightning.epoch_loader import EpochLoader, EpochTracker
from lightning_iocatch.lightning.process_group_exit import destroy_gloo_group_at_exit
from lightning_iocatch.store.reader import OnDuplicate
from lightning_iocatch.store.training import SHUFFLE_ROWS, Incomplete, StoreRows

__all__ = ["StoreDataModule"]


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

    The other arguments (``shuffle``, ``seed``, ``shuffle_rows``, ``drop_last``,
    ``with_indices``, ``dtype``, ``incomplete``, ``on_duplicate``, ``dataloader_idx``,
    ``storage_options``) are :class:`~lightning_iocatch.store.training.StoreRows`'s.

    The store is opened (and every argument checked) here; at ``setup`` every rank checks
    that it sees the same rows of the store as rank 0, and all raise the same error if not.
    Each rank yields ``len(self.dataset)`` batches per epoch, the same on every rank. A run
    resumed from a checkpoint taken mid-epoch reads the rest of that epoch (see the module
    docstring).

    Examples:
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
        self._tracker = EpochTracker()
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
        self.dataset.clear_position()  # a checkpoint restored after this may place it again
        self._tracker.reset()
        if self.trainer is not None:
            destroy_gloo_group_at_exit()  # see process_group_exit
            self._agree(self.trainer.strategy)
            self._place(self.trainer)

    def _place(self, trainer: pl.Trainer) -> None:
        """Read as the data-parallel rank Lightning's samplers get; a strategy that is not
        parallel gives none, and then ``torch.distributed`` decides (see StoreRows)."""
        layout = trainer.distributed_sampler_kwargs
        if layout is None:
            self.dataset.set_ranks(None, None)
        else:
            self.dataset.set_ranks(int(layout["rank"]), int(layout["num_replicas"]))

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
        return EpochLoader(
            self.dataset,
            self.trainer,
            self._tracker,
            num_workers=self.num_workers,
            persistent_workers=self.persistent_workers,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.multiprocessing_context,
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands after the batches the fit loop has processed (saved
        in Lightning's checkpoints); ``{}`` outside ``fit``."""
        trainer, data = self.trainer, self.dataset
        if trainer is None or trainer.state.fn != "fit":
            return {}
        epoch = trainer.current_epoch
        data.set_epoch(epoch)
        if self._tracker.reading != epoch:  # no batch of this epoch read yet
            if data.resumed_epoch != epoch:
                return {}  # between epochs (Lightning's batch count is the last epoch's)
            return {"store_rows": data.state_dict(batches=data.batches_done)}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        processed = progress.processed  # type: ignore[attr-defined]  # a _ProcessedTracker
        return {"store_rows": data.state_dict(batches=processed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the checkpoint's epoch after the rows it had consumed."""
        if "store_rows" in state_dict:
            self.dataset.load_state_dict(state_dict["store_rows"])
