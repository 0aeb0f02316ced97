"""The ledger of a feature store: one checksummed record per committed shard, appended.

Each rank appends to its own ``ledger-r{rank:03d}.jsonl`` one JSON line per shard, once the
shard is complete under its final name (see :mod:`lightning_iocatch.store_files` for the
directory): the line is the store's commit point. A shard without one does not exist.

Rules every reader and writer of the ledger follows (all enforced here):

- **Record checksums.** Each ledger line carries ``record_crc32``: the CRC-32 of the
  line's JSON object without that field, serialized canonically (keys sorted, no
  whitespace, ASCII: ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``). Format
  ``/2`` stores require it on every line; format ``/1`` stores (written before it existed)
  accept lines without it and check the lines that have it.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store_files import (
    INDEX_KEY,
    READABLE_FORMATS,
    check_own_path,
    fsync_dir,
    ledger_rank,
    open_own_file,
    read_store_json,
    shard_name,
    shard_rank_and_seq,
    write_all,
)

__all__ = [
    "RECORD_CHECKSUM",
    "BatchRecord",
    "LedgerEntry",
    "LedgerScan",
    "ShardRecord",
    "append_ledger",
    "drop_torn_tail",
    "file_crc32",
    "read_ledger_entries",
    "read_ledgers",
    "scan_ledger",
]

RECORD_CHECKSUM = "record_crc32"
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class BatchRecord:
    """One batch inside a shard: tensors ``b{position}/...``, ``rows`` rows.

    ``without_rows``: dataset indices of samples written with no row (token rows of a
    sample without a selected token), so that they count as stored.
    """

    dataloader_idx: int
    batch_idx: int
    rows: int
    without_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShardRecord:
    """One ledger line: a complete shard, its size and checksum, its batches and keys.

    ``keys`` maps every key stored in the shard (in some or all of its batches) to its
    dtype; ``shapes`` gives a key's row shape (``None`` where batches differ). Keys in
    ``per_batch`` are stored once per batch, without a row per sample: their ``shapes``
    entry is the whole tensor's shape. ``skipped`` maps keys the writer did not store to
    the reason. The line itself carries ``record_crc32`` (see the module docstring).
    """

    file: str
    rank: int
    bytes: int
    crc32: int
    batches: tuple[BatchRecord, ...]
    keys: dict[str, str]  # key -> dtype
    shapes: dict[str, list[int] | None]  # key -> shape of a row; None where batches differ
    per_batch: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        """The ledger line (without its newline), with its ``record_crc32``."""
        data = asdict(self)
        for optional in ("per_batch", "skipped"):
            if not data[optional]:
                del data[optional]
        for batch in data["batches"]:
            if not batch["without_rows"]:
                del batch["without_rows"]
        data[RECORD_CHECKSUM] = _record_crc32(data)
        return _canonical(data)

    @classmethod
    def from_json(cls, line: str, *, checksum_required: bool = True) -> ShardRecord:
        """Parse and check one ledger line; ``ValueError`` says what is wrong with it."""
        return _record(json.loads(line), checksum_required=checksum_required)


def _canonical(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _record_crc32(data: dict[str, Any]) -> int:
    return zlib.crc32(_canonical(data).encode("ascii"))


_FIELDS = ("file", "rank", "bytes", "crc32", "batches", "keys", "shapes")
_BATCH_FIELDS = ["batch_idx", "dataloader_idx", "rows"]
_OPTIONAL = ("per_batch", "skipped", RECORD_CHECKSUM)


def _count(value: Any, what: str, below: int | None = None) -> int:
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _record(data: Any, *, checksum_required: bool) -> ShardRecord:
    if not isinstance(data, dict):
        raise ValueError(f"not a record: a JSON {type(data).__name__}, not an object")
    if RECORD_CHECKSUM in data:
        check = data.pop(RECORD_CHECKSUM)
        if check != _record_crc32(data):
            raise ValueError(
                f"its {RECORD_CHECKSUM} does not match its content: the line was changed "
                "after it was written"
            )
    elif checksum_required:
        raise ValueError(f"it has no {RECORD_CHECKSUM}, which this store's format requires")
    unknown = sorted(set(data) - {*_FIELDS, *_OPTIONAL})
    missing = [name for name in _FIELDS if name not in data]
    if unknown or missing:
        raise ValueError(f"not a record: unknown fields {unknown}, missing fields {missing}")
    name = data["file"]
    named = shard_rank_and_seq(name) if isinstance(name, str) else None
    if named is None:
        raise ValueError(
            f"`file` {name!r} is not a shard name like {shard_name(0, 0)!r}; a store reads "
            "only its own files inside its directory"
        )
    rank = _count(data["rank"], "`rank`")
    if named[0] != rank:
        raise ValueError(f"`file` {name!r} is not a shard of rank {rank}")
    batches = data["batches"]
    if not isinstance(batches, list) or not batches:
        raise ValueError(f"`batches` must be a non-empty list, got {batches!r}")
    parsed = []
    for batch in batches:
        fields = sorted(batch) if isinstance(batch, dict) else None
        if fields not in (_BATCH_FIELDS, sorted([*_BATCH_FIELDS, "without_rows"])):
            shape = "{dataloader_idx, batch_idx, rows[, without_rows]}"
            raise ValueError(f"a batch must be {shape}, got {batch!r}")
        without = batch.get("without_rows", [])
        if not isinstance(without, list) or (not without and "without_rows" in batch):
            raise ValueError(f"`without_rows` must be a non-empty list, got {without!r}")
        counts = {k: _count(batch[k], f"`{k}`") for k in _BATCH_FIELDS}
        samples = tuple(_count(index, "an index of `without_rows`") for index in without)
        parsed.append(BatchRecord(**counts, without_rows=samples))
    keys, shapes = data["keys"], data["shapes"]
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and k != INDEX_KEY and isinstance(v, str) for k, v in keys.items()
    ):
        raise ValueError(f"`keys` must map keys to dtype names, got {keys!r}")
    if not isinstance(shapes, dict) or not all(
        k in keys and (v is None or (isinstance(v, list) and all(_is_count(d) for d in v)))
        for k, v in shapes.items()
    ):
        raise ValueError(f"`shapes` must map keys of `keys` to lists of sizes or null: {shapes!r}")
    per_batch = data.get("per_batch", [])
    if not isinstance(per_batch, list) or not all(k in keys for k in per_batch):
        raise ValueError(f"`per_batch` must list keys of `keys`, got {per_batch!r}")
    skipped = data.get("skipped", {})
    if not isinstance(skipped, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in skipped.items()
    ):
        raise ValueError(f"`skipped` must map keys to reasons, got {skipped!r}")
    return ShardRecord(
        file=name,
        rank=rank,
        bytes=_count(data["bytes"], "`bytes`"),
        crc32=_count(data["crc32"], "`crc32`", below=1 << 32),
        batches=tuple(parsed),
        keys=keys,
        shapes=shapes,
        per_batch=tuple(per_batch),
        skipped=skipped,
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


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


def scan_ledger(path: Path, data: bytes, *, checksum_required: bool) -> LedgerScan:
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
            record = _record(value, checksum_required=checksum_required)
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


def _checksum_required(root: Path) -> bool:
    return read_store_json(root)["format"] != READABLE_FORMATS[0]


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
    required = _checksum_required(root)
    entries: list[LedgerEntry] = []
    for path in _ledger_paths(root):
        try:
            with open_own_file(root, path.name, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise StoreError(f"cannot read ledger {path}: {error}") from error
        entries += scan_ledger(path, data, checksum_required=required).entries
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
    required = _checksum_required(root)
    with open_own_file(root, path.name, "r+b") as handle:
        data = handle.read()
        scan = scan_ledger(path, data, checksum_required=required)
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
