"""The train DataLoader of :class:`~lightning_iocatch.StoreDataModule`: each epoch's order, and
a mid-epoch resume, as Lightning's fit loop needs them.

Lightning reads a train loader's length once (``setup_data``), makes its iterator before it
restores a checkpoint and keeps that iterator for the resumed epoch, counts the resumed
epoch's batches on from the checkpoint's, and ends an epoch at that length (its validation,
epoch-interval schedulers and last accumulated step depend on reaching it). So an
:class:`EpochLoader`:

- reports the batches of the epoch Lightning runs next: while a resume point is armed (see
  :meth:`StoreRows.load_state_dict`), the resumed epoch's (the batches done before plus the
  rest, on this run's processes and batch size); a whole epoch's otherwise;
- starts the DataLoader's own iterator at the first batch, after the restore, with the
  dataset's epoch set from ``trainer.current_epoch``;
- checks there that Lightning's count of the batches done in this epoch is the dataset's (a
  checkpoint saved without the data module's state would read rows twice: refused), and
  that Lightning's length is this epoch's (a loader sized before the restore, by
  ``trainer.estimated_stepping_batches`` read in ``setup``, after the global batch changed:
  refused);
- when the resumed epoch has another number of batches than a whole epoch (the global batch
  changed), has Lightning reload the train loader once, at the next epoch
  (``trainer.reload_dataloaders_every_n_epochs`` is 1 for that epoch, then the user's
  again), so that every later epoch has its own length;
- has ``state_dict``/``load_state_dict`` (empty: the position is the data module's), so that
  Lightning takes it for resumable and does not warn on a correct mid-epoch resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.training import StoreRows

if TYPE_CHECKING:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["EpochLoader", "EpochTracker", "lightning_batches"]


@dataclass
class EpochTracker:
    """What the data module's loaders share: the epoch whose batches are being read, and the
    user's ``reload_dataloaders_every_n_epochs`` while a one-off reload is pending."""

    reading: int | None = None
    reload_pending: int | None = None

    def reset(self) -> None:
        self.reading = self.reload_pending = None


class EpochLoader(DataLoader):
    """A DataLoader (``batch_size=None``) of a :class:`StoreRows` in ``trainer``'s fit loop."""

    def __init__(
        self, dataset: StoreRows, trainer: pl.Trainer | None, tracker: EpochTracker, **kw: Any
    ) -> None:
        super().__init__(dataset, batch_size=None, **kw)
        self.trainer, self.tracker = trainer, tracker

    @property
    def rows(self) -> StoreRows:
        assert isinstance(self.dataset, StoreRows)
        return self.dataset

    def _next_epoch(self) -> int:
        """The epoch Lightning runs next: an armed resume's before the loops are restored."""
        data, trainer = self.rows, self.trainer
        current = data.epoch if trainer is None else trainer.current_epoch
        resumed = data.resumed_epoch
        return resumed if resumed is not None and current <= resumed else current

    def __len__(self) -> int:
        data = self.rows
        data.set_epoch(self._next_epoch())
        return data.batches_done + len(data)

    def state_dict(self) -> dict[str, Any]:
        """Nothing of its own: the position in an epoch is the data module's state, which
        Lightning restores before it sizes this loader (a loader's own state comes after).
        Lightning takes a train loader with ``state_dict``/``load_state_dict`` for resumable,
        and warns on a mid-epoch resume of any other ("not resumable ... unreliable")."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`state_dict`): a resume without the data module's
        state is refused as the first batch starts."""

    def __iter__(self) -> _Deferred:  # type: ignore[override]
        """The DataLoader's iterator, started at the first batch (see the module docstring)."""
        return _Deferred(self._start)

    def _start(self) -> _BaseDataLoaderIter:
        data, trainer, tracker = self.rows, self.trainer, self.tracker
        if trainer is None:
            return super().__iter__()
        epoch = trainer.current_epoch
        pending, reading = tracker.reload_pending, tracker.reading
        if pending is not None and reading is not None and epoch > reading:
            _set_reload_every(trainer, pending)  # the reload was done as this epoch began
            tracker.reload_pending = None
        data.set_epoch(epoch)
        if data.resumed_epoch not in (None, epoch):
            data.clear_position()
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if done != data.batches_done:
            raise StoreError(
                f"Lightning resumes epoch {epoch} after {done} batches, but this data module "
                f"holds no position in it ({data.batches_done} batches): the checkpoint was "
                "saved without its state (another data module class, or an earlier version), "
                "so rows would be read twice or not at all; resume from a checkpoint of this "
                "data module, or from one saved at the end of an epoch"
            )
        needed = done + len(data)
        expected = lightning_batches(trainer, needed)
        if trainer.num_training_batches != expected:
            raise StoreError(
                f"Lightning sized this epoch at {trainer.num_training_batches} batches, but it "
                f"has {expected} ({done} done before the checkpoint): the train loader was "
                "sized before the checkpoint was restored (trainer.estimated_stepping_batches "
                "read in setup?) and the global batch changed; read it in "
                "configure_optimizers, or resume with the same processes and batch_size"
            )
        whole = data.epoch_length()
        reload = tracker.reload_pending is None and not _reload_every(trainer)
        if done and needed != whole and reload:
            tracker.reload_pending = _reload_every(trainer)
            _set_reload_every(trainer, 1)
            rank_zero_info(
                f"lightning-iocatch: resumed epoch {epoch} has {needed} batches and a whole one "
                f"{whole} (the global batch changed): the train loader is reloaded once, at "
                "the next epoch, for its length"
            )
        tracker.reading = epoch
        return super().__iter__()


def _reload_every(trainer: pl.Trainer) -> int:
    return int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0))  # set by Lightning


def _set_reload_every(trainer: pl.Trainer, epochs: int) -> None:
    trainer.reload_dataloaders_every_n_epochs = epochs  # type: ignore[attr-defined]


def lightning_batches(trainer: pl.Trainer, batches: int) -> int:
    """The batches Lightning runs of a loader of ``batches``, under ``limit_train_batches``."""
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(batches, limit)
    return int(batches * limit) if limit is not None else batches


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
