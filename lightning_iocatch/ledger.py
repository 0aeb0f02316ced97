"""The on-disk format of a feature store: file names, atomic writes, the append-only ledger.

A store is a directory::

    store.json                      what was captured, how, with which library versions
    shard-r{rank}-{seq}.safetensors captured tensors: "b{j}/{key}" and "b{j}/__index__"
    ledger-r{rank}.jsonl            one JSON line per complete shard, appended after it

A shard exists under its final name only once complete (written to ``.tmp``, fsynced,
renamed), and counts only once its ledger line is written. Anything else in the
directory (a ``.tmp`` file, a shard without a ledger line) is debris of an interrupted run.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_iocatch.errors import StoreError

__all__ = [
    "FORMAT",
    "INDEX_KEY",
    "STORE_FILE",
    "BatchRecord",
    "ShardRecord",
    "append_ledger",
    "drop_torn_tail",
    "fsync_dir",
    "file_crc32",
    "is_store_file",
    "ledger_name",
    "read_ledgers",
    "read_store_json",
    "shard_name",
    "shard_crc32",
    "shard_rank_and_seq",
    "write_json_atomic",
]

FORMAT = "lightning-iocatch-store/1"
STORE_FILE = "store.json"
INDEX_KEY = "__index__"
_SHARD = re.compile(r"shard-r(\d+)-(\d+)\.safetensors(\.tmp)?$")
_LEDGER = re.compile(r"ledger-r(\d+)\.jsonl$")


def shard_name(rank: int, seq: int) -> str:
    """The file name of a rank's ``seq``-th shard."""
    return f"shard-r{rank:03d}-{seq:06d}.safetensors"


def ledger_name(rank: int) -> str:
    """The file name of a rank's ledger."""
    return f"ledger-r{rank:03d}.jsonl"


def is_store_file(name: str) -> bool:
    """True for every name a store writes (its own files, finished or not)."""
    return name in (STORE_FILE, STORE_FILE + ".tmp") or bool(
        _SHARD.match(name) or _LEDGER.match(name)
    )


def shard_rank_and_seq(name: str) -> tuple[int, int] | None:
    """``(rank, seq)`` of a finished shard's file name, else ``None``."""
    match = _SHARD.match(name)
    if match is None or match.group(3):
        return None
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class BatchRecord:
    """One batch inside a shard: tensors ``b{position}/...``, ``rows`` samples."""

    dataloader_idx: int
    batch_idx: int
    rows: int


@dataclass(frozen=True)
class ShardRecord:
    """One ledger line: a complete shard, its size and checksum, its batches and keys."""

    file: str
    rank: int
    bytes: int
    crc32: int
    batches: tuple[BatchRecord, ...]
    keys: dict[str, str]  # key -> dtype
    shapes: dict[str, list[int] | None]  # key -> shape of a row; None where batches differ

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> ShardRecord:
        data = json.loads(line)
        batches = tuple(BatchRecord(**batch) for batch in data.pop("batches"))
        return cls(batches=batches, **data)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path``: a temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_store_json(root: Path) -> dict[str, Any]:
    """The store's ``store.json``; a clear error when ``root`` is not a store."""
    path = root / STORE_FILE
    if not path.is_file():
        raise StoreError(
            f"{root} is not a feature store: it has no {STORE_FILE} (stores are written by "
            "lightning_iocatch.FeatureWriter)"
        )
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise StoreError(f"cannot read {path}: {error}") from error
    if data.get("format") != FORMAT:
        raise StoreError(f"{path} has format {data.get('format')!r}; this library reads {FORMAT!r}")
    return data


def append_ledger(path: Path, record: ShardRecord) -> None:
    """Append one line and make it durable before returning."""
    with open(path, "a") as handle:
        handle.write(record.to_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_ledgers(root: Path) -> list[ShardRecord]:
    """Every committed shard of every rank, in rank then ledger order.

    A torn last line (the process died while appending it) does not count; a torn line
    anywhere else means the ledger was damaged, and is an error naming the file.
    """
    records: list[ShardRecord] = []
    for path in sorted(root.glob("ledger-r*.jsonl")):
        lines = path.read_text().split("\n")
        for number, line in enumerate(lines, start=1):
            if not line:
                continue
            try:
                records.append(ShardRecord.from_json(line))
            except (ValueError, TypeError, KeyError) as error:
                if number == len(lines):  # the unterminated last line: a write cut short
                    continue
                raise StoreError(f"{path} line {number} is damaged: {error}") from error
    return records


def shard_crc32(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """CRC-32 of a safetensors file just written from ``tensors``, without reading its data.

    The header comes from the file; the data bytes from the tensors in memory, in the
    file's order. Equal to :func:`file_crc32` of the file (which reads it all back).
    """
    with open(path, "rb") as handle:
        head = handle.read(8)
        header_bytes = handle.read(struct.unpack("<Q", head)[0])
    header = json.loads(header_bytes)
    crc = zlib.crc32(header_bytes, zlib.crc32(head))
    position = 0
    for name, info in sorted(
        ((name, info) for name, info in header.items() if name != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][0],
    ):
        begin, end = info["data_offsets"]
        if begin != position:  # not back to back: read the file instead
            return file_crc32(path)
        raw = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        crc = zlib.crc32(raw.data, crc)
        position = end
    return crc


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def drop_torn_tail(path: Path) -> None:
    """Cut an unterminated last line off a ledger, so that appending starts a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
