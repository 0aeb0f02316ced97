"""What :class:`~lightning_iocatch.store.training.StoreRows` reads of a store: the keys it is
given (:func:`parse_keys`), each key's column, checked to hold one row per sample of one
shape and dtype (:func:`key_columns`), and the blocks of rows that hold every key, in commit
order (:func:`layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.reader import FeatureStore
from lightning_iocatch.store.row_gather import Block, Column

__all__ = ["Incomplete", "key_columns", "layout", "parse_keys"]

Incomplete = Literal["error", "skip"]


def parse_keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    """``keys`` as a tuple: one key, or a non-empty list of distinct keys."""
    parsed = (keys,) if isinstance(keys, str) else tuple(keys)
    if not parsed or not all(isinstance(key, str) for key in parsed):
        raise TypeError(f"`keys` must be a key or a non-empty list of keys (str), got {keys!r}")
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"`keys` lists a key twice: {list(parsed)}")
    return parsed


def key_columns(
    store: FeatureStore, keys: Sequence[str], dtype: torch.dtype | None
) -> dict[str, Column]:
    """The column of each of ``keys``: its row's shape, the dtype read (``dtype`` for a
    floating key, if given), as stored, and whether it is stored with a scale per row."""
    described = store.metadata
    columns = {}
    for key in keys:
        if key not in store:
            store.indices_of(key)  # raises a KeyError naming the keys close to it
        where = f"StoreRows reads keys with one row per sample; read {key!r} with"
        if key in described["per_batch"]:
            raise StoreError(f"{key!r} is stored once per batch; {where} store.batches")
        shape, stored_as = described["keys"][key]["shape"], described["keys"][key]["dtype"]
        if shape is None or "|" in stored_as:
            raise StoreError(
                f"{key!r} has rows of different shapes or dtypes across batches ({stored_as}); "
                f"{where} store.batches"
            )
        stored = getattr(torch, stored_as)
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        scaled = "scaled" in described["keys"][key]
        if scaled:
            cast = dtype or torch.float32
        columns[key] = Column(tuple(shape), cast, stored, scaled)
    return columns


def layout(store: FeatureStore, keys: Sequence[str], incomplete: Incomplete) -> list[Block]:
    """The blocks of the rows holding every key, in commit order, each with the rows
    ``store`` reads from it (an index stored twice is read from its first commit)."""
    counts, blocks = dict.fromkeys(keys, 0), []
    for batch in store.stored_batches():
        held = [key for key in keys if key in batch.keys]
        keep = None if batch.keep is None else batch.keep.nonzero().flatten()
        rows = batch.kept_rows
        for key in held:
            counts[key] += rows
        if len(held) == len(keys) and rows:
            blocks.append(Block(batch, rows, keep))
    complete = sum(block.rows for block in blocks)
    for key in keys:
        if counts[key] != complete and incomplete == "error":
            raise StoreError(
                f"{key!r} is stored for {counts[key]} rows, but only {complete} rows hold "
                f"every one of {list(keys)}; pass StoreRows(..., incomplete='skip') to read "
                "only those, or read the keys one at a time"
            )
    return blocks
