"""The ledger of a feature store: one checksummed record per committed shard, appended.

Each rank appends to its own ``ledger-r{rank:03d}.jsonl`` one JSON line per shard, once the
shard is complete under its final name (see :mod:`lightning_iocatch.store.names` for the
directory): the line is the store's commit point. A shard without one does not exist.

Rules every reader and writer of the ledger follows (all enforced here):

- **Records.** Each line is a shard's record, checked as :mod:`lightning_iocatch.store.records`
  says (its ``record_crc32``, and from format ``/3`` on its batches' index summaries).
- **The last line.** A ledger line is committed once it is complete. The last line of a
  ledger may lack its newline: if it starts with a complete JSON value it counts (and must
  be a valid record and nothing else, like every other line); if it does not (a write cut
  short: a prefix of a line), it does not count. :func:`read_ledgers` and
  :func:`drop_torn_tail` (the writer's resume, which then adds the newline or cuts the
  torn line off) decide with the same function, so a reader and a resumed writer never
  disagree about a record. Every other line must be a valid record: a damaged line is an
  error naming the ledger and line, never skipped.
- **Shard checksums.** A record's ``crc32`` is that of its shard's bytes
  (:func:`file_crc32`).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import (
    check_own_path,
    fsync_dir,
    ledger_rank,
    open_own_file,
    read_store_json,
    shard_rank_and_seq,
    write_all,
)
from lightning_iocatch.store.records import ShardRecord, format_version, parse_record

__all__ = [
    "LedgerEntry",
    "LedgerScan",
    "append_ledger",
    "drop_torn_tail",
    "file_crc32",
    "read_ledger_entries",
    "read_ledgers",
    "scan_ledger",
]

_JSON = json.JSONDecoder()


# The ledger


def append_ledger(path: Path, record: ShardRecord) -> None:
    """Append one line and make it durable before returning.

    ``path`` must be a ledger name inside the store; a symbolic link there is refused.
    """
    root = path.parent
    created = not os.path.lexists(path)
    with open_own_file(root, path.name, "ab") as handle:
        write_all(handle, (record.to_json() + "\n").encode("ascii"))
        os.fsync(handle.fileno())
    if created:
        fsync_dir(root)


@dataclass(frozen=True)
class LedgerEntry:
    """A committed record and where it was read: the ledger file and its line number, or
    (``line`` 0) the URL of its commit record object on object storage."""

    path: Path | str
    line: int
    record: ShardRecord

    @property
    def where(self) -> str:
        return f"{self.path} line {self.line}" if self.line else f"commit record {self.path}"

    @property
    def commit_order(self) -> tuple[int, int]:
        """``(rank, sequence number)`` of its shard: the order in which a store reads commits."""
        named = shard_rank_and_seq(self.record.file)
        if named is None:  # a parsed record names a shard: this is a bug, not damage
            raise StoreError(f"{self.record.file!r} is not a shard name")
        return named


@dataclass(frozen=True)
class LedgerScan:
    """What a ledger's bytes hold: its counted records and where they end."""

    entries: list[LedgerEntry]
    end: int  # bytes that hold counted lines (the last one perhaps without its newline)
    unterminated: bool  # the last counted line lacks its newline
    torn: bool  # bytes after ``end`` are a write cut short


def scan_ledger(path: Path, data: bytes, *, version: int) -> LedgerScan:
    """The one decision of what a ledger holds, for the reader and the resume alike."""
    rank = ledger_rank(path.name)
    entries: list[LedgerEntry] = []
    position = number = 0
    while position < len(data):
        number += 1
        newline = data.find(b"\n", position)
        last = newline == -1
        end = len(data) if last else newline
        raw = data[position:end]
        text = raw.decode("utf-8", errors="surrogateescape")  # bad bytes: checked below
        try:
            value, stop = _JSON.raw_decode(text)
        except ValueError as error:
            if last:  # an unterminated line that is not a JSON value: a write cut short
                return LedgerScan(entries, position, unterminated=False, torn=True)
            problem = _utf8_problem(raw) or f"it is not JSON ({error})"
            raise StoreError(f"{path} line {number} is damaged: {problem}") from error
        if stop != len(text):  # a write cut short is a prefix of a line, never more than one
            raise StoreError(
                f"{path} line {number} is damaged: it is not JSON (extra data after character "
                f"{stop}: {text[stop : stop + 20]!r})"
            )
        if bad_bytes := _utf8_problem(raw):
            raise StoreError(f"{path} line {number} is damaged: {bad_bytes}")
        try:
            record = parse_record(value, version=version)
        except ValueError as error:
            raise StoreError(f"{path} line {number} is damaged: {error}") from error
        if record.rank != rank:
            raise StoreError(
                f"{path} line {number} is damaged: it records {record.file}, a shard of rank "
                f"{record.rank}, in the ledger of rank {rank}"
            )
        entries.append(LedgerEntry(path, number, record))
        position = end if last else end + 1
    unterminated = bool(data) and not data.endswith(b"\n")
    return LedgerScan(entries, len(data), unterminated=unterminated, torn=False)


def _utf8_problem(raw: bytes) -> str | None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"it is not valid UTF-8 ({error})"
    return None


def _version(root: Path) -> int:
    return format_version(read_store_json(root)["format"])


def _ledger_paths(root: Path) -> list[Path]:
    found = sorted(
        (rank, entry.name)
        for entry in os.scandir(root)
        if (rank := ledger_rank(entry.name)) is not None
    )
    return [check_own_path(root, name) for _, name in found]


def read_ledger_entries(root: Path) -> list[LedgerEntry]:
    """Every committed record of every rank with its ledger line, in rank then ledger order.

    Raises :class:`StoreError` naming the ledger and line for any damage (see the module
    docstring for what counts as committed).
    """
    version = _version(root)
    entries: list[LedgerEntry] = []
    for path in _ledger_paths(root):
        try:
            with open_own_file(root, path.name, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise StoreError(f"cannot read ledger {path}: {error}") from error
        entries += scan_ledger(path, data, version=version).entries
    return entries


def read_ledgers(root: Path) -> list[ShardRecord]:
    """Every committed shard of every rank, in rank then ledger order.

    A torn last line (the process died while appending it) does not count; a complete last
    line without its newline does. Damage anywhere is an error naming the file and line.
    """
    return [entry.record for entry in read_ledger_entries(root)]


def drop_torn_tail(path: Path) -> None:
    """Make a ledger end in a newline before appending to it, keeping every committed line.

    A torn last line (one that :func:`read_ledgers` does not count) is cut off; a complete
    last line without its newline (which it does count) gets its newline.
    """
    root = path.parent
    if not os.path.lexists(path):
        return
    version = _version(root)
    with open_own_file(root, path.name, "r+b") as handle:
        data = handle.read()
        scan = scan_ledger(path, data, version=version)
        if scan.torn:
            handle.truncate(scan.end)
        elif scan.unterminated:
            handle.seek(len(data))
            write_all(handle, b"\n")
        else:
            return
        os.fsync(handle.fileno())


# Checksums of shards


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc
