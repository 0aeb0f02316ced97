"""The reading side of :class:`~lightning_iocatch.store.training.StoreRows`: a batch of rows
gathered from the stored batches they are in, in the order asked.

A :class:`Block` is the rows read from one stored batch; a :class:`RowGather` reads a batch
given, for each of its rows, the block and the row within the rows read from it: it groups
the rows by shard and asks each shard for the bytes at just those rows' offsets
(:meth:`~lightning_iocatch.store.backends.base.Shard.gather`: memory-mapped on disk, ranged
reads on object storage), so a batch costs the bytes of its rows, not of the blocks they
come from; a key's rows and their scales in one call (a local shard is mapped once), and
a batch from one shard is taken as the shard gives it, with no copy. Rows are moved as
bytes with NumPy, on the calling thread only (only a coded shard's blocks are decoded on
threads of their own): torch's intra-op threads, which a DataLoader's main process has,
turn these small copies into a contest for the cores with everything else the machine
runs. A key stored in 8-bit floats with a scale per row is gathered with its scales and
dequantized (:func:`~lightning_iocatch.store.shard_file.dequantize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.safetensors_layout import row_width
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.shard_file import dequantize, scale_name
from lightning_iocatch.store.stored_batches import StoredBatch

__all__ = ["Block", "Column", "RowGather"]


@dataclass(frozen=True)
class Block:
    """The rows read from one stored batch."""

    batch: StoredBatch
    rows: int
    keep: torch.Tensor | None  # stored positions of the rows read; None: all, in order


@dataclass(frozen=True)
class Column:
    """One key of a batch: the shape and dtype of a row as it comes out, and as stored
    (``scaled``: with a float32 scale per row)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stored: torch.dtype
    scaled: bool = False


class RowGather:
    """Batches of ``columns`` (key out -> how it comes out) from ``blocks``;
    ``stored_names`` maps each key out to its key in the shards.

    Per block it keeps where each key's tensor starts in its shard (found in the shard's
    header the first time a row of the block is read) and whether its ``__index__`` was
    checked against its record: memory per block, not per row.
    """

    def __init__(
        self, blocks: list[Block], columns: dict[str, Column], stored_names: dict[str, str]
    ) -> None:
        self._blocks, self._columns, self._stored = blocks, columns, stored_names
        sources = {id(block.batch.source): block.batch.source for block in blocks}
        number = {key: n for n, key in enumerate(sources)}
        self._sources = list(sources.values())
        self._source_of = np.array([number[id(b.batch.source)] for b in blocks], dtype=np.int64)
        self._keeps = {n: b.keep.numpy() for n, b in enumerate(blocks) if b.keep is not None}
        self._starts = {key: np.full(len(blocks), -1, dtype=np.int64) for key in columns}
        self._scale_starts = {
            key: np.full(len(blocks), -1, dtype=np.int64)
            for key, column in columns.items()
            if column.scaled
        }
        self._widths: dict[str, int] = {}
        self._checked = np.zeros(len(blocks), dtype=bool)  # __index__ checked

    def _locate(self, blocks: np.ndarray, key: str) -> None:
        """Find where ``key``'s tensor starts in each of ``blocks`` not located yet."""
        starts = self._starts[key]
        for block in blocks[starts[blocks] < 0].tolist():
            batch = self._blocks[block].batch
            span = batch.source.spans()[f"b{batch.position}/{self._stored[key]}"]
            width = row_width(span) if span.shape else span.end - span.start
            if self._widths.setdefault(key, width) != width:
                raise StoreError(
                    f"shard {batch.source} batch {batch.position} has rows of "
                    f"{width} bytes for {key!r}, others {self._widths[key]}"
                )
            starts[block] = span.start
            if key in self._scale_starts:
                name = scale_name(batch.position, self._stored[key])
                self._scale_starts[key][block] = batch.source.spans()[name].start

    def _check_indices(self, blocks: np.ndarray) -> None:
        """Read and check the ``__index__`` of each of ``blocks`` not checked yet."""
        for block in blocks[~self._checked[blocks]].tolist():
            self._blocks[block].batch.read_indices()  # raises on an index unlike its record
            self._checked[block] = True

    def read(self, blocks: np.ndarray, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch whose row ``i`` is row ``rows[i]`` of the rows read from block
        ``blocks[i]``."""
        count = len(blocks)
        stored = rows.copy()  # rows of the stored batches
        touched = np.unique(blocks)
        for block in touched.tolist():
            keep = self._keeps.get(block)
            if keep is not None:
                mine = blocks == block
                stored[mine] = keep[rows[mine]]
        if INDEX_KEY in self._stored.values():
            self._check_indices(touched)
        sources = self._source_of[blocks]
        by_source = np.argsort(sources, kind="stable")
        cuts = np.flatnonzero(np.diff(sources[by_source])) + 1
        out: dict[str, np.ndarray] = {}
        scales: dict[str, np.ndarray] = {}
        for places in np.split(by_source, cuts):
            source = self._sources[int(sources[places[0]])]
            mine = blocks[places]
            distinct = touched if len(cuts) == 0 else np.unique(mine)
            asked: list[tuple[np.ndarray, int]] = []  # each key's rows, and their scales
            into: list[tuple[dict[str, np.ndarray], str]] = []
            for key in self._columns:
                self._locate(distinct, key)
                width = self._widths[key]
                asked.append((self._starts[key][mine] + stored[places] * width, width))
                into.append((out, key))
                if key in self._scale_starts:
                    asked.append((self._scale_starts[key][mine] + stored[places] * 4, 4))
                    into.append((scales, key))
            for (table, key), taken in zip(into, source.gather_many(asked), strict=True):
                if len(cuts) == 0:  # one shard: ``places`` is every row in order
                    table[key] = taken
                else:
                    table.setdefault(key, np.empty((count, taken.shape[1]), np.uint8))
                    table[key][places] = taken
        batch = {}
        for key, column in self._columns.items():
            if math.prod(column.shape) == 0:
                batch[key] = torch.empty((count, *column.shape), dtype=column.dtype)
                continue
            values = torch.from_numpy(out[key]).view(column.stored).reshape(count, *column.shape)
            if column.scaled:
                scale = torch.from_numpy(scales[key]).view(torch.float32).reshape(count)
                batch[key] = dequantize(values, scale, column.dtype)
            else:
                batch[key] = values.to(column.dtype)
        return batch
