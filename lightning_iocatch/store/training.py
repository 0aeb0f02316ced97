"""StoreRows: a feature store as a shuffled ``IterableDataset`` of batches, each row once.

Each DataLoader worker of each DDP rank reads its own batches, gathering each batch's rows
from the shards they are in. Nothing here imports Lightning
(:class:`~lightning_iocatch.lightning.datamodule.StoreDataModule` is the Lightning face). For
each epoch (:meth:`StoreRows.set_epoch`, as with a ``DistributedSampler``):

- **Order.** An epoch is one sequence of all the rows (:mod:`~.epoch_order`): the blocks
  (the rows read of each stored batch) in an order drawn from ``(seed, epoch)``, laid end to
  end and shuffled within windows of ``shuffle_rows`` rows, so rows of one stored batch stay
  within about ``shuffle_rows`` rows of each other (commit order without ``shuffle``). The
  sequence depends on ``(seed, epoch)``, the rows read and ``shuffle_rows``, and not on the
  number of processes, workers or the batch size. A run reads it in global steps of
  ``world_size x batch_size`` rows (the data-parallel world), the ranks in rank order:
  after ``k`` rows consumed, whatever the run, the rows consumed are the first ``k``.
- **Exactly once.** Every rank yields the same number of batches (DDP needs the same number
  of steps on every rank), all of ``batch_size`` rows but the last one or two, and an epoch
  reads every row once. Fewer rows than ranks, or ``batch_size=1`` with rows left over that
  cannot go one to each rank, is refused; ``drop_last=True`` reads the full steps only. A
  rank's batch ``i`` is made by its worker ``i % num_workers``, and the DataLoader collects
  batches from its workers in turn. Rank and world size are the data-parallel ones: from
  ``rank=``/``world_size=`` (or :meth:`StoreRows.set_ranks`; ``StoreDataModule`` passes
  the strategy's, as Lightning's samplers take them, so the ranks of one tensor-parallel
  group read the same rows), else from ``torch.distributed`` once initialised, resolved in
  the main process: a worker started by ``spawn`` or ``forkserver`` gets them with the
  dataset. A process that is one of several (``WORLD_SIZE`` > 1)
  without a process group is refused, never read as rank 0 of 1.
- **Resuming mid-epoch.** :meth:`StoreRows.state_dict` gives the position after a number of
  batches of the current epoch (the rows consumed: a prefix of the sequence), and
  :meth:`StoreRows.load_state_dict` makes the next iteration of that epoch read the rest,
  with any number of processes, workers and any batch size, without reading what was
  consumed; later epochs are whole. The same seed, ``shuffle``, ``shuffle_rows`` and rows
  are required (checked).
- **Memory.** Per worker: a batch, and, shuffled, the shards its window reads kept mapped
  while their files add up to at most twice the window's bytes (the least recently read
  unmapped first, all when the epoch's iterator ends or is closed:
  :mod:`~lightning_iocatch.store.backends.local_mapping`; otherwise each batch's rows are
  mapped only while they are copied; on object storage: ranged reads of the rows' bytes),
  whatever the size of the store.
- **Which rows.** One key: every row of it. Several keys: a sample lacking one of them is
  refused (``incomplete="error"``) or left out (``"skip"``). Keys stored once per batch or
  with rows of varying shape or dtype are refused; an index stored twice is refused, or
  read from its first commit (``on_duplicate="first"``), as FeatureStore does.

Not protected against: a store changed while it is read, or seen differently by the
processes of one run (StoreDataModule checks that every rank sees the same blocks).

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from torch.utils.data import DataLoader
    >>> from lightning_iocatch.store.writer import ShardWriter
    >>> from lightning_iocatch.store.plan import prepare_store
    >>> path = Path(tempfile.mkdtemp()) / "store"
    >>> plan = prepare_store(path, "create", {"spec": None, "stage": "predict", "dtype": None})
    >>> writer = ShardWriter(path, rank=0, plan=plan, max_shard_bytes=64)
    >>> for start in range(0, 10, 4):  # ten rows of "h/outputs" in three batches
    ...     rows = torch.arange(start, min(start + 4, 10))
    ...     _ = writer.write({"h/outputs": rows[:, None].float()}, indices=rows.tolist())
    >>> writer.close()
    >>> data = StoreRows(path, "h/outputs", batch_size=3, with_indices=True)
    >>> batches = list(DataLoader(data, batch_size=None, num_workers=0))  # the order of epoch 0
    >>> len(data), [len(batch["index"]) for batch in batches]
    (4, [3, 3, 3, 1])
    >>> sorted(torch.cat([batch["index"] for batch in batches]).tolist()) == list(range(10))
    True
    >>> state = data.state_dict(batches=2)  # two batches trained on, then a preemption
    >>> resumed = StoreRows(path, "h/outputs", batch_size=2, with_indices=True)  # another size
    >>> resumed.load_state_dict(state)
    >>> rest = list(DataLoader(resumed, batch_size=None))
    >>> read = [batch["index"] for batch in batches[:2] + rest]
    >>> sorted(torch.cat(read).tolist()) == list(range(10))
    True
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from lightning_iocatch.checks import check_bool, check_int, parse_read_dtype
from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.coded import KEPT_BYTES, KEPT_BYTES_MAX
from lightning_iocatch.store.epoch_order import EpochSequence, StepPlan
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.reader import FeatureStore, OnDuplicate
from lightning_iocatch.store.row_gather import Column, RowGather
from lightning_iocatch.store.row_layout import Incomplete, key_columns, layout, parse_keys
from lightning_iocatch.store.shard_codec import BLOCK_BYTES

__all__ = ["INDEX", "SHUFFLE_ROWS", "StoreRows"]

RANDPERM = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
"""A draw of ``torch.randperm``, part of what a state's sequence depends on."""

SHUFFLE_ROWS = 1 << 16
"""Rows of a shuffle window by default (see the module docstring)."""

INDEX = "index"
"""The batch entry holding each row's dataset index (``with_indices=True``)."""

_INCOMPLETE = ("error", "skip")


class StoreRows(IterableDataset[dict[str, torch.Tensor]]):
    """Batches of rows of ``keys`` from a feature store, shuffled, each row once per epoch.

    Each item is a batch: a dict from key to a tensor with one row per sample (plus
    ``"index"``, the dataset indices, with ``with_indices=True``). Give it to a
    ``DataLoader`` with ``batch_size=None``. See the module docstring for the rules.

    Args:
        path: the store directory a :class:`~lightning_iocatch.FeatureWriter` wrote, or its
            fsspec URL: rows are then read with ranged requests of just their bytes (each
            DataLoader worker makes its own filesystem).
        keys: a key or keys of the store with one row per sample (``store.keys()``).
        batch_size: rows per batch.
        shuffle: draw the order from ``(seed, epoch)``; ``False`` reads in commit order.
        seed: the seed of the order.
        shuffle_rows: rows are shuffled within windows of this many rows of the blocks'
            order (65,536 by default); unused without ``shuffle``. It shapes the order and
            the memory: each worker keeps the shards a window reads mapped while their
            files fit in twice its bytes (faster random reads), and on a store written
            with a codec a window's decoded blocks (at most 1 GiB, ``KEPT_BYTES_MAX``; a
            wider window decodes blocks more than once: pass fewer rows).
        drop_last: yield only full batches (rows left out change with the epoch).
        with_indices: add each row's dataset index under ``"index"``.
        dtype: cast floating keys to this floating dtype (default: as stored; a key stored
            in 8-bit floats with a scale per row is read dequantized, as float32 by default).
        incomplete: with several keys, ``"error"`` refuses samples lacking one of them;
            ``"skip"`` reads only the samples that have them all.
        on_duplicate: as :class:`~lightning_iocatch.FeatureStore`'s.
        dataloader_idx: which predict dataloader's captures to read.
        rank: this process's data-parallel rank, with ``world_size`` (see :meth:`set_ranks`);
            default: from ``torch.distributed`` when initialised (carried to DataLoader
            workers whatever their start method), else 0 of 1 where ``WORLD_SIZE`` says one
            process.
        world_size: the number of data-parallel processes.
        storage_options: fsspec options for a URL ``path`` (credentials, endpoint, ...).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: str | Sequence[str],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_rows: int = SHUFFLE_ROWS,
        drop_last: bool = False,
        with_indices: bool = False,
        dtype: torch.dtype | str | None = None,
        incomplete: Incomplete = "error",
        on_duplicate: OnDuplicate = "error",
        dataloader_idx: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.keys = parse_keys(keys)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, minimum=0)
        self.shuffle_rows = check_int("shuffle_rows", shuffle_rows, minimum=1)
        self.drop_last = check_bool("drop_last", drop_last)
        self.with_indices = check_bool("with_indices", with_indices)
        self.dtype = parse_read_dtype("dtype", dtype)
        if incomplete not in _INCOMPLETE:
            raise ValueError(f"`incomplete` must be one of {_INCOMPLETE}, got {incomplete!r}")
        self._ranks: tuple[int, int] | None = None
        self.set_ranks(rank, world_size)
        if with_indices and INDEX in self.keys:
            raise ValueError(f"key {INDEX!r} would clash with `with_indices`'s entry {INDEX!r}")
        store = FeatureStore(
            path,
            dataloader_idx=dataloader_idx,
            on_duplicate=on_duplicate,
            storage_options=storage_options,
        )
        self.path = store.path
        self._columns = key_columns(store, self.keys, self.dtype)
        if self.with_indices:
            self._columns[INDEX] = Column((), torch.int64, torch.int64)
        self._blocks = layout(store, self.keys, incomplete)
        self.rows = sum(block.rows for block in self._blocks)
        self._backend = store.backend
        if self.shuffle:  # decoded blocks of a window kept: each decoded about once a window
            store._kept.resize(_window_bytes(self._columns, self.shuffle_rows))
            # rows read at random from a shard mapped anew cost a page fault each, more than
            # the row: the shards a window reads stay mapped while their files fit in twice
            # its bytes, let go at the epoch's end (store/backends/local_mapping.py)
            self._backend.keep_reads(2 * self.shuffle_rows * _row_bytes(self._columns))
        if not self.rows:
            raise StoreError(f"{self.path} holds no rows of {list(self.keys)}")
        self._digest = hashlib.blake2b(
            repr([(b.batch.source.name, b.batch.position, b.rows) for b in self._blocks]).encode()
        ).hexdigest()
        # seen by running workers too: the epoch, and where a resumed epoch starts (see
        # load_state_dict): its epoch (-1: none), rows of its sequence consumed, batches
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._resume = torch.tensor([-1, 0, 0], dtype=torch.int64).share_memory_()
        self._carried: tuple[int, int] | str | None = None  # see __getstate__

    def set_ranks(self, rank: int | None, world_size: int | None) -> None:
        """Read as data-parallel rank ``rank`` of ``world_size`` from the next iteration on (a
        ``DistributedSampler``'s ``rank`` and ``num_replicas``: processes that hold parts of one
        model replica share a rank), or with ``None, None`` as the process group says.
        ``StoreDataModule`` sets the layout of the Trainer's strategy."""
        if rank is None and world_size is None:
            self._ranks = None
        elif rank is None or world_size is None:
            raise ValueError("pass both `rank` and `world_size`, or neither")
        elif check_int("rank", rank, minimum=0) >= check_int("world_size", world_size, minimum=1):
            raise ValueError(f"`rank` must be below `world_size` {world_size}, got {rank}")
        else:
            self._ranks = (rank, world_size)

    # The epoch, and where it starts

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (also in running workers)."""
        self._epoch.fill_(check_int("epoch", epoch, minimum=0))

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch a resumed run took before (0 unless
        :meth:`load_state_dict` placed this epoch's start later)."""
        return self._start(self.epoch)[1]

    @property
    def resumed_epoch(self) -> int | None:
        """The epoch :meth:`load_state_dict` placed later, until :meth:`clear_position` or
        an iteration of another epoch; ``None`` if none."""
        resumed = int(self._resume[0])
        return None if resumed < 0 else resumed

    def clear_position(self) -> None:
        """Forget where :meth:`load_state_dict` placed an epoch's start: every epoch whole."""
        self._resume.copy_(torch.tensor([-1, 0, 0]))

    def _start(self, epoch: int) -> tuple[int, int]:
        """Rows of ``epoch``'s sequence consumed before this run, and in how many batches."""
        resumed, rows, batches = self._resume.tolist()
        return (rows, batches) if resumed == epoch else (0, 0)

    def _plan(self, first: int, world: int) -> StepPlan:
        return StepPlan(
            first=first,
            total=self.rows,
            world=world,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )

    def state_dict(self, batches: int) -> dict[str, Any]:
        """Where the current epoch stands after this run took ``batches`` batches of it on
        each rank (counted from the epoch's start, batches of a run resumed before
        included), for :meth:`load_state_dict`."""
        _, world = self._rank_and_world()
        epoch = self.epoch
        first, done = self._start(epoch)
        plan = self._plan(first, world)
        if not done <= check_int("batches", batches, minimum=0) <= done + len(plan):
            raise ValueError(
                f"`batches` must be between {done} and {done + len(plan)} (the batches of "
                f"epoch {epoch} on {world} process(es)), got {batches}"
            )
        return {
            "epoch": epoch,
            "rows": first + plan.rows_before(batches - done),
            "batches": batches,
            "sequence": self._sequence_key(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue ``state``'s epoch after the rows it had consumed (also in running workers),
        whatever the number of processes, workers and the batch size now."""
        sequence = self._sequence_key()
        if state.get("sequence") != sequence:
            theirs = state.get("sequence") or {}
            differ = [
                f"{name} {theirs.get(name)!r} (now {value!r})"
                for name, value in sequence.items()
                if theirs.get(name) != value
            ]
            raise StoreError(
                "this state was saved reading another sequence of rows: "
                + ", ".join(differ)
                + "; resume with the same store, keys, incomplete and on_duplicate, seed, "
                "shuffle and shuffle_rows"
            )
        epoch, rows, batches = (int(state[name]) for name in ("epoch", "rows", "batches"))
        if epoch < 0 or not 0 <= rows <= self.rows or batches < 0 or batches > rows:
            raise ValueError(
                f"a state places epoch {epoch} after {rows} rows in {batches} batches: not "
                f"a position in {self.rows} rows (a damaged or edited state)"
            )
        self._resume.copy_(torch.tensor([epoch, rows, batches]))
        self.set_epoch(epoch)

    def _sequence_key(self) -> dict[str, Any]:
        """What the sequence of an epoch depends on (see the module docstring)."""
        return {
            "rows": self.rows,
            "blocks": self._digest,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_rows": self.shuffle_rows,
            "randperm": RANDPERM,  # torch's draws, should a torch release change them
        }

    def _rank_and_world(self) -> tuple[int, int]:
        """Given ones; else the process group's (the main process, a forked worker); else,
        in a worker started by spawn or forkserver, what the process that started it
        resolved; else 0 of 1 where this is one process of one, an error otherwise."""
        if self._ranks is not None:
            return self._ranks
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        if get_worker_info() is not None and self._carried is not None:
            if isinstance(self._carried, str):
                raise StoreError(self._carried)
            return self._carried
        return _data_parallel_rank()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a DataLoader worker (``spawn``, ``forkserver``): the rank and world size
        go with it, resolved here in the main process (a worker has no process group)."""
        state = dict(self.__dict__)
        if self._ranks is None:
            try:
                state["_carried"] = _data_parallel_rank()
            except StoreError as error:  # raised where the rank is needed, in the worker
                state["_carried"] = str(error)
        return state

    def __len__(self) -> int:
        """The batches this rank yields in the next iteration (the same on every rank): an
        epoch's, or the rest of a resumed one."""
        _, world = self._rank_and_world()
        return len(self._plan(self._start(self.epoch)[0], world))

    def epoch_length(self) -> int:
        """The batches of a whole epoch on this rank, as this run reads it."""
        return len(self._plan(0, self._rank_and_world()[1]))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rank, world = self._rank_and_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        if self.resumed_epoch not in (None, epoch):  # that epoch is over
            self.clear_position()
        plan = self._plan(self._start(epoch)[0], world)
        sequence = EpochSequence(
            [block.rows for block in self._blocks],
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            shuffle_rows=self.shuffle_rows,
        )
        stored_names = {key: INDEX_KEY if key == INDEX else key for key in self._columns}
        gather = RowGather(self._blocks, self._columns, stored_names)
        try:
            for step in range(worker, len(plan), workers):
                first, rows = plan.share(step, rank)
                yield gather.read(*sequence.locate(first, first + rows))
        finally:  # the epoch's shards unmapped (a store deleted after it frees its space)
            self._backend.release_reads()

    def __repr__(self) -> str:
        return f"StoreRows({str(self.path)!r}, keys={list(self.keys)}, rows={self.rows})"


def _data_parallel_rank() -> tuple[int, int]:
    """This process's rank and world size: ``torch.distributed``'s once initialised; 0 of 1
    in a process that is not one of several; an error where it cannot be known."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "0", "1"):
        raise StoreError(
            f"StoreRows cannot tell which rows this process reads: WORLD_SIZE={world} says it "
            "is one of several processes, but torch.distributed is not initialised in it. "
            "Iterate it once the process group is set up (Trainer.fit does it before the "
            "first batch), or pass StoreRows(..., rank=..., world_size=...)"
        )
    return 0, 1


def _window_bytes(columns: Mapping[str, Column], rows: int) -> int:
    """Decoded bytes of a shuffle window of ``rows`` rows of ``columns`` and of the blocks at
    its ends, within :data:`KEPT_BYTES` and :data:`KEPT_BYTES_MAX`."""
    tensors = sum(1 + c.scaled for c in columns.values()) + 1  # and the __index__
    row = _row_bytes(columns)
    ends = 4 * tensors * max(BLOCK_BYTES, row)
    return min(KEPT_BYTES_MAX, max(KEPT_BYTES, (row + 8) * rows + ends))


def _row_bytes(columns: Mapping[str, Column]) -> int:
    """Stored bytes of a row of ``columns`` (a scaled key's scale included)."""
    return sum(c.stored.itemsize * math.prod(c.shape) + 4 * c.scaled for c in columns.values())
