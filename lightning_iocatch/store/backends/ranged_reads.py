"""Shards on object storage, read with ranged requests: headers first, then only the tensors asked.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte offsets) and the tensors' bytes. Opening a remote store
(:func:`open_remote_shards`) reads, per committed shard, a first range sized from its
commit record to hold its header and its batches' ``__index__`` tensors (these follow the
header when no stored key is wider than 8 bytes; a longer header or indices elsewhere take
one more request); tensors are then read with ranged requests of their bytes
(:func:`read_tensors`, :func:`read_rows`; two ranges of a shard less than 64 KiB apart are
read as one, so a read holds at most 64 KiB between the tensors asked), never a whole shard
unless asked (:func:`shard_crc32`). Every range goes through the filesystem's
``cat_ranges``, which asynchronous filesystems (s3fs, gcsfs) answer concurrently; an empty
range (a tensor with no elements) is not requested.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.location import ObjectLocation, remote_error, remote_request
from lightning_iocatch.store.ledger import LedgerEntry
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.shard_file import STORABLE_DTYPES
from lightning_iocatch.store.stored_batches import check_header

__all__ = [
    "OpenedShard",
    "RemoteShard",
    "open_remote_shards",
    "read_rows",
    "read_tensors",
    "shard_crc32",
]

_MERGE_GAP = 64 << 10  # two wanted ranges of one shard this close are read as one
_CODES = {code: dtype for dtype, code in STORABLE_DTYPES.items()}
if hasattr(torch, "float8_e8m0fnu"):
    _CODES["F8_E8M0"] = torch.float8_e8m0fnu


@dataclass(frozen=True)
class _Span:
    code: str  # the safetensors dtype code
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the object
    end: int


@dataclass(frozen=True, eq=False)
class RemoteShard:
    """A committed shard object and its parsed header; compared by identity."""

    location: ObjectLocation
    name: str
    size: int
    spans: dict[str, _Span]

    def header(self) -> dict[str, tuple[str, list[int]]]:
        """Tensor name -> (safetensors dtype code, shape), as :func:`check_header` takes."""
        return {name: (span.code, list(span.shape)) for name, span in self.spans.items()}

    def __str__(self) -> str:
        return self.location.url_of(self.name)


@dataclass(frozen=True)
class OpenedShard:
    """A shard as opened: its header checked against its record, its batches' indices."""

    shard: RemoteShard
    stored: list[dict[str, tuple[int, ...]]]  # per batch: key -> stored shape
    indices: list[torch.Tensor]  # per batch: int64 dataset indices


def open_remote_shards(
    location: ObjectLocation, entries: Sequence[LedgerEntry], listing: dict[str, int]
) -> dict[str, OpenedShard]:
    """Each committed shard by name, once present with its recorded size and a header that
    agrees with its record; ``listing`` is the prefix's listing (name -> size)."""
    first: dict[str, LedgerEntry] = {}
    for entry in entries:
        record = entry.record
        if record.file in first:
            raise StoreError(f"shard {record.file} is committed twice: {entry.where} is damaged")
        first[record.file] = entry
        where = location.url_of(record.file)
        if record.file not in listing:
            raise StoreError(f"shard {where} is committed ({entry.where}) but missing")
        if listing[record.file] != record.bytes:
            raise StoreError(
                f"shard {where} is {listing[record.file]} bytes, its commit record says "
                f"{record.bytes} ({entry.where}): it was truncated or replaced"
            )
    names = list(first)
    sizes = [first[name].record.bytes for name in names]
    firsts = [
        (name, 0, min(_first_range(first[name]), size))
        for name, size in zip(names, sizes, strict=True)
    ]
    heads = [bytes(head) for head in _fetch(location, firsts)]
    lengths = [_header_length(location, n, head) for n, head in zip(names, heads, strict=True)]
    short = [(n, len(h), 8 + k) for n, h, k in zip(names, heads, lengths, strict=True)]
    rest = iter(_fetch(location, [r for r in short if r[2] > r[1]]))
    shards, missing = {}, []
    for name, head, length in zip(names, heads, lengths, strict=True):
        if 8 + length > len(head):
            head += bytes(next(rest))
        shard = _parse_header(location, name, first[name].record.bytes, head[8 : 8 + length])
        stored = check_header(shard.header(), first[name], str(shard))
        indices: list[torch.Tensor | None] = []
        for position in range(len(stored)):
            span = shard.spans[f"b{position}/{INDEX_KEY}"]
            if span.end <= len(head):  # already read with the header
                indices.append(_tensor(head[span.start : span.end], span))
            else:
                indices.append(None)
                missing.append((name, position, span))
        shards[name] = (shard, stored, indices)
    fetched = _fetch(location, [(name, span.start, span.end) for name, _, span in missing])
    for (name, position, span), raw in zip(missing, fetched, strict=True):
        shards[name][2][position] = _tensor(raw, span)
    return {
        name: OpenedShard(shard, stored, [i for i in indices if i is not None])
        for name, (shard, stored, indices) in shards.items()
    }


def read_tensors(shard: RemoteShard, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of ``shard``, each read with a ranged request of its bytes."""
    spans = [shard.spans[name] for name in names]
    data = _fetch(shard.location, [(shard.name, s.start, s.end) for s in spans])
    return {name: _tensor(raw, span) for name, span, raw in zip(names, spans, data, strict=True)}


def read_rows(
    shard: RemoteShard, names: Sequence[str], first: int, stop: int
) -> dict[str, torch.Tensor]:
    """Rows ``[first, stop)`` of the tensors ``names`` of ``shard``, with ranged requests."""
    ranges, shapes = [], []
    for name in names:
        span = shard.spans[name]
        row = (span.end - span.start) // span.shape[0] if span.shape and span.shape[0] else 0
        ranges.append((shard.name, span.start + first * row, span.start + stop * row))
        shapes.append(_Span(span.code, (stop - first, *span.shape[1:]), 0, 0))
    data = _fetch(shard.location, ranges)
    return {name: _tensor(raw, span) for name, span, raw in zip(names, shapes, data, strict=True)}


def shard_crc32(shard: RemoteShard, chunk: int = 16 << 20) -> int:
    """CRC-32 of the whole shard object, streamed ``chunk`` bytes at a time."""
    crc = 0
    with (
        remote_request("read", str(shard)),
        shard.location.fs.open(
            shard.location.path(shard.name), "rb", block_size=chunk, cache_type="none"
        ) as handle,
    ):
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


# Parsing and fetching


def _first_range(entry: LedgerEntry) -> int:
    """Bytes to read first: the header (under 100 bytes per tensor besides its name, so the
    estimate is generous) and the batches' indices, which follow it when no key is wider."""
    record = entry.record
    per_batch = 112 + sum(len(key) + 112 for key in record.keys)
    return 1024 + len(record.batches) * per_batch + 8 * sum(b.rows for b in record.batches)


def _header_length(location: ObjectLocation, name: str, head: bytes) -> int:
    if len(head) < 8:
        raise StoreError(f"shard {location.url_of(name)} is corrupted: it has no header")
    return int(struct.unpack("<Q", head[:8])[0])


def _parse_header(location: ObjectLocation, name: str, size: int, raw: bytes) -> RemoteShard:
    where = location.url_of(name)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        spans = {}
        base = 8 + len(raw)
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            code, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dtype = _CODES.get(code)
            if dtype is None:
                raise ValueError(f"{tensor!r} has an unknown dtype {code!r}")
            count = 1
            for size_ in shape:
                count *= int(size_)
            if not 0 <= start <= end <= size - base or end - start != count * dtype.itemsize:
                raise ValueError(f"{tensor!r} has offsets {[start, end]} that do not fit")
            spans[tensor] = _Span(code, shape, base + start, base + end)
    except (ValueError, KeyError, TypeError) as error:
        raise StoreError(f"shard {where} is corrupted: its header is damaged ({error})") from error
    return RemoteShard(location, name, size, spans)


def _fetch(location: ObjectLocation, ranges: Sequence[tuple[str, int, int]]) -> list[memoryview]:
    """The bytes of each ``(name, start, end)``; close ranges of one object read together,
    empty ones not at all (an empty HTTP range cannot be asked for)."""
    wanted = [i for i, (_, start, end) in enumerate(ranges) if end > start]
    if not wanted:
        return [memoryview(b"") for _ in ranges]
    merged: list[tuple[str, int, int]] = []
    owner = [-1] * len(ranges)
    for i in sorted(wanted, key=lambda i: ranges[i]):
        name, start, end = ranges[i]
        if merged and merged[-1][0] == name and start - merged[-1][2] <= _MERGE_GAP:
            merged[-1] = (name, merged[-1][1], max(merged[-1][2], end))
        else:
            merged.append((name, start, end))
        owner[i] = len(merged) - 1
    with remote_request("read", location.url):
        data = location.fs.cat_ranges(
            [location.path(name) for name, _, _ in merged],
            [start for _, start, _ in merged],
            [end for _, _, end in merged],
            on_error="return",
        )
    for (name, start, end), raw in zip(merged, data, strict=True):
        if isinstance(raw, BaseException):
            failure = raw if isinstance(raw, Exception) else OSError(str(raw))
            raise remote_error("read", location.url_of(name), failure)
        if len(raw) != end - start:
            raise StoreError(
                f"shard {location.url_of(name)} changed while it was read: bytes "
                f"{start}..{end} gave {len(raw)}"
            )
    out = []
    for i, (_, start, end) in enumerate(ranges):
        if owner[i] < 0:
            out.append(memoryview(b""))
            continue
        offset = start - merged[owner[i]][1]
        out.append(memoryview(data[owner[i]])[offset : offset + end - start])
    return out


def _tensor(raw: bytes | memoryview, span: _Span) -> torch.Tensor:
    dtype = _CODES[span.code]
    if not raw:
        return torch.empty(span.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(span.shape)
