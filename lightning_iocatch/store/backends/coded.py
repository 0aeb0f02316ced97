"""A shard written with a codec, read as the tensors it was given: only the blocks asked decoded.

:class:`CodedShard` wraps a committed shard (on disk or on object storage) whose record names
a codec (see :mod:`lightning_iocatch.store.shard_codec`). Its header and spans are those of
the tensors as written: the spans lie in a virtual address space, the file as it would be
uncompressed, so that a reader that gathers rows by byte offsets (the training reader's
:meth:`gather`) works unchanged. A read of rows fetches the compressed blocks holding them
(one ranged read per run of close blocks on object storage) and decodes those only.

Decoded blocks are kept in a :class:`KeptBlocks`, bounded by bytes (not by count: a small
block of scales or indices costs its bytes, and pushes out no block of data) and shared by
the shards of one reader: a :class:`~lightning_iocatch.FeatureStore` keeps
:data:`KEPT_BYTES`; a shuffled :class:`~lightning_iocatch.StoreRows` sizes it to its shuffle
window (at most :data:`KEPT_BYTES_MAX`), so that a shuffled epoch decodes each block about
once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard
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
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def put(self, key: tuple[str, str, int], data: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks or data.nbytes > self.limit:
                return
            self._blocks[key] = data
            self._bytes += data.nbytes
            self._drop()

    def _drop(self) -> None:
        while self._bytes > self.limit:
            self._bytes -= self._blocks.popitem(last=False)[1].nbytes


class CodedShard(Shard):
    """The shard ``raw``, written with a codec, as the tensors it holds (see the module
    docstring); its CRC-32 is that of the file's (compressed) bytes."""

    def __init__(self, raw: Shard, kept: KeptBlocks | None = None) -> None:
        self.raw, self.name = raw, raw.name
        self._layout: tuple[bool, dict[str, CodedTensor], dict[str, Span]] | None = None
        self._physical: dict[str, list[int]] = {}  # name -> each block's first byte, and end
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
        """The rows at ``offsets``, from the blocks that hold them (each decoded once)."""
        out = np.empty((len(offsets), width), dtype=np.uint8)
        if not width or not len(offsets):
            return out
        names = list(self.spans)
        starts = np.array([self.spans[name].start for name in names], dtype=np.int64)
        tensor = np.searchsorted(starts, offsets, side="right") - 1
        for number in np.unique(tensor).tolist():
            mine = np.flatnonzero(tensor == number)
            name = names[number]
            info, local = self._tensors()[1][name], offsets[mine] - starts[number]
            if local.min() < 0 or int(local.max()) + width > info.nbytes:
                raise StoreError(f"bytes asked of shard {self} lie outside its tensor {name!r}")
            first, last = local // info.block_bytes, (local + width - 1) // info.block_bytes
            inside = first == last
            blocks = self._blocks(name, np.unique(first[inside]).tolist())
            for block, data in blocks.items():
                rows = np.flatnonzero(inside & (first == block))
                out[mine[rows]] = byte_rows(data, width)[local[rows] - block * info.block_bytes]
            for row in np.flatnonzero(~inside).tolist():  # across blocks: read as a range
                start = int(offsets[mine[row]])
                out[mine[row]] = np.frombuffer(
                    self._read_range(name, start, start + width), np.uint8
                )
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
        """The decoded ``blocks`` of ``name``: those kept, and the others fetched together."""
        shuffle, coded, _ = self._tensors()
        kept = ((b, self.kept.get((self.name, name, b))) for b in blocks)
        found = {b: data for b, data in kept if data is not None}
        todo = [b for b in blocks if b not in found]
        bounds = self._physical[name]
        raw = self.raw.read_ranges([(bounds[b], bounds[b + 1]) for b in todo]) if todo else []
        for block, data in zip(todo, raw, strict=True):
            where = f"shard {self} tensor {name!r} block {block}"
            found[block] = decode_block(data, coded[name], block, shuffle, where)
            self.kept.put((self.name, name, block), found[block])
        return found

    def check_blocks(self) -> None:
        """Decode every block (each checked against its checksum): a :class:`StoreError`
        naming the first damaged one."""
        for name, info in self._tensors()[1].items():
            for block in range(len(info.sizes)):
                self._blocks(name, [block])
