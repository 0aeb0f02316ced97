"""StoreRows: a feature store as a shuffled ``IterableDataset`` of batches, each row once.

Rows of one or more keys stream from memory-mapped shards through a bounded shuffle buffer;
each DataLoader worker of each DDP rank reads its own share. Nothing here imports Lightning
(:class:`~lightning_iocatch.lightning.datamodule.StoreDataModule` is the Lightning face). For each
epoch (:meth:`StoreRows.set_epoch`, as with a ``DistributedSampler``):

- **Order.** The unit of reading is a block: the rows of one stored batch. ``shuffle=True``
  orders the blocks by a permutation drawn from ``(seed, epoch)``, the same in every
  process; each worker then yields batches drawn uniformly from a buffer of
  ``buffer_rows`` rows, refilling the freed places from its blocks (the shuffle buffer of
  WebDataset and Hugging Face ``datasets``), so rows of one stored batch stay within about
  ``buffer_rows`` rows of each other. ``shuffle=False`` reads in commit order (rank, shard,
  batch). The order depends on ``(seed, epoch)``, the store, the world size, the number
  of workers, ``batch_size`` and ``buffer_rows``, and on nothing else.
- **Exactly once.** The blocks laid end to end are N rows. Rank ``r`` of ``W`` reads the
  ``r``-th of ``W`` contiguous runs of ``N // W`` or ``N // W + 1`` rows (rows are split,
  not blocks) in batches of ``batch_size`` rows but its last one or two, so every rank
  yields ``len(dataset)`` batches (DDP needs the same number of steps on every rank) and
  one epoch reads every row once. Fewer rows than ranks, or ``batch_size=1`` with an uneven
  split, is refused; ``drop_last=True`` yields only full batches, ``(N // W) //
  batch_size`` per rank (the rows left out change with the epoch). A rank's batch ``i`` is
  made by its worker ``i % num_workers`` from the part of the run it needs, and the
  DataLoader collects batches from its workers in turn. Rank and world size come from
  ``rank=``/``world_size=``, or from ``torch.distributed`` once initialised (Lightning
  does it), resolved in the main process: a worker started by ``spawn`` or ``forkserver``
  gets them with the dataset. A process that is one of several (``WORLD_SIZE`` > 1)
  without a process group is refused, never read as rank 0 of 1.
- **Memory.** Per worker: ``buffer_rows`` rows of every key (in the output dtype), one
  batch, and the rows being copied in (their shard is mapped only while they are copied),
  whatever the size of the store.
- **Which rows.** One key: every row of it. Several keys: a sample lacking one of them is
  refused (``incomplete="error"``) or left out (``"skip"``). Keys stored once per batch or
  with rows of varying shape or dtype are refused; an index stored twice is refused, or
  read from its first commit (``on_duplicate="first"``), as FeatureStore does.

Not protected against: a store changed while it is read, or seen differently by the
processes of one run (StoreDataModule checks that every rank sees the same blocks).

Example:
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
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from lightning_iocatch.checks import check_bool, check_int, parse_dtype
from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.reader import FeatureStore, OnDuplicate
from lightning_iocatch.store.shuffle_buffer import (
    Block,
    BlockReader,
    Column,
    ShuffleBuffer,
    segments,
)

__all__ = ["INDEX", "StoreRows"]

INDEX = "index"
"""The batch entry holding each row's dataset index (``with_indices=True``)."""

Incomplete = Literal["error", "skip"]
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
        buffer_rows: rows each worker holds to shuffle from (default ``8 * batch_size``;
            at least ``batch_size``); unused without ``shuffle``.
        drop_last: yield only full batches (rows left out change with the epoch).
        with_indices: add each row's dataset index under ``"index"``.
        dtype: cast floating keys to this floating dtype (default: as stored).
        incomplete: with several keys, ``"error"`` refuses samples lacking one of them;
            ``"skip"`` reads only the samples that have them all.
        on_duplicate: as :class:`~lightning_iocatch.FeatureStore`'s.
        dataloader_idx: which predict dataloader's captures to read.
        rank: this process's data-parallel rank, with ``world_size``; default: from
            ``torch.distributed`` when initialised (carried to DataLoader workers whatever
            their start method), else 0 of 1 where ``WORLD_SIZE`` says one process.
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
        buffer_rows: int | None = None,
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
        self.keys = _parse_keys(keys)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, minimum=0)
        buffer_rows = 8 * self.batch_size if buffer_rows is None else buffer_rows
        self.buffer_rows = check_int("buffer_rows", buffer_rows, minimum=self.batch_size)
        self.drop_last = check_bool("drop_last", drop_last)
        self.with_indices = check_bool("with_indices", with_indices)
        self.dtype = parse_dtype("dtype", dtype)
        if incomplete not in _INCOMPLETE:
            raise ValueError(f"`incomplete` must be one of {_INCOMPLETE}, got {incomplete!r}")
        self._ranks = None
        if rank is not None and world_size is not None:
            if check_int("rank", rank, minimum=0) >= check_int("world_size", world_size, minimum=1):
                raise ValueError(f"`rank` must be below `world_size` {world_size}, got {rank}")
            self._ranks = (rank, world_size)
        elif rank is not None or world_size is not None:
            raise ValueError("pass both `rank` and `world_size`, or neither")
        if with_indices and INDEX in self.keys:
            raise ValueError(f"key {INDEX!r} would clash with `with_indices`'s entry {INDEX!r}")
        store = FeatureStore(
            path,
            dataloader_idx=dataloader_idx,
            on_duplicate=on_duplicate,
            storage_options=storage_options,
        )
        self.path = store.path
        self._columns = self._check_columns(store)
        self._blocks = _layout(store, self.keys, incomplete)
        self.rows = sum(block.rows for block in self._blocks)
        if not self.rows:
            raise StoreError(f"{self.path} holds no rows of {list(self.keys)}")
        self._digest = hashlib.blake2b(
            repr([(b.batch.source.name, b.batch.position, b.rows) for b in self._blocks]).encode()
        ).hexdigest()
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # seen by workers
        self._carried: tuple[int, int] | str | None = None  # see __getstate__

    def _check_columns(self, store: FeatureStore) -> dict[str, Column]:
        described = store.metadata
        columns = {}
        for key in self.keys:
            if key not in store:
                store.indices_of(key)  # raises a KeyError naming the keys close to it
            where = f"StoreRows reads keys with one row per sample; read {key!r} with"
            if key in described["per_batch"]:
                raise StoreError(f"{key!r} is stored once per batch; {where} store.batches")
            shape, dtype = described["keys"][key]["shape"], described["keys"][key]["dtype"]
            if shape is None or "|" in dtype:
                raise StoreError(
                    f"{key!r} has rows of different shapes or dtypes across batches ({dtype}); "
                    f"{where} store.batches"
                )
            stored = getattr(torch, dtype)
            cast = self.dtype if self.dtype is not None and stored.is_floating_point else stored
            columns[key] = Column(tuple(shape), cast)
        if self.with_indices:
            columns[INDEX] = Column((), torch.int64)
        return columns

    # The epoch

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (also in running workers)."""
        self._epoch.fill_(check_int("epoch", epoch, minimum=0))

    @property
    def epoch(self) -> int:
        return int(self._epoch)

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
        """The number of batches this rank yields per epoch (the same on every rank)."""
        rank, world = self._rank_and_world()
        return len(_rank_share(self.rows, world, rank, self.batch_size, self.drop_last)[1])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rank, world = self._rank_and_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch
        start, sizes = _rank_share(self.rows, world, rank, self.batch_size, self.drop_last)
        start += sum(sum(sizes[w::workers]) for w in range(worker))
        sizes = sizes[worker::workers]
        order = list(range(len(self._blocks)))
        if self.shuffle:
            order = torch.randperm(len(order), generator=_generator(self.seed, epoch)).tolist()
        counts = [self._blocks[b].rows for b in order]
        pieces = [(order[i], a, b) for i, a, b in segments(counts, start, start + sum(sizes))]
        if not sizes:
            return
        stored_names = {key: INDEX_KEY if key == INDEX else key for key in self._columns}
        reader = BlockReader([(self._blocks[b], a, z) for b, a, z in pieces], stored_names)
        rows = sum(sizes)
        capacity = min(self.buffer_rows if self.shuffle else max(sizes), rows)
        buffer = ShuffleBuffer(capacity, self._columns)
        generator = _generator(self.seed, epoch, rank, worker) if self.shuffle else None
        for size in sizes:
            buffer.fill(reader, capacity if self.shuffle else size)
            yield buffer.take(size, generator)

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


def _parse_keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    parsed = (keys,) if isinstance(keys, str) else tuple(keys)
    if not parsed or not all(isinstance(key, str) for key in parsed):
        raise TypeError(f"`keys` must be a key or a non-empty list of keys (str), got {keys!r}")
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"`keys` lists a key twice: {list(parsed)}")
    return parsed


def _generator(*parts: int) -> torch.Generator:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


# The layout: which rows of which stored batch are read, in commit order


def _layout(store: FeatureStore, keys: Sequence[str], incomplete: Incomplete) -> list[Block]:
    """The blocks of the rows holding every key, in commit order, each with the rows
    ``store`` reads from it (an index stored twice is read from its first commit)."""
    counts, blocks = dict.fromkeys(keys, 0), []
    for batch in store.stored_batches():
        held = [key for key in keys if key in batch.keys]
        keep = None if batch.keep is None else batch.keep.nonzero().flatten()
        rows = batch.kept_rows
        for key in held:
            counts[key] += rows
        if len(held) == len(keys) and rows:
            blocks.append(Block(batch, rows, keep))
    complete = sum(block.rows for block in blocks)
    for key in keys:
        if counts[key] != complete and incomplete == "error":
            raise StoreError(
                f"{key!r} is stored for {counts[key]} rows, but only {complete} rows hold "
                f"every one of {list(keys)}; pass StoreRows(..., incomplete='skip') to read "
                "only those, or read the keys one at a time"
            )
    return blocks


# An epoch's share: which rows of the blocks laid end to end, in batches of which sizes


def _rank_share(
    total: int, world: int, rank: int, batch_size: int, drop_last: bool
) -> tuple[int, list[int]]:
    """Where ``rank``'s contiguous run of the ``total`` rows starts, and its batch sizes.

    Every rank gets the same number of batches; without ``drop_last`` the runs cover every
    row once, all batches full but a rank's last one or two.
    """
    quotient, remainder = divmod(total, world)
    start = rank * quotient + min(rank, remainder)
    if drop_last:
        if quotient < batch_size:
            raise ValueError(
                f"{total} rows over {world} process(es) are fewer than `batch_size` "
                f"{batch_size} per process: `drop_last=True` would drop every batch"
            )
        return start, [batch_size] * (quotient // batch_size)
    if quotient == 0 or (batch_size == 1 and remainder):
        raise ValueError(
            f"{total} rows cannot give {world} processes the same number of non-empty batches "
            f"of at most {batch_size} rows each; use a `batch_size` of 2 or more, fewer "
            "processes, or `drop_last=True`"
        )
    share = quotient + (rank < remainder)
    steps = -(-(quotient + (remainder > 0)) // batch_size)
    sizes = [batch_size] * (steps - 1) + [share - (steps - 1) * batch_size]
    if sizes[-1] == 0:  # one row fewer than the largest share: the last two share it out
        sizes[-2:] = [batch_size - 1, 1]
    return start, sizes
