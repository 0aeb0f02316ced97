"""The commit points: what a ledger's bytes and a commit record's bytes mean.

A shard counts once its record is committed, in one of two ways: a line appended to its
rank's ledger ``ledger-r{rank:03d}.jsonl`` (on disk: :func:`scan_ledger`), or a commit
record object of its own, ``commits/r{rank:03d}-{seq:06d}.json`` (on object storage:
:func:`read_commit_record`). Both are read wherever a store lives (a store copied between
disk and object storage keeps its own); the backends read, append and repair them, and
every committed record reaches the rest of the store as a :class:`LedgerEntry`.

Rules every reader and writer of a ledger follows (all enforced here):

- **Records.** Each line is a shard's record, checked as :mod:`lightning_iocatch.store.records`
  says (its ``record_crc32``, and from format ``/3`` on its batches' index summaries).
- **The last line.** A ledger line is committed once it is complete. The last line of a
  ledger may lack its newline: if it starts with a complete JSON value it counts (and must
  be a valid record and nothing else, like every other line); if it does not (a write cut
  short: a prefix of a line), it does not count. The reader and the writer's resume
  (which then adds the newline or cuts the torn line off) decide with :func:`scan_ledger`,
  so they never disagree about a record. Every other line must be a valid record: a
  damaged line is an error naming the ledger and line, never skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import ledger_rank, shard_name, shard_rank_and_seq
from lightning_iocatch.store.records import ShardRecord, parse_record

__all__ = ["LedgerEntry", "LedgerScan", "read_commit_record", "record_line", "scan_ledger"]

_JSON = json.JSONDecoder()


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


# Checksums of shards


def record_line(record: ShardRecord) -> bytes:
    """The bytes that commit ``record``: a ledger line, a commit record, a manifest's line."""
    return (record.to_json() + "\n").encode("ascii")


def read_commit_record(
    where: str, named: tuple[int, int], data: bytes, version: int
) -> LedgerEntry:
    """The commit record ``data`` of the shard ``named`` ``(rank, seq)``, read at ``where``
    (a store of format ``/{version}``), once valid; damage is a :class:`StoreError`."""
    try:
        record = ShardRecord.from_json(data.decode("utf-8"), version=version)
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
        raise StoreError(f"commit record {where} is damaged: {error}") from error
    if record.file != shard_name(*named):
        raise StoreError(
            f"commit record {where} is damaged: it records {record.file}, not {shard_name(*named)}"
        )
    return LedgerEntry(where, 0, record)
