"""Preparing a store for writing: the mode's checks, the resume's clean-up, a shared plan.

:func:`prepare_store` (check the directory against the mode, clean it, write
``store.json``, read what is committed) is the one decision that every writing process
must share: it runs on one process and returns a plain :class:`StorePlan` for the caller
to broadcast to the :class:`~lightning_iocatch.store.writer.ShardWriter` of every rank.
Nothing here imports Lightning.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, Literal

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.names import (
    FORMAT,
    STORE_FILE,
    is_store_file,
    shard_rank_and_seq,
)
from lightning_iocatch.store.progress import show_progress
from lightning_iocatch.store.stored_batches import CommittedShard, first_commits, stored_batches

__all__ = ["MODES", "Mode", "StorePlan", "prepare_store"]

Mode = Literal["create", "resume", "overwrite"]
"""How a dump treats a place that holds a store: see :func:`prepare_store`."""
MODES: tuple[Mode, ...] = ("create", "resume", "overwrite")
"""Every :data:`Mode`, in the order the errors list them."""


@dataclass(frozen=True)
class StorePlan:
    """What :func:`prepare_store` found and decided, for every process to share (it pickles).

    Attributes:
        store_json: the store's metadata as prepared; every process checks that it reads the same.
        committed: per dataloader, the dataset indices already committed, as intervals
            (a few of them for a dump of any size in order: what a resume broadcasts).
        next_seq: per rank, the sequence number of its next shard.
        row_keys: keys the store already holds row by row.
        batch_keys: keys the store already holds once per batch.
    """

    store_json: dict[str, Any]
    committed: dict[int, IndexSet] = field(default_factory=dict)
    next_seq: dict[int, int] = field(default_factory=dict)
    row_keys: frozenset[str] = frozenset()
    batch_keys: frozenset[str] = frozenset()


def _versions() -> dict[str, str]:
    versions = {"torch": str(torch.__version__)}
    for package in ("lightning", "safetensors", "lightning-iocatch"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def prepare_store(
    path: str | os.PathLike[str] | StoreBackend,
    mode: Mode,
    settings: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
) -> StorePlan:
    """Make ``path`` ready for writing in ``mode``; call it on one process, before any writes.

    ``"create"`` needs an empty or missing directory (or one holding only what a start that
    never committed anything left); ``"overwrite"`` deletes the store's own files there
    (nothing else); ``"resume"`` needs a store written with the same ``settings``
    (``spec``, ``stage``, ``dtype``, ``tokens``, ``edits``; ``world_size`` may differ), completes or
    cuts the ledgers' last lines, deletes the debris of the interrupted run, and finds which
    dataset indices are committed (from the records' index summaries; the indices of a
    batch are read only where its summary cannot tell). ``settings`` go into a new ``store.json``.

    ``path`` may be an fsspec URL (``s3://bucket/run``, with ``storage_options``): the same
    rules on a prefix of object storage (see :mod:`lightning_iocatch.store.backends`).
    There, where a resume reads the commit records and deletes the debris, and where an
    overwrite deletes the old store, ``progress`` shows a bar on stderr: ``True``, ``False``,
    or ``None`` (default) for one when stderr is a terminal (see :mod:`~.progress`).

    Raises:
        StoreError: naming the path, what is wrong and the fix.
    """
    backend = open_backend(path, storage_options)
    show = show_progress(progress)
    if mode == "resume":
        return _resume(backend, settings, show)
    names = backend.names()
    if mode == "create" and names and not _never_committed(names):
        _refuse_not_empty(backend, sorted(names))
    if names:  # overwrite, or create over a start that never committed anything
        backend.clear(names, progress=show)
    backend.write_info(_store_json(settings))
    return StorePlan(backend.read_info())


def _store_json(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        **settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "libraries": _versions(),
    }


def _never_committed(names: Iterable[str]) -> bool:
    """Whether ``names`` are what a start that never wrote a shard leaves: ``store.json``
    and the store's own temporary files (a dump refused at its first batch). A shard, even
    one no record commits, is more than that: ``create`` never deletes it."""
    return all(
        name == STORE_FILE or (name.endswith(".tmp") and is_store_file(name)) for name in names
    )


def _refuse_not_empty(backend: StoreBackend, names: list[str]) -> None:
    shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if names[3:] else "")
    raise StoreError(
        f"{backend} is not empty; use FeatureWriter(..., mode='resume') to continue an "
        f"interrupted dump there, mode='overwrite' to replace it, or another path "
        f"(it holds {shown})"
    )


def _resume(backend: StoreBackend, settings: Mapping[str, Any], progress: bool) -> StorePlan:
    if not backend.has_info():
        raise StoreError(
            f"nothing to resume in {backend}: it holds no {STORE_FILE}; use mode='create'"
        )
    info = backend.read_info()
    for name in ("spec", "stage", "dtype", "tokens", "edits"):
        had, now = info.get(name), json.loads(json.dumps(settings.get(name)))  # as read back
        if name == "spec" and (had is None or now is None):
            continue  # a writer used without IOCaptureCallback knows no spec
        if had != now and _never_committed(backend.names()):  # nothing depends on them
            return prepare_store(backend, "overwrite", settings, progress=progress)
        if had != now:
            raise StoreError(
                f"{backend} holds captures with {name} {had!r}, but this writer's {name} is "
                f"{now!r}; resume with the same {name}, or write to another path"
            )
    committed = backend.clean_for_resume(info["format"], progress=progress)
    shards = backend.open_shards(committed)
    sources = [CommittedShard(shards[entry.record.file], entry) for entry in committed.entries]
    next_seq: dict[int, int] = {}
    row_keys: set[str] = set()
    batch_keys: set[str] = set()
    for entry in committed.entries:
        record = entry.record
        rank_seq = shard_rank_and_seq(record.file)
        if rank_seq is not None:
            next_seq[rank_seq[0]] = max(next_seq.get(rank_seq[0], 0), rank_seq[1] + 1)
        batch_keys.update(record.per_batch)
        row_keys.update(key for key in record.keys if key not in record.per_batch)
    dataloaders = {b.dataloader_idx for entry in committed.entries for b in entry.record.batches}
    return StorePlan(
        store_json=info,
        committed={
            dataloader: first_commits(stored_batches(sources, dataloader), token_rows=True)[1]
            for dataloader in sorted(dataloaders)
        },
        next_seq=next_seq,
        row_keys=frozenset(row_keys - batch_keys),
        batch_keys=frozenset(batch_keys),
    )
