"""A shard written with a codec, read as the tensors it was given: only the blocks asked decoded.

:class:`CodedShard` wraps a committed shard (on disk or on object storage) whose record names
a codec (see :mod:`lightning_iocatch.store.shard_codec`). Its header and spans are those of
the tensors as written: the spans lie in a virtual address space, the file as it would be
uncompressed, so that a reader that gathers rows by byte offsets (the training reader's
:meth:`gather`) works unchanged. A read of rows fetches the compressed blocks holding them
(one ranged read per run of close blocks on object storage) and decodes those only, on a
few threads at once (:mod:`~.decode_pool`: zstd and NumPy release the GIL), each block
once; :meth:`CodedShard.gather` finds every row's block with NumPy and copies the rows of
each block in one operation.

Decoded blocks are kept in a :class:`KeptBlocks`, bounded by bytes (not by count: a small
block of scales or indices costs its bytes, and pushes out no block of data) and shared by
the shards of one reader: a :class:`~lightning_iocatch.FeatureStore` keeps
:data:`KEPT_BYTES`; a shuffled :class:`~lightning_iocatch.StoreRows` sizes it to its shuffle
window (at most :data:`KEPT_BYTES_MAX`), so that a shuffled epoch decodes each block about
once. Room for the blocks a read decodes is made before they are decoded (the bound
holds with them), and the memory of a block dropped then that nothing else holds is
decoded into again.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard
from lightning_iocatch.store.backends.decode_pool import parallel_map
from lightning_iocatch.store.backends.safetensors_layout import Span, byte_rows, to_tensor
from lightning_iocatch.store.shard_codec import CodedTensor, decode_block, parse_codec

__all__ = ["KEPT_BYTES", "KEPT_BYTES_MAX", "CodedShard", "KeptBlocks"]

KEPT_BYTES = 64 << 20
"""Decoded bytes a reader keeps by default (64 MiB)."""

KEPT_BYTES_MAX = 1 << 30
"""The most decoded bytes a shuffled StoreRows keeps (1 GiB, per DataLoader worker): a
shuffle window holding more decodes blocks more than once (pass a smaller
``shuffle_rows``)."""


class KeptBlocks:
    """Decoded blocks, the least recently used dropped once they hold more than ``limit``
    bytes; safe across threads. Pickled empty (each process decodes its own)."""

    def __init__(self, limit: int = KEPT_BYTES) -> None:
        self.limit = limit
        self._blocks: OrderedDict[tuple[str, str, int], np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.limit, self._blocks, self._bytes = state["limit"], OrderedDict(), 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The decoded bytes kept now."""
        return self._bytes

    def resize(self, limit: int) -> None:
        """Keep at most ``limit`` bytes from now on."""
        with self._lock:
            self.limit = limit
            self._drop()

    def get(self, key: tuple[str, str, int]) -> np.ndarray | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[tuple[str, str, int]]) -> list[np.ndarray | None]:
        """The blocks kept of ``keys`` (``None`` for the others), under one lock."""
        found: list[np.ndarray | None] = []
        with self._lock:
            for key in keys:
                data = self._blocks.get(key)
                if data is not None:
                    self._blocks.move_to_end(key)
                found.append(data)
        return found

    def put(self, key: tuple[str, str, int], data: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks or data.nbytes > self.limit:
                return
            self._blocks[key] = data
            self._bytes += data.nbytes
            self._drop()

    def make_room(self, sizes: Sequence[int]) -> list[np.ndarray | None]:
        """Drop the least recently used blocks until blocks of ``sizes`` bytes fit; for
        each size, the memory of a block dropped now, of that size, that nothing else
        holds (``None`` where there is none). Reused, its pages need not be faulted in
        again: fresh memory for each decoded block measured a third of a coded read."""
        spares: dict[int, list[np.ndarray]] = {}
        with self._lock:
            while self._blocks and self._bytes + sum(sizes) > self.limit:
                data = self._blocks.popitem(last=False)[1]
                self._bytes -= data.nbytes
                # owned (no base) and held by none but ``data``: not a view that a reader
                # copies from (a view holds its base), not a block another thread reads
                if data.base is None and data.flags.writeable and _held_by_one_name(data):
                    spares.setdefault(data.nbytes, []).append(data)
                del data
        return [spares[size].pop() if spares.get(size) else None for size in sizes]

    def _drop(self) -> None:
        while self._bytes > self.limit:
            self._bytes -= self._blocks.popitem(last=False)[1].nbytes


def _sole_reference_count() -> int:
    """What ``sys.getrefcount`` says of an array that one local name holds: 2 up to
    Python 3.13 (the name and the call's argument), less where the argument is borrowed."""
    probe = np.empty(1)
    return sys.getrefcount(probe)


_SOLE_REFERENCE = _sole_reference_count()
# on a build without the GIL reference counts are not a reliable "nobody else": no reuse
_REUSE = getattr(sys, "_is_gil_enabled", lambda: True)()


def _held_by_one_name(data: np.ndarray) -> bool:
    """Whether nothing but the caller's one local name holds ``data`` (called as
    ``_held_by_one_name(data)``: this frame's argument is one more reference)."""
    return _REUSE and sys.getrefcount(data) == _SOLE_REFERENCE + 1


@dataclass(frozen=True)
class _Table:
    """A coded shard's tensors as arrays: names (and each name's number), its blocks' keys
    (numbered across the shard), and each tensor's virtual start, size, bytes of a full
    block (at least 1) and the number of its first block."""

    names: list[str]
    numbers: dict[str, int]
    keys: list[tuple[str, str, int]]  # each block's key in KeptBlocks, by its number
    starts: np.ndarray
    nbytes: np.ndarray
    block_bytes: np.ndarray
    first_block: np.ndarray


class CodedShard(Shard):
    """The shard ``raw``, written with a codec, as the tensors it holds (see the module
    docstring); its CRC-32 is that of the file's (compressed) bytes."""

    def __init__(self, raw: Shard, kept: KeptBlocks | None = None) -> None:
        self.raw, self.name = raw, raw.name
        self._layout: tuple[bool, dict[str, CodedTensor], dict[str, Span]] | None = None
        self._physical: dict[str, list[int]] = {}  # name -> each block's first byte, and end
        self._arrays: _Table | None = None
        self.kept = KeptBlocks() if kept is None else kept

    def __str__(self) -> str:
        return str(self.raw)

    def _tensors(self) -> tuple[bool, dict[str, CodedTensor], dict[str, Span]]:
        if self._layout is None:
            shuffle, coded = parse_codec(self.raw.metadata(), str(self))
            physical = self.raw.spans
            if set(coded) != set(physical):
                raise StoreError(
                    f"shard {self} is corrupted: its codec metadata lists other tensors"
                )
            spans, offset = {}, 0
            for name, info in coded.items():
                span = physical[name]
                if span.code != "U8" or span.end - span.start != sum(info.sizes):
                    raise StoreError(
                        f"shard {self} is corrupted: {name!r} is not the blocks its metadata says"
                    )
                self._physical[name] = np.cumsum([span.start, *info.sizes]).tolist()
                spans[name] = Span(info.code, info.shape, offset, offset + info.nbytes)
                offset += info.nbytes
            self._layout = (shuffle, coded, spans)
        return self._layout

    @property
    def spans(self) -> dict[str, Span]:
        """Where each tensor lies in the shard as if it were not compressed."""
        return self._tensors()[2]

    def header(self) -> dict[str, tuple[str, list[int]]]:
        return {name: (span.code, list(span.shape)) for name, span in self.spans.items()}

    def metadata(self) -> dict[str, str]:
        return self.raw.metadata()

    def crc32(self) -> int:
        return self.raw.crc32()

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            span = self.spans[name]
            out[name] = to_tensor(self._read_range(name, span.start, span.end), span)
        return out

    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            span, info = self.spans[name], self._tensors()[1][name]
            start, end = span.start + first * info.row_bytes, span.start + stop * info.row_bytes
            part = Span(span.code, (stop - first, *span.shape[1:]), start, end)
            out[name] = to_tensor(self._read_range(name, start, end), part)
        return out

    def gather(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """The rows at ``offsets``, from the blocks that hold them (each decoded once, the
        missing ones together, in parallel): NumPy over all the rows at once, then one
        copy per block touched; a row across two blocks (no reader of the store asks one:
        blocks hold whole rows) is read as a range."""
        out = np.empty((len(offsets), width), dtype=np.uint8)
        if not width or not len(offsets):
            return out
        table = self._table()
        offsets = np.asarray(offsets, dtype=np.int64)
        tensor = np.searchsorted(table.starts, offsets, side="right") - 1
        local = offsets - table.starts[tensor]
        outside = (tensor < 0) | (local + width > table.nbytes[tensor])
        if outside.any():
            name = table.names[max(int(tensor[np.argmax(outside)]), 0)]
            raise StoreError(f"bytes asked of shard {self} lie outside its tensor {name!r}")
        size = table.block_bytes[tensor]  # > 0: a tensor of no bytes has nothing inside
        first = local // size
        within = local - first * size
        inside = within + width <= size  # and within its block's bytes: within the tensor's
        number = table.first_block[tensor] + first  # the block's number in the shard
        rows = np.flatnonzero(inside)
        order = rows[np.argsort(number[rows], kind="stable")]  # the rows, block by block
        heads = np.flatnonzero(np.diff(number[order], prepend=-1))  # each block's first
        ends = [*heads[1:].tolist(), len(order)][: len(heads)]
        blocks = self._decoded(number[order[heads]].tolist(), table)
        aligned = not (within[rows] % width).any()
        place = (within[order] // width) if aligned else within[order]
        taken = np.empty((len(order), width), np.uint8)  # the rows block by block
        for start, end, data in zip(heads.tolist(), ends, blocks, strict=True):
            if not aligned:
                view = byte_rows(data, width)
            elif data.size % width:  # whole rows of the block, and a part of one
                view = data[: data.size - data.size % width].reshape(-1, width)
            else:  # whole rows of the block: a reshape, no strided view
                view = data.reshape(-1, width)
            view.take(place[start:end], axis=0, out=taken[start:end])
        out[order] = taken  # in the order asked
        for row in np.flatnonzero(~inside).tolist():
            name = table.names[int(tensor[row])]
            start = int(offsets[row])
            out[row] = np.frombuffer(self._read_range(name, start, start + width), np.uint8)
        return out

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Bytes of the tensors as if uncompressed (each range within one tensor)."""
        out = []
        for start, end in ranges:
            named = [n for n, s in self.spans.items() if s.start <= start and end <= s.end]
            if not named:
                raise StoreError(f"bytes {start}..{end} of shard {self} lie outside its tensors")
            out.append(self._read_range(named[-1], start, end))
        return out

    def _read_range(self, name: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` (virtual) of the tensor ``name``, from its blocks."""
        span, info = self.spans[name], self._tensors()[1][name]
        if end <= start:
            return memoryview(b"")
        size = info.block_bytes
        first, last = (start - span.start) // size, (end - 1 - span.start) // size
        blocks = self._blocks(name, list(range(first, last + 1)))
        joined = np.concatenate([blocks[b] for b in range(first, last + 1)])
        skip = start - span.start - first * size
        return memoryview(joined[skip : skip + end - start].tobytes())

    def _blocks(self, name: str, blocks: list[int]) -> dict[int, np.ndarray]:
        """The decoded ``blocks`` of ``name``."""
        table = self._table()
        first = table.first_block[table.numbers[name]]
        decoded = self._decoded([first + block for block in blocks], table)
        return dict(zip(blocks, decoded, strict=True))

    def _decoded(self, wanted: list[int], table: _Table) -> list[np.ndarray]:
        """The decoded blocks ``wanted`` (numbers in the shard): those kept, and the others
        fetched together (one :meth:`Shard.read_ranges`) and decoded in parallel."""
        found = self.kept.get_many([table.keys[number] for number in wanted])
        todo = sorted({w for w, data in zip(wanted, found, strict=True) if data is None})
        decoded: dict[int, np.ndarray] = {}
        if todo:
            shuffle, coded, _ = self._tensors()
            places = [table.keys[number][1:] for number in todo]  # (tensor, block)
            ranges = [self._physical[name][b : b + 2] for name, b in places]
            sizes = [coded[name].block_size(block) for name, block in places]

            def decode(job: tuple[tuple[str, int], memoryview, np.ndarray | None]) -> np.ndarray:
                (name, block), raw, into = job
                where = f"shard {self} tensor {name!r} block {block}"
                return decode_block(raw, coded[name], block, shuffle, where, into=into)

            raws = self.raw.read_ranges([(start, end) for start, end in ranges])
            jobs = list(zip(places, raws, self.kept.make_room(sizes), strict=True))
            decoded = dict(zip(todo, parallel_map(decode, jobs, nbytes=sum(sizes)), strict=True))
            for number, data in decoded.items():
                self.kept.put(table.keys[number], data)
        return [decoded[w] if data is None else data for w, data in zip(wanted, found, strict=True)]

    def _table(self) -> _Table:
        """The tensors as arrays, for :meth:`gather` (made once)."""
        if self._arrays is None:
            _, coded, spans = self._tensors()
            names = list(spans)
            blocks = [len(coded[name].sizes) for name in names]
            self._arrays = _Table(
                names=names,
                numbers={name: number for number, name in enumerate(names)},
                keys=[(self.name, n, b) for n in names for b in range(len(coded[n].sizes))],
                starts=np.array([spans[name].start for name in names], dtype=np.int64),
                nbytes=np.array([coded[name].nbytes for name in names], dtype=np.int64),
                block_bytes=np.array(
                    [max(coded[name].block_bytes, 1) for name in names], dtype=np.int64
                ),
                first_block=np.cumsum([0, *blocks[:-1]], dtype=np.int64),
            )
        return self._arrays

    def check_blocks(self) -> None:
        """Decode every block (each checked against its checksum): a :class:`StoreError`
        naming the first damaged one."""
        for name, info in self._tensors()[1].items():
            for block in range(len(info.sizes)):
                self._blocks(name, [block])
