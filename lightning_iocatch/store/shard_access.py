"""A store's committed shards and their tensors, wherever the store lives.

A local store's committed shards are those of its ledgers, memory-mapped by safetensors
(``safe_open``) when read; a store on object storage has those of its commit records, read
with ranged requests of just the bytes asked for (:mod:`~.backends.ranged_reads`).
Either commit point counts wherever it is found: a store copied from disk to object
storage keeps its ledgers, one downloaded from object storage its ``commits/`` folder.
:class:`~lightning_iocatch.FeatureStore` and
:class:`~lightning_iocatch.store.training.StoreRows` open and read through these functions
and never ask where a shard is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.location import StoreLocation
from lightning_iocatch.store.backends.objects import (
    list_objects,
    read_commit_entries,
    read_commit_files,
    read_store_info,
)
from lightning_iocatch.store.backends.ranged_reads import (
    OpenedShard,
    RemoteShard,
    open_remote_shards,
    read_rows,
    read_tensors,
    shard_crc32,
)
from lightning_iocatch.store.ledger import LedgerEntry, file_crc32, read_ledger_entries
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.stored_batches import check_header, check_shards

__all__ = [
    "open_committed",
    "read_header_and_indices",
    "read_shard_rows",
    "read_shard_tensors",
    "shard_checksum",
]

Shards = dict[str, Path | RemoteShard]


def open_committed(
    location: StoreLocation,
) -> tuple[dict[str, Any], list[LedgerEntry], Shards, dict[str, Path | OpenedShard]]:
    """``store.json``, the committed records (by rank, then sequence number), each committed
    shard by name (present, of its recorded size), and what :func:`read_header_and_indices`
    reads each one's header from: a local shard's file, or a remote shard as opened here
    (header checked against its record, indices read)."""
    info = read_store_info(location)
    if isinstance(location, Path):
        entries = read_ledger_entries(location)
        entries += read_commit_files(location, store_format=info["format"])
        entries.sort(key=lambda entry: entry.commit_order)
        files = check_shards(location, entries)
        return info, entries, {**files}, {**files}
    listing = list_objects(location)
    entries = read_commit_entries(location, listing, store_format=info["format"])
    opened = open_remote_shards(location, entries, listing)
    return info, entries, {name: shard.shard for name, shard in opened.items()}, {**opened}


def read_header_and_indices(
    entry: LedgerEntry, shard: Path | OpenedShard, positions: Sequence[int]
) -> tuple[list[dict[str, tuple[int, ...]]], dict[int, torch.Tensor]]:
    """The stored shapes of each batch of a shard, once its header agrees with its record,
    and the dataset indices of the batches at ``positions``.

    A shard on object storage comes as :func:`open_committed` opened it (header checked,
    indices read); a local shard's header and indices are read here.
    """
    if isinstance(shard, OpenedShard):
        return shard.stored, {p: shard.indices[p] for p in positions}
    try:
        with safe_open(shard, framework="pt") as handle:
            names = handle.keys()
            slices = {name: handle.get_slice(name) for name in names}
            header = {name: (s.get_dtype(), s.get_shape()) for name, s in slices.items()}
            stored = check_header(header, entry, shard)
            return stored, {p: handle.get_tensor(f"b{p}/{INDEX_KEY}") for p in positions}
    except SafetensorError as error:
        raise StoreError(f"shard {shard} is corrupted: {error}") from error


def read_shard_tensors(shard: Path | RemoteShard, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of ``shard`` (memory-mapped when local)."""
    if isinstance(shard, RemoteShard):
        return read_tensors(shard, names)
    try:
        with safe_open(shard, framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in names}
    except SafetensorError as error:
        raise StoreError(f"shard {shard} is corrupted: {error}") from error


def read_shard_rows(
    shard: Path | RemoteShard, names: Sequence[str], first: int, stop: int
) -> dict[str, torch.Tensor]:
    """Rows ``[first, stop)`` of the tensors ``names`` of ``shard``: views of the mapped
    file when local (mapped only while they are kept), ranged reads when remote."""
    if isinstance(shard, RemoteShard):
        return read_rows(shard, names, first, stop)
    try:
        with safe_open(shard, framework="pt") as handle:
            return {name: handle.get_slice(name)[first:stop] for name in names}
    except SafetensorError as error:
        raise StoreError(f"shard {shard} is corrupted: {error}") from error


def shard_checksum(shard: Path | RemoteShard) -> int:
    """CRC-32 of all of the shard's bytes."""
    return shard_crc32(shard) if isinstance(shard, RemoteShard) else file_crc32(shard)
