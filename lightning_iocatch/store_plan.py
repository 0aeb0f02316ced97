"""Preparing a store for writing: the mode's checks, the resume's clean-up, a shared plan.

:func:`prepare_store` (check the directory against the mode, clean it, write
``store.json``, read what is committed) is the one decision that every writing process
must share: it runs on one process and returns a plain :class:`StorePlan` for the caller
to broadcast to the :class:`~lightning_iocatch.shard_writer.ShardWriter` of every rank.
Nothing here imports Lightning.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.ledger import drop_torn_tail, read_ledger_entries
from lightning_iocatch.store_files import (
    FORMAT,
    INDEX_KEY,
    STORE_FILE,
    check_own_path,
    fsync_dir,
    is_serializer_temp,
    is_store_file,
    ledger_rank,
    read_store_json,
    shard_rank_and_seq,
    write_json_atomic,
)

__all__ = ["MODES", "IndexSet", "Mode", "StorePlan", "prepare_store"]

Mode = Literal["create", "resume", "overwrite"]
MODES: tuple[Mode, ...] = ("create", "resume", "overwrite")

_SERIALIZER_MARK = b'"format":"lightning-iocatch-store/'


class IndexSet:
    """Non-negative integers as a bit array: one bit per index up to the largest one."""

    def __init__(self, bits: bytes = b"") -> None:
        self.bits = bytearray(bits)

    def __contains__(self, index: int) -> bool:
        byte = index >> 3
        return byte < len(self.bits) and bool(self.bits[byte] >> (index & 7) & 1)

    def add(self, index: int) -> None:
        byte = index >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits))))
        self.bits[byte] |= 1 << (index & 7)


@dataclass(frozen=True)
class StorePlan:
    """What :func:`prepare_store` found and decided, for every process to share (it pickles).

    Attributes:
        store_json: the store's metadata as prepared; every process checks that it reads the same.
        committed: per dataloader, the dataset indices already committed, as a bit array.
        next_seq: per rank, the sequence number of its next shard.
        row_keys: keys the store already holds row by row.
        batch_keys: keys the store already holds once per batch.
    """

    store_json: dict[str, Any]
    committed: dict[int, bytes] = field(default_factory=dict)
    next_seq: dict[int, int] = field(default_factory=dict)
    row_keys: frozenset[str] = frozenset()
    batch_keys: frozenset[str] = frozenset()


def _list_dir(path: Path) -> list[str]:
    """The names in the store's directory (one place, so that a test can vary it by rank)."""
    return sorted(os.listdir(path))


def _versions() -> dict[str, str]:
    versions = {"torch": str(torch.__version__)}
    for package in ("lightning", "safetensors", "lightning-iocatch"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def prepare_store(path: Path, mode: Mode, settings: Mapping[str, Any]) -> StorePlan:
    """Make ``path`` ready for writing in ``mode``; call it on one process, before any writes.

    ``"create"`` needs an empty or missing directory; ``"overwrite"`` deletes the store's
    own files there (nothing else); ``"resume"`` needs a store written with the same
    ``settings`` (``spec``, ``stage``, ``dtype``, ``tokens``; ``world_size`` may differ),
    completes or cuts the ledgers' last lines, deletes the debris of the interrupted run, and reads
    which dataset indices are committed. ``settings`` go into a new ``store.json``.

    Raises:
        StoreError: naming the path, what is wrong and the fix.
    """
    try:
        if mode == "resume":
            return _resume(path, settings)
        path.mkdir(parents=True, exist_ok=True)
        names = _list_dir(path)
        if mode == "create" and names:
            shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if names[3:] else "")
            raise StoreError(
                f"{path} is not empty; use FeatureWriter(..., mode='resume') to continue an "
                f"interrupted dump there, mode='overwrite' to replace it, or another path "
                f"(it holds {shown})"
            )
        if mode == "overwrite":
            for name in names:
                if is_store_file(name):
                    check_own_path(path, name, for_writing=True)  # refuses a symbolic link
                    (path / name).unlink()
                elif _is_our_serializer_temp(path, name):
                    (path / name).unlink()
            fsync_dir(path)
        info = {
            "format": FORMAT,
            **settings,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "libraries": _versions(),
        }
        write_json_atomic(path / STORE_FILE, info)
        return StorePlan(read_store_json(path))
    except OSError as error:
        raise StoreError(f"cannot prepare the feature store {path}: {error}") from error


def _resume(path: Path, settings: Mapping[str, Any]) -> StorePlan:
    if not os.path.lexists(path / STORE_FILE):
        raise StoreError(
            f"nothing to resume in {path}: it holds no {STORE_FILE}; use mode='create'"
        )
    info = read_store_json(path)
    for name in ("spec", "stage", "dtype", "tokens"):
        had, now = info.get(name), settings.get(name)
        if name == "spec" and (had is None or now is None):
            continue  # a writer used without IOCaptureCallback knows no spec
        if had != now:
            raise StoreError(
                f"{path} holds captures with {name} {had!r}, but this writer's {name} is "
                f"{now!r}; resume with the same {name}, or write to another path"
            )
    names = _list_dir(path)
    for name in names:
        if ledger_rank(name) is not None:
            check_own_path(path, name, for_writing=True)  # refuses a symbolic link
            drop_torn_tail(path / name)
    entries = read_ledger_entries(path)
    committed_files = {entry.record.file for entry in entries}
    for name in names:
        unfinished = is_store_file(name) and name.endswith(".tmp")
        uncommitted = shard_rank_and_seq(name) is not None and name not in committed_files
        if unfinished or uncommitted:
            check_own_path(path, name, for_writing=True)
            (path / name).unlink()
        elif _is_our_serializer_temp(path, name):
            (path / name).unlink()
    fsync_dir(path)
    committed: dict[int, IndexSet] = {}
    next_seq: dict[int, int] = {}
    row_keys: set[str] = set()
    batch_keys: set[str] = set()
    for entry in entries:
        record = entry.record
        rank_seq = shard_rank_and_seq(record.file)
        if rank_seq is not None:
            next_seq[rank_seq[0]] = max(next_seq.get(rank_seq[0], 0), rank_seq[1] + 1)
        shard = check_own_path(path, record.file)
        try:
            with safe_open(shard, framework="pt") as handle:
                for position, batch in enumerate(record.batches):
                    indices = handle.get_tensor(f"b{position}/{INDEX_KEY}")
                    if tuple(indices.shape) != (batch.rows,):
                        raise StoreError(
                            f"shard {shard} holds {tuple(indices.shape)} indices in batch "
                            f"{position}, but {entry.where} says {batch.rows} rows: it is damaged"
                        )
                    seen = committed.setdefault(batch.dataloader_idx, IndexSet())
                    for index in indices.tolist():
                        seen.add(index)
        except (SafetensorError, OSError) as error:
            raise StoreError(
                f"shard {shard}, committed by {entry.where}, cannot be read: {error}"
            ) from error
        batch_keys.update(record.per_batch)
        row_keys.update(key for key in record.keys if key not in record.per_batch)
    return StorePlan(
        store_json=info,
        committed={dataloader: bytes(seen.bits) for dataloader, seen in committed.items()},
        next_seq=next_seq,
        row_keys=frozenset(row_keys - batch_keys),
        batch_keys=frozenset(batch_keys),
    )


def _is_our_serializer_temp(path: Path, name: str) -> bool:
    """A temporary file safetensors' ``save_file`` left while writing one of our shards.

    Only a regular file whose header carries this store format's mark counts: a user's
    file that merely has such a name is kept.
    """
    if not is_serializer_temp(name):
        return False
    try:
        fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # a symbolic link, or gone
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return False
        head = handle.read(4096)
    return head[8:9] == b"{" and _SERIALIZER_MARK in head
