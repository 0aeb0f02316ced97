"""Which dataset indices a store holds: its samples, its gaps, and the indices stored twice.

:class:`~lightning_iocatch.store.reader.FeatureStore` answers these from the
:class:`~.index_set.IndexSet` of its samples, made from the records when it opens: the gaps
come as ranges, one per gap whatever its length, and only :func:`sample_array` and
:func:`listed` make one entry per index. Indices go up to ``2**63 - 1``, the largest the
writer takes: a range's end past it is a Python integer, never an int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.stored_batches import StoredBatch, holds_any

__all__ = ["gaps", "listed", "refuse_duplicates", "sample_array"]

_MAX_LISTED = 10_000_000  # missing indices listed one by one
_BLOCK = 4096  # members of a strided group read at a time while looking for gaps


def gaps(present: IndexSet, expected: int | None, limit: int | None) -> list[tuple[int, int]]:
    """The indices absent from ``range(expected)`` (default: up to the largest present) as
    ascending half-open ranges ``(start, stop)``, the first ``limit`` where given. With a
    limit the runs are read a block at a time (:meth:`~.index_set.IndexSet.iter_ranges`)
    until it is reached: the first gaps of one DDP rank's share alone (a gap per index) cost
    a block, not the share; without one, the answer is a range per gap anyway."""
    if expected is not None and (type(expected) is not int or expected < 0):
        raise ValueError(f"`expected` must be a non-negative int or None, got {expected!r}")
    found: list[tuple[int, int]] = []
    stop = expected if expected is not None else 2**64  # past every index
    at = 0  # the first index not known to be present; Python ints: a last + 1 fits
    blocks = [present.ranges()] if limit is None else present.iter_ranges(_BLOCK)
    for block in blocks:  # ascending, not adjacent
        if not block.size:
            continue
        firsts, lasts = block[:, 0].tolist(), block[:, 1].tolist()
        starts = [at, *(last + 1 for last in lasts[:-1])]  # a gap starts after each run
        found += [
            (a, min(b, stop)) for a, b in zip(starts, firsts, strict=True) if a < min(b, stop)
        ]
        at = lasts[-1] + 1
        if (limit is not None and len(found) >= limit) or at >= stop:
            break
    if at < stop < 2**64:
        found.append((at, stop))
    return found if limit is None else found[:limit]


def listed(ranges: Sequence[tuple[int, int]], where: object) -> list[int]:
    """The indices of ``ranges`` one by one; more than ten million are refused."""
    count = sum(stop - start for start, stop in ranges)
    if count > _MAX_LISTED:
        raise StoreError(
            f"{count} dataset indices are missing from {where}, too many to list one by "
            "one; store.missing_ranges() gives them as ranges"
        )
    return [index for start, stop in ranges for index in range(start, stop)]


def sample_array(present: IndexSet) -> torch.Tensor:
    """Every index of ``present``, ascending, as int64 (no run's end plus one is formed:
    a run may end at ``2**63 - 1``)."""
    runs = present.ranges()
    lengths = runs[:, 1] - runs[:, 0] + 1  # a run of 2**63 indices fits in no memory
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
    return torch.from_numpy(np.repeat(runs[:, 0], lengths) + offsets)


def refuse_duplicates(where: object, batches: list[StoredBatch], duplicated: np.ndarray) -> None:
    """Refuse a store holding ``duplicated`` more than once, naming the shards holding them."""
    twice = IndexSet()
    twice.add(duplicated)
    shards = sorted({batch.source.name for batch in batches if holds_any(batch, twice)})
    raise StoreError(
        f"{where} holds {duplicated.size} dataset indices more than once, e.g. "
        f"{duplicated[:10].tolist()} (in {', '.join(shards[:4])}"
        f"{', ...' if len(shards) > 4 else ''}); open it with "
        "FeatureStore(..., on_duplicate='first') to read each index from its first "
        "commit (StoreRows and export_dataset take it too; `lightning-iocatch export "
        "--on-duplicate first`), or `lightning-iocatch inspect` it"
    )
