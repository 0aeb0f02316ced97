"""Shards on object storage, read with ranged requests: headers first, then only the tensors asked.

Opening a remote store requests nothing from its shards (:func:`open_remote_shards` checks
them against the listing); a :class:`RemoteShard` reads its header on first use, with a
first range sized from its commit record (a longer header takes one more request;
:func:`load_headers` reads many at once), and then reads tensors and rows with ranged
requests of their bytes (two ranges of a shard less than 64 KiB apart are read as one, so a
read holds at most 64 KiB between the tensors asked), never a whole shard unless asked
(:meth:`RemoteShard.crc32`). Every range goes through the filesystem's ``cat_ranges``,
which asynchronous filesystems (s3fs, gcsfs) answer concurrently; an empty range (a tensor
with no elements) is not requested.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard, check_committed_shards
from lightning_iocatch.store.backends.object_location import (
    ObjectLocation,
    remote_error,
    remote_request,
)
from lightning_iocatch.store.backends.safetensors_layout import (
    Span,
    header_length,
    header_metadata,
    parse_header,
    row_range,
    to_tensor,
)
from lightning_iocatch.store.commits import LedgerEntry

__all__ = ["RemoteShard", "load_headers", "open_remote_shards"]


_MERGE_GAP = 64 << 10  # two wanted ranges of one shard this close are read as one


def _header_guess(entry: LedgerEntry) -> int:
    """Bytes that hold a shard's header: under 100 bytes per tensor besides its name, so the
    guess is generous; a longer header takes one more request."""
    record = entry.record
    return 1024 + len(record.batches) * (112 + sum(len(key) + 112 for key in record.keys))


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


class RemoteShard(Shard):
    """A committed shard object; its header is read on first use (or by
    :func:`load_headers` for many shards at once), then kept as parsed spans."""

    def __init__(
        self, location: ObjectLocation, entry: LedgerEntry, guess: int, checked: bool
    ) -> None:
        self.location, self.name = location, entry.record.file
        self.size, self.where = entry.record.bytes, entry.where  # as its record says
        self._guess = min(guess, self.size)  # bytes that likely hold the whole header
        self._spans: dict[str, Span] | None = None
        self._metadata: dict[str, str] = {}
        self._checked = checked  # its size was seen in a listing

    def check_size(self) -> None:
        """A :class:`StoreError` unless the object is there with its recorded size."""
        path = self.location.path(self.name)
        try:
            with remote_request("read", str(self)):
                self.location.fs.invalidate_cache(path)
                size = self.location.fs.size(path)
        except StoreError as error:
            if isinstance(error.__cause__, FileNotFoundError):
                raise StoreError(f"shard {self} is committed ({self.where}) but missing") from None
            raise
        if size != self.size:
            raise StoreError(
                f"shard {self} is {size} bytes, its record says {self.size} ({self.where}): it "
                "was truncated or replaced"
            )

    def __str__(self) -> str:
        return self.location.url_of(self.name)

    @property
    def spans(self) -> dict[str, Span]:
        if self._spans is None:
            load_headers([self])
        assert self._spans is not None
        return self._spans

    def header(self) -> dict[str, tuple[str, list[int]]]:
        return {name: (span.code, list(span.shape)) for name, span in self.spans.items()}

    def metadata(self) -> dict[str, str]:
        self.spans  # noqa: B018 (reads the header once)
        return self._metadata

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        return _fetch_from([self], [(self.name, start, end) for start, end in ranges])

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return self._read(names, [self.spans[name] for name in names])

    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        return self._read(names, [row_range(self.spans[name], first, stop) for name in names])

    def gather(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """One ranged read per run of adjacent rows (close runs merged by the fetch)."""
        if not width or not len(offsets):
            return np.empty((len(offsets), width), dtype=np.uint8)
        order = np.argsort(offsets, kind="stable")
        ordered = offsets[order]
        cuts = np.flatnonzero(np.diff(ordered) != width) + 1
        firsts = ordered[np.r_[0, cuts]].tolist()
        ends = (ordered[np.r_[cuts - 1, len(ordered) - 1]] + width).tolist()
        data = _fetch_from([self], [(self.name, a, z) for a, z in zip(firsts, ends, strict=True)])
        joined = np.concatenate([np.frombuffer(piece, dtype=np.uint8) for piece in data])
        out = np.empty((len(offsets), width), dtype=np.uint8)
        out[order] = joined.reshape(len(offsets), width)
        return out

    def _read(self, names: Sequence[str], spans: list[Span]) -> dict[str, torch.Tensor]:
        data = _fetch_from([self], [(self.name, span.start, span.end) for span in spans])
        return {n: to_tensor(raw, span) for n, span, raw in zip(names, spans, data, strict=True)}

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
    location: ObjectLocation, entries: Sequence[LedgerEntry], sizes: Mapping[str, int] | None
) -> dict[str, Shard]:
    """Each committed shard by name, once there with its recorded size where ``sizes`` (a
    listing of the prefix) are given; else that is checked when a read of it fails (a
    missing or shorter object fails every read). Nothing is requested."""
    check_committed_shards(entries, None if sizes is None else sizes.get, location.url_of)
    return {
        entry.record.file: RemoteShard(location, entry, _header_guess(entry), sizes is not None)
        for entry in entries
    }


def _fetch_from(
    shards: Sequence[RemoteShard], ranges: Sequence[tuple[str, int, int]]
) -> list[memoryview]:
    """:func:`_fetch` of ranges of ``shards``; a failure names a shard that is missing or
    not of its recorded size, where one is."""
    try:
        return _fetch(shards[0].location, ranges)
    except StoreError:
        for shard in shards:
            if not shard._checked:
                shard.check_size()
        raise


def load_headers(shards: Sequence[RemoteShard]) -> None:
    """Read and parse the headers of ``shards`` not read yet, in one ``cat_ranges`` (and one
    more for headers longer than guessed)."""
    todo = [shard for shard in shards if shard._spans is None]
    if not todo:
        return
    location = todo[0].location
    heads = [bytes(h) for h in _fetch_from(todo, [(s.name, 0, s._guess) for s in todo])]
    lengths = [header_length(h, location.url_of(s.name)) for s, h in zip(todo, heads, strict=True)]
    longer = [(s.name, len(h), 8 + n) for s, h, n in zip(todo, heads, lengths, strict=True)]
    rest = iter(_fetch_from(todo, [r for r in longer if r[2] > r[1]]))
    for shard, head, length in zip(todo, heads, lengths, strict=True):
        if 8 + length > len(head):
            head += bytes(next(rest))
        where = location.url_of(shard.name)
        shard._spans = parse_header(head[8 : 8 + length], shard.size, where)
        shard._metadata = header_metadata(head[8 : 8 + length], where)
