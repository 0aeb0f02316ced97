"""The batches of a store as the reader sees them, checked against their records.

Before :class:`~lightning_iocatch.FeatureStore` reads any tensor, every committed shard must
be there with the size its record gives (the backend's ``open_shards``), and its
safetensors header must agree with the record: batches, keys, dtypes and shapes
(:func:`check_header`). Each batch the reader keeps is a :class:`StoredBatch`;
:func:`read_first_commits` decides which of its rows are read when an index is stored twice.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard
from lightning_iocatch.store.commits import LedgerEntry
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.shard_file import STORABLE_DTYPES, dtype_name

__all__ = ["StoredBatch", "check_header", "read_first_commits"]

_TENSOR_NAME = re.compile(r"b(0|[1-9][0-9]*)/(.+)", re.ASCII | re.DOTALL)
# safetensors' dtype codes, by the names FeatureWriter records; F8_E8M0 is read, never written
_DTYPES = {code: dtype_name(dtype) for dtype, code in STORABLE_DTYPES.items()}
_DTYPES["F8_E8M0"] = "float8_e8m0fnu"


@dataclass(frozen=True)
class StoredBatch:
    """One stored batch of the store's dataloader, as its shard's header describes it."""

    shard: Shard
    position: int
    shapes: dict[str, tuple[int, ...]]  # key -> stored shape (rows first, unless per batch)
    dtypes: dict[str, str]  # key -> dtype
    per_batch: frozenset[str]
    indices: torch.Tensor  # int64 [rows]: the dataset index of each row
    keep: torch.Tensor | None  # bool [rows]: rows read (None: all; see `on_duplicate`)
    without_rows: torch.Tensor  # int64: samples of the batch stored with no row

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of this batch that are read (``rows`` has one per index)."""
        return rows if self.keep is None else rows[self.keep]

    @property
    def kept_indices(self) -> torch.Tensor:
        """The dataset indices of the rows that are read."""
        return self.kept(self.indices)


def check_header(
    header: dict[str, tuple[str, list[int]]], entry: LedgerEntry, shard: Shard | str
) -> list[dict[str, tuple[int, ...]]]:
    """The shape of each key of each batch, once the header agrees with the ledger record."""
    record = entry.record

    def damaged(problem: str) -> StoreError:
        return StoreError(
            f"shard {shard} disagrees with its ledger record ({entry.where}): {problem}"
        )

    stored: list[dict[str, tuple[int, ...]]] = [{} for _ in record.batches]
    seen = set()
    for name, (code, shape) in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= len(record.batches):
            raise damaged(f"it holds {name!r}, which the record has no batch for")
        position, key = int(match.group(1)), match.group(2)
        rows = record.batches[position].rows
        dtype = _DTYPES.get(code, code)
        if key == INDEX_KEY:
            if dtype != "int64" or list(shape) != [rows]:
                raise damaged(f"{name!r} is {dtype} {shape}, the record says int64 [{rows}]")
            continue
        if key not in record.keys:
            raise damaged(f"it holds {name!r}, a key the record does not list")
        if dtype != record.keys[key]:
            raise damaged(f"{name!r} is {dtype}, the record says {record.keys[key]}")
        row_shape = record.shapes.get(key)
        if key in record.per_batch:
            if row_shape is not None and list(shape) != row_shape:
                raise damaged(f"{name!r} has shape {shape}, the record says {row_shape}")
        elif not shape or shape[0] != rows or (row_shape is not None and shape[1:] != row_shape):
            expected = str([rows, *row_shape]) if row_shape is not None else f"{rows} rows"
            raise damaged(f"{name!r} has shape {shape}, the record says {expected}")
        stored[position][key] = tuple(shape)
        seen.add(key)
    for position in range(len(record.batches)):  # keys may be in only some batches, not these
        if f"b{position}/{INDEX_KEY}" not in header:
            raise damaged(f"batch {position} has no {INDEX_KEY!r}")
    if set(record.keys) - seen:
        raise damaged(f"it lacks {sorted(set(record.keys) - seen)}, which the record lists")
    return stored


def read_first_commits(
    batches: list[StoredBatch], *, token_rows: bool
) -> tuple[list[StoredBatch], torch.Tensor]:
    """``batches`` (in commit order) set to read each dataset index from its first commit
    only, and the indices stored more than once (ascending; none in a sound store).

    A row per sample: an index in more than one row is duplicated, and its first row is
    read. Token rows (``token_rows``): a sample's rows are stored together, so an index in
    more than one batch is duplicated, and every row of it in its first batch is read.
    """
    if not batches:
        return batches, torch.empty(0, dtype=torch.int64)
    samples = [
        torch.cat([torch.unique(b.indices), b.without_rows]) if token_rows else b.indices
        for b in batches
    ]
    every = torch.cat(samples)
    values, counts = torch.unique(every, return_counts=True)
    duplicated = values[counts > 1]
    if not duplicated.numel():
        return batches, duplicated
    order = torch.argsort(every, stable=True)  # first commit first among equal indices
    ordered = every[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    first_values, first_slot = ordered[first], order[first]  # where each index is first
    owner = torch.cat([torch.full((len(s),), i) for i, s in enumerate(samples)])

    def first_batch(indices: torch.Tensor) -> torch.Tensor:
        return owner[first_slot[torch.searchsorted(first_values, indices)]]

    read, offset = [], 0
    for i, (batch, sample) in enumerate(zip(batches, samples, strict=True)):
        empty = batch.without_rows
        if token_rows:  # every row of a sample, from the batch that holds it first
            keep = first_batch(batch.indices) == i
            empty = empty[first_batch(empty) == i]
        else:  # the row that is its index's first occurrence
            slot = first_slot[torch.searchsorted(first_values, batch.indices)]
            keep = slot == torch.arange(offset, offset + len(sample))
        offset += len(sample)
        read.append(dataclasses.replace(batch, keep=keep, without_rows=empty))
    return read, duplicated
