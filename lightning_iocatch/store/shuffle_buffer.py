"""The reading side of :class:`~lightning_iocatch.store.training.StoreRows`: blocks of
stored rows read a few at a time into a bounded shuffle buffer.

A :class:`Block` is the rows read from one stored batch; :func:`segments` cuts a run of
rows of blocks laid end to end into row ranges of each block; a :class:`BlockReader`
reads those ranges from their shards (memory-mapped or with ranged reads: each shard's
:class:`~lightning_iocatch.store.backends.base.Shard` knows how); a :class:`ShuffleBuffer`
holds a fixed number of rows and hands out batches drawn at random from them.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.stored_batches import StoredBatch

__all__ = ["Block", "BlockReader", "Column", "ShuffleBuffer", "segments"]


@dataclass(frozen=True)
class Block:
    """The rows read from one stored batch."""

    batch: StoredBatch
    rows: int
    keep: torch.Tensor | None  # stored positions of the rows read; None: all, in order


@dataclass(frozen=True)
class Column:
    """One key of a batch: the shape and dtype of a row as it comes out."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def segments(counts: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(i, first, end)``: the rows ``[start, stop)`` of blocks of ``counts`` rows laid end
    to end, as row ranges of block ``i``."""
    ends = list(itertools.accumulate(counts))
    pieces = []
    i = bisect.bisect_right(ends, start)
    while start < stop:
        begin = ends[i] - counts[i]
        end = min(ends[i], stop)
        pieces.append((i, start - begin, end - begin))
        start, i = end, i + 1
    return pieces


class BlockReader:
    """The rows of ``pieces`` (block, first row, end row) in order, a few at a time."""

    def __init__(self, pieces: list[tuple[Block, int, int]], stored_names: dict[str, str]) -> None:
        self._pieces = collections.deque(pieces)
        self._stored_names = stored_names  # key out -> key in the shard
        self._index: tuple[StoredBatch, torch.Tensor] | None = None  # of the last block

    def _index_of(self, batch: StoredBatch) -> torch.Tensor:
        if self._index is None or self._index[0] is not batch:
            self._index = (batch, batch.read_indices())
        return self._index[1]

    def read(self, limit: int) -> dict[str, torch.Tensor] | None:
        """Up to ``limit`` rows, or ``None`` after the last: views of their shard, mapped only
        as long as they are kept (so the pages of no other rows count as the process's)."""
        if not self._pieces:
            return None
        block, first, end = self._pieces.popleft()
        stop = min(end, first + limit)
        if stop < end:
            self._pieces.appendleft((block, stop, end))
        rows = {}
        batch = block.batch
        names = [f"b{batch.position}/{name}" for name in self._stored_names.values()]
        low, high, wanted = first, stop, None
        if block.keep is not None:  # rows low..high of the stored batch, then those kept
            wanted = block.keep[first:stop]
            low, high = int(wanted[0]), int(wanted[-1]) + 1
        index_name = f"b{batch.position}/{INDEX_KEY}"
        read = batch.source.read_rows([n for n in names if n != index_name], low, high)
        if index_name in names:  # the whole index, checked against its record, then rows
            read[index_name] = self._index_of(batch)[low:high]
        for key, name in zip(self._stored_names, names, strict=True):
            rows[key] = read[name] if wanted is None else read[name][wanted - low]
        if any(part.shape[0] != stop - first for part in rows.values()):
            raise StoreError(f"shard {batch.source} changed while it was read")
        return rows


class ShuffleBuffer:
    """``capacity`` rows per column; batches drawn at random (or in order) from those held.

    Rows are held as bytes and moved with NumPy, on the calling thread only: torch's
    intra-op threads, which a DataLoader's main process has, turn these small copies into
    a contest for the cores with everything else the machine runs (measured: a gather of
    4,096 rows of 1 KiB took 0.08 ms or 3.3 ms with 2 threads, depending on the load;
    0.2 ms with one).
    """

    def __init__(self, capacity: int, columns: dict[str, Column]) -> None:
        self._columns = columns
        self._bytes = {
            key: np.empty(
                (capacity, math.prod(column.shape) * column.dtype.itemsize), dtype=np.uint8
            )
            for key, column in columns.items()
        }
        self._held = 0

    def fill(self, reader: BlockReader, upto: int) -> None:
        while self._held < upto and (part := reader.read(upto - self._held)) is not None:
            count = len(next(iter(part.values())))
            for key, rows in part.items():
                rows = rows.to(self._columns[key].dtype).contiguous()
                view = rows.view(torch.uint8).reshape(count, -1) if rows.numel() else None
                if view is not None:
                    self._bytes[key][self._held : self._held + count] = view.numpy()
            self._held += count

    def take(self, count: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """``count`` rows at random (the first ones without ``generator``); their places
        are filled with the last rows held."""
        held, kept = self._held, self._held - count
        if generator is None:
            picked = torch.arange(count)
        else:
            picked = torch.randperm(held, generator=generator)[:count]
        moved = torch.ones(count, dtype=torch.bool)
        moved[picked[picked >= kept] - kept] = False
        holes, movers = picked[picked < kept].numpy(), torch.arange(kept, held)[moved].numpy()
        batch = {}
        for key, rows in self._bytes.items():
            column = self._columns[key]
            if not rows.shape[1]:  # rows of no element
                batch[key] = torch.empty((count, *column.shape), dtype=column.dtype)
                continue
            taken = torch.from_numpy(rows.take(picked.numpy(), axis=0))
            batch[key] = taken.view(column.dtype).reshape(count, *column.shape)
            rows[holes] = rows[movers]
        self._held = kept
        return batch
