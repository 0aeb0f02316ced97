"""What a shard of selected batches holds and how it is recorded.

:class:`~lightning_iocatch.store.writer.ShardWriter`'s writer thread fills a shard with
:class:`~lightning_iocatch.store.exactly_once.SelectedBatch` es; this module says what the
shard file then holds (:func:`shard_tensors`: tensors ``b{position}/{key}``, each batch's
scales beside them, and the file's metadata) and what its record says of it
(:func:`shard_record`: the ledger line or commit record, see :mod:`~.records`). Writing
the file, its codec and its cancellation are the writer's.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from lightning_iocatch.store.exactly_once import SelectedBatch
from lightning_iocatch.store.names import FORMAT, INDEX_KEY
from lightning_iocatch.store.records import ShardRecord
from lightning_iocatch.store.shard_file import SCALE_RULE, dtype_name, scale_name

__all__ = ["batch_tensors", "shapes_only", "shard_record", "shard_tensors"]


def shard_tensors(
    batches: list[SelectedBatch], rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a shard of ``batches`` (``b{position}/{key}``, then the scales of the
    keys stored with a scale per row) and its metadata."""
    tensors = {}
    for position, batch in enumerate(batches):
        tensors.update(batch_tensors(batch, position))
    scaled = _scaled(batches)
    metadata = {"format": FORMAT, "rank": str(rank)}
    if scaled:
        metadata["scaled"] = json.dumps(scaled, sort_keys=True)
    return tensors, metadata


def batch_tensors(batch: SelectedBatch, position: int) -> dict[str, torch.Tensor]:
    """The tensors of ``batch`` at ``position`` in its shard: ``b{position}/{key}``, then
    the scales of its keys stored with a scale per row."""
    tensors = {f"b{position}/{key}": tensor for key, tensor in batch.tensors.items()}
    tensors.update((scale_name(position, key), scale) for key, scale in batch.scales.items())
    return tensors


def shapes_only(batch: SelectedBatch) -> SelectedBatch:
    """``batch`` with tensors of its tensors' shapes and dtypes and no data (``meta``): all
    its record needs once a codec holds its data."""
    return dataclasses.replace(
        batch,
        tensors={key: t.to("meta") for key, t in batch.tensors.items()},
        scales={key: t.to("meta") for key, t in batch.scales.items()},
    )


def shard_record(
    name: str, rank: int, crc: int, size: int, batches: list[SelectedBatch], codec: str | None
) -> ShardRecord:
    """The ledger line (or commit record) of a shard of ``batches``."""
    skipped: dict[str, str] = {}
    for batch in batches:
        for key, reason in batch.skipped.items():
            skipped.setdefault(key, reason)
    keys = {
        key: dtype_name(tensor.dtype)
        for batch in batches
        for key, tensor in batch.tensors.items()
        if key != INDEX_KEY
    }
    records = []
    for batch in batches:  # a batch without some of the shard's keys says which it has
        held = tuple(sorted(key for key in batch.tensors if key != INDEX_KEY))
        partial = len(held) < len(keys)
        records.append(dataclasses.replace(batch.record, keys=held) if partial else batch.record)
    return ShardRecord(
        file=name,
        rank=rank,
        bytes=size,
        crc32=crc,
        batches=tuple(records),
        keys=keys,
        shapes=_shapes(batches),
        per_batch=tuple(sorted(set().union(*(batch.per_batch for batch in batches)))),
        skipped=skipped,
        scaled=_scaled(batches),
        codec=codec,
    )


def _scaled(batches: list[SelectedBatch]) -> dict[str, str]:
    """The keys stored with a scale per row, with their rule (see :mod:`.shard_file`)."""
    return {key: SCALE_RULE for batch in batches for key in batch.scales}


def _shapes(batches: list[SelectedBatch]) -> dict[str, list[int] | None]:
    """Per key: the shape of a row (of the whole tensor for per-batch keys); ``None`` where
    batches differ."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for batch in batches:
        for key, tensor in batch.tensors.items():
            if key != INDEX_KEY:
                shape = tensor.shape if key in batch.per_batch else tensor.shape[1:]
                shapes.setdefault(key, set()).add(tuple(shape))
    return {key: list(next(iter(seen))) if len(seen) == 1 else None for key, seen in shapes.items()}
