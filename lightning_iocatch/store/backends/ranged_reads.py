"""Shards on object storage, read with ranged requests: headers first, then only the tensors asked.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte offsets) and the tensors' bytes. Opening a remote store requests
nothing from its shards (:func:`open_remote_shards` checks them against the listing); a
:class:`RemoteShard` reads its header on first use, with a first range sized from its
commit record (a longer header takes one more request; :func:`load_headers` reads many at
once), and then reads tensors and rows with ranged requests of their bytes (two ranges of
a shard less than 64 KiB apart are read as one, so a read holds at most 64 KiB between the
tensors asked), never a whole shard unless asked (:meth:`RemoteShard.crc32`). Every range goes
through the filesystem's ``cat_ranges``, which asynchronous filesystems (s3fs, gcsfs)
answer concurrently; an empty range (a tensor with no elements) is not requested.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard, check_committed_shards
from lightning_iocatch.store.backends.object_location import (
    ObjectLocation,
    remote_error,
    remote_request,
)
from lightning_iocatch.store.commits import LedgerEntry
from lightning_iocatch.store.shard_file import READABLE_CODES

__all__ = ["RemoteShard", "load_headers", "open_remote_shards"]


_MERGE_GAP = 64 << 10  # two wanted ranges of one shard this close are read as one


@dataclass(frozen=True)
class _Span:
    code: str  # the safetensors dtype code
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the object
    end: int


def _header_guess(entry: LedgerEntry) -> int:
    """Bytes that hold a shard's header: under 100 bytes per tensor besides its name, so the
    guess is generous; a longer header takes one more request."""
    record = entry.record
    return 1024 + len(record.batches) * (112 + sum(len(key) + 112 for key in record.keys))


def _header_length(location: ObjectLocation, name: str, head: bytes) -> int:
    if len(head) < 8:
        raise StoreError(f"shard {location.url_of(name)} is corrupted: it has no header")
    return int(struct.unpack("<Q", head[:8])[0])


def _parse_header(location: ObjectLocation, name: str, size: int, raw: bytes) -> dict[str, _Span]:
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
            dtype = READABLE_CODES.get(code)
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
    return spans


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
    dtype = READABLE_CODES[span.code]
    if not raw:
        return torch.empty(span.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(span.shape)


class RemoteShard(Shard):
    """A committed shard object; its header is read on first use (or by
    :func:`load_headers` for many shards at once), then kept as parsed spans."""

    def __init__(self, location: ObjectLocation, name: str, size: int, guess: int) -> None:
        self.location, self.name, self.size = location, name, size
        self._guess = min(guess, size)  # bytes that likely hold the whole header
        self._spans: dict[str, _Span] | None = None

    def __str__(self) -> str:
        return self.location.url_of(self.name)

    @property
    def spans(self) -> dict[str, _Span]:
        if self._spans is None:
            load_headers([self])
        assert self._spans is not None
        return self._spans

    def header(self) -> dict[str, tuple[str, list[int]]]:
        return {name: (span.code, list(span.shape)) for name, span in self.spans.items()}

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        spans = [self.spans[name] for name in names]
        data = _fetch(self.location, [(self.name, s.start, s.end) for s in spans])
        return {n: _tensor(raw, span) for n, span, raw in zip(names, spans, data, strict=True)}

    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        ranges, shapes = [], []
        for name in names:
            span = self.spans[name]
            row = (span.end - span.start) // span.shape[0] if span.shape and span.shape[0] else 0
            ranges.append((self.name, span.start + first * row, span.start + stop * row))
            shapes.append(_Span(span.code, (stop - first, *span.shape[1:]), 0, 0))
        data = _fetch(self.location, ranges)
        return {n: _tensor(raw, span) for n, span, raw in zip(names, shapes, data, strict=True)}

    def crc32(self, chunk: int = 16 << 20) -> int:
        """CRC-32 of the whole object, streamed ``chunk`` bytes at a time."""
        crc = 0
        path = self.location.path(self.name)
        with (
            remote_request("read", str(self)),
            self.location.fs.open(path, "rb", block_size=chunk, cache_type="none") as handle,
        ):
            while block := handle.read(chunk):
                crc = zlib.crc32(block, crc)
        return crc


def open_remote_shards(
    location: ObjectLocation, entries: Sequence[LedgerEntry], sizes: Mapping[str, int]
) -> dict[str, Shard]:
    """Each committed shard by name, once there with its recorded size (``sizes``: the
    prefix's listing); nothing is requested."""
    check_committed_shards(entries, sizes.get, location.url_of)
    return {
        entry.record.file: RemoteShard(
            location, entry.record.file, entry.record.bytes, _header_guess(entry)
        )
        for entry in entries
    }


def load_headers(shards: Sequence[RemoteShard]) -> None:
    """Read and parse the headers of ``shards`` not read yet, in one ``cat_ranges`` (and one
    more for headers longer than guessed)."""
    todo = [shard for shard in shards if shard._spans is None]
    if not todo:
        return
    location = todo[0].location
    heads = [bytes(h) for h in _fetch(location, [(s.name, 0, s._guess) for s in todo])]
    lengths = [_header_length(location, s.name, h) for s, h in zip(todo, heads, strict=True)]
    longer = [(s.name, len(h), 8 + n) for s, h, n in zip(todo, heads, lengths, strict=True)]
    rest = iter(_fetch(location, [r for r in longer if r[2] > r[1]]))
    for shard, head, length in zip(todo, heads, lengths, strict=True):
        if 8 + length > len(head):
            head += bytes(next(rest))
        shard._spans = _parse_header(location, shard.name, shard.size, head[8 : 8 + length])
