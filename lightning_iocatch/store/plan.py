"""Preparing a store for writing: the mode's checks, the resume's clean-up, a shared plan.

:func:`prepare_store` (check the directory against the mode, clean it, write
``store.json``, read what is committed) is the one decision that every writing process
must share: it runs on one process and returns a plain :class:`StorePlan` for the caller
to broadcast to the :class:`~lightning_iocatch.store.writer.ShardWriter` of every rank.
Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.location import (
    ObjectLocation,
    StoreLocation,
    resolve_location,
)
from lightning_iocatch.store.backends.objects import (
    COMMITS,
    commit_rank_and_seq,
    delete_objects,
    is_own_object,
    list_objects,
    read_commit_entries,
    read_commit_files,
    read_store_info,
    write_object,
)
from lightning_iocatch.store.backends.ranged_reads import open_remote_shards
from lightning_iocatch.store.ledger import LedgerEntry, drop_torn_tail, read_ledger_entries
from lightning_iocatch.store.names import (
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


def prepare_store(
    path: str | os.PathLike[str] | ObjectLocation,
    mode: Mode,
    settings: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> StorePlan:
    """Make ``path`` ready for writing in ``mode``; call it on one process, before any writes.

    ``"create"`` needs an empty or missing directory; ``"overwrite"`` deletes the store's
    own files there (nothing else); ``"resume"`` needs a store written with the same
    ``settings`` (``spec``, ``stage``, ``dtype``, ``tokens``; ``world_size`` may differ),
    completes or cuts the ledgers' last lines, deletes the debris of the interrupted run,
    and reads which dataset indices are committed. ``settings`` go into a new ``store.json``.

    ``path`` may be an fsspec URL (``s3://bucket/run``, with ``storage_options``): the same
    rules on a prefix of object storage, with the protocol of
    :mod:`~lightning_iocatch.store.backends.objects` (an empty prefix for ``"create"``; the
    store's own objects deleted, nothing else).

    Raises:
        StoreError: naming the path, what is wrong and the fix.
    """
    location = resolve_location(path, storage_options)
    if isinstance(location, ObjectLocation):
        return _prepare_objects(location, mode, settings)
    path = location
    try:
        if mode == "resume":
            return _resume(path, settings)
        path.mkdir(parents=True, exist_ok=True)
        names = _list_dir(path)
        if mode == "create" and names and not _never_committed(names):
            _refuse_not_empty(path, names)
        if names:  # overwrite, or create over a start that never committed anything
            for name in names:
                if is_store_file(name):
                    check_own_path(path, name, for_writing=True)  # refuses a symbolic link
                    (path / name).unlink()
                elif _is_our_serializer_temp(path, name):
                    (path / name).unlink()
            _delete_commit_files(path)
            fsync_dir(path)
        write_json_atomic(path / STORE_FILE, _store_json(settings))
        return StorePlan(read_store_json(path))
    except OSError as error:
        raise StoreError(f"cannot prepare the feature store {path}: {error}") from error


def _store_json(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        **settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "libraries": _versions(),
    }


def _never_committed(names: Iterable[str]) -> bool:
    """Whether ``names`` are a store's own files of a start that committed nothing: its
    ``store.json``, perhaps a shard or temporary file, no ledger and no commit record (a
    dump refused at its first batch, or killed before its first commit)."""
    return all(
        (is_store_file(name) or is_own_object(name))
        and ledger_rank(name) is None
        and not commit_rank_and_seq(name)
        for name in names
    )


def _refuse_not_empty(path: StoreLocation, names: list[str]) -> None:
    shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if names[3:] else "")
    raise StoreError(
        f"{path} is not empty; use FeatureWriter(..., mode='resume') to continue an "
        f"interrupted dump there, mode='overwrite' to replace it, or another path "
        f"(it holds {shown})"
    )


def _prepare_objects(
    location: ObjectLocation, mode: Mode, settings: Mapping[str, Any]
) -> StorePlan:
    """:func:`prepare_store` on object storage (see :mod:`~.backends.objects`)."""
    if mode == "resume":
        return _resume(location, settings)
    listing = list_objects(location)
    if mode == "create" and listing and not _never_committed(listing):
        _refuse_not_empty(location, sorted(listing))
    if listing:  # overwrite, or create over a start that never committed anything
        # store.json first: a store cut short here is no store at all
        points = {n for n in listing if commit_rank_and_seq(n) or ledger_rank(n) is not None}
        delete_objects(location, [name for name in listing if name == STORE_FILE])
        delete_objects(location, points)  # then no shard counts
        delete_objects(location, [n for n in listing if n != STORE_FILE and n not in points])
    data = json.dumps(_store_json(settings), indent=2, sort_keys=True).encode()
    write_object(location, STORE_FILE, data)
    return StorePlan(read_store_info(location))


def _resume(path: StoreLocation, settings: Mapping[str, Any]) -> StorePlan:
    if not _has_store_json(path):
        raise StoreError(
            f"nothing to resume in {path}: it holds no {STORE_FILE}; use mode='create'"
        )
    info = read_store_info(path)
    names = list_objects(path) if isinstance(path, ObjectLocation) else _list_dir(path)
    for name in ("spec", "stage", "dtype", "tokens"):
        had, now = info.get(name), settings.get(name)
        if name == "spec" and (had is None or now is None):
            continue  # a writer used without IOCaptureCallback knows no spec
        if had != now and _never_committed(names):  # nothing depends on the old settings
            return prepare_store(path, "overwrite", settings)
        if had != now:
            raise StoreError(
                f"{path} holds captures with {name} {had!r}, but this writer's {name} is "
                f"{now!r}; resume with the same {name}, or write to another path"
            )
    if isinstance(path, ObjectLocation):
        entries, indices = _clean_objects(path, info["format"])
    else:
        entries = _clean_files(path)
        indices = _file_indices(path)
    committed: dict[int, IndexSet] = {}
    next_seq: dict[int, int] = {}
    row_keys: set[str] = set()
    batch_keys: set[str] = set()
    for entry in entries:
        record = entry.record
        rank_seq = shard_rank_and_seq(record.file)
        if rank_seq is not None:
            next_seq[rank_seq[0]] = max(next_seq.get(rank_seq[0], 0), rank_seq[1] + 1)
        for position, (batch, index) in enumerate(zip(record.batches, indices(entry), strict=True)):
            batch.check_indices(index, f"shard {record.file} batch {position} ({entry.where})")
            seen = committed.setdefault(batch.dataloader_idx, IndexSet())
            for value in [*index.tolist(), *batch.without_rows]:
                seen.add(value)
        batch_keys.update(record.per_batch)
        row_keys.update(key for key in record.keys if key not in record.per_batch)
    return StorePlan(
        store_json=info,
        committed={dataloader: bytes(seen.bits) for dataloader, seen in committed.items()},
        next_seq=next_seq,
        row_keys=frozenset(row_keys - batch_keys),
        batch_keys=frozenset(batch_keys),
    )


def _has_store_json(path: StoreLocation) -> bool:
    if isinstance(path, ObjectLocation):
        return STORE_FILE in list_objects(path)
    return os.path.lexists(path / STORE_FILE)


def _clean_files(path: Path) -> list[LedgerEntry]:
    """Complete or cut the ledgers' last lines, delete the debris; the committed records."""
    names = _list_dir(path)
    for name in names:
        if ledger_rank(name) is not None:
            check_own_path(path, name, for_writing=True)  # refuses a symbolic link
            drop_torn_tail(path / name)
    entries = read_ledger_entries(path)  # and commits/ of a store downloaded from objects
    entries += read_commit_files(path, store_format=read_store_json(path)["format"])
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
    return entries


def _file_indices(path: Path) -> Callable[[LedgerEntry], list[torch.Tensor]]:
    """Reads the dataset indices of each batch of a committed local shard."""

    def indices(entry: LedgerEntry) -> list[torch.Tensor]:
        record = entry.record
        shard = check_own_path(path, record.file)
        try:
            with safe_open(shard, framework="pt") as handle:
                found = []
                for position, batch in enumerate(record.batches):
                    index = handle.get_tensor(f"b{position}/{INDEX_KEY}")
                    if tuple(index.shape) != (batch.rows,):
                        raise StoreError(
                            f"shard {shard} holds {tuple(index.shape)} indices in batch "
                            f"{position}, but {entry.where} says {batch.rows} rows: it is damaged"
                        )
                    found.append(index)
                return found
        except (SafetensorError, OSError) as error:
            raise StoreError(
                f"shard {shard}, committed by {entry.where}, cannot be read: {error}"
            ) from error

    return indices


def _delete_commit_files(path: Path) -> None:
    """Delete the commit records of a store downloaded from object storage (``commits/``)."""
    folder = path / COMMITS
    if folder.is_symlink() or not folder.is_dir():
        return  # a link is never followed for writing; reading it is refused
    for name in os.listdir(folder):
        if commit_rank_and_seq(f"{COMMITS}/{name}") is not None:
            (folder / name).unlink()
    with contextlib.suppress(OSError):  # holding other files: kept
        folder.rmdir()


def _clean_objects(
    location: ObjectLocation, store_format: str
) -> tuple[list[LedgerEntry], Callable[[LedgerEntry], list[torch.Tensor]]]:
    """Delete shard objects without a commit record (or ledger line: a store copied from
    disk); the committed records and indices."""
    listing = list_objects(location)
    entries = read_commit_entries(location, listing, store_format=store_format)
    committed = {entry.record.file for entry in entries}
    delete_objects(
        location,
        [
            name
            for name in listing
            if shard_rank_and_seq(name.removesuffix(".tmp")) is not None and name not in committed
        ],
    )
    opened = open_remote_shards(location, entries, listing)
    return entries, lambda entry: opened[entry.record.file].indices


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
