"""The rows of chosen samples: what a store holds of a list of dataset indices, in its order.

:meth:`~lightning_iocatch.store.reader.FeatureStore.rows_at` answers "the rows of ``key``
of these samples", e.g. the clean activations of a batch's samples to patch into another
run of them. A :class:`RowLookup` reads only the stored batches that can hold the indices
asked for: a batch is skipped on its record's index summary (the smallest and largest of
its indices, and the progression they make where they make one), with no read; of a batch
that holds some, its ``__index__`` is read (and checked against its record), then only
the rows it holds of them (:meth:`~.stored_batches.CommittedShard.take_rows`): not the rows
between them, and of a store written with a codec only the blocks holding them, so a
damaged block between two rows asked does not fail the read.

An index the store does not hold is refused, naming it and the store: a patch never gets
zeros, or another sample's row, in its place.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.names import INDEX_KEY, POSITION_KEY
from lightning_iocatch.store.stored_batches import StoredBatch

__all__ = ["RowLookup", "SampleRows", "as_indices"]

_NAMED = 10  # missing indices named in an error


class SampleRows(NamedTuple):
    """The rows of the samples asked for (:meth:`FeatureStore.rows_at`).

    ``rows[i]`` belongs to the sample at place ``sample[i]`` of the indices asked for;
    each sample's rows are together, samples in the order asked. A store of one row per
    sample has one row per index asked for (``sample`` is ``arange(len(indices))``); a
    store of token rows has one per selected token of the sample, in the order stored
    (ascending position), none for a sample without a selected token. ``position`` is each
    row's token position (:data:`~lightning_iocatch.store.names.POSITION_KEY`, int64) in
    a store of token rows (also ``reduce="first"``/``"last"``, where a sample without a
    selected token has position -1), else ``None``.
    """

    rows: torch.Tensor
    sample: torch.Tensor
    position: torch.Tensor | None


def as_indices(indices: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    """``indices`` as a 1-D int64 array, once they are integers."""
    array = indices.numpy(force=True) if isinstance(indices, torch.Tensor) else indices
    array = np.asarray(array)
    if array.size and (array.ndim != 1 or array.dtype.kind not in "iu"):
        raise TypeError(
            f"`indices` must be a list of dataset indices (integers), got {array.dtype} of "
            f"shape {array.shape}"
        )
    return array.reshape(-1).astype(np.int64)


class RowLookup:
    """Reads the rows of one key for chosen dataset indices from the batches holding it.

    Args:
        batches: the stored batches holding the key, in commit order (as read: ``keep``).
        key: the key.
        positions: read each row's position too (a store of token rows).
        token_rows: a sample may have any number of rows, none included (its batch's
            ``without_rows``); otherwise it has exactly one.
        store: the store, for messages.
        samples: every sample the store holds, for messages.
    """

    def __init__(
        self,
        batches: list[StoredBatch],
        key: str,
        *,
        positions: bool,
        token_rows: bool,
        store: str,
        samples: IndexSet,
    ) -> None:
        self.batches, self.key, self.store, self.samples = batches, key, store, samples
        self.positions, self.token_rows = positions, token_rows
        # a batch without rows gets the empty range [1, 0]: it never holds an index
        self._low = np.array([_bound(b.summary.low, 1) for b in batches], dtype=np.int64)
        self._high = np.array([_bound(b.summary.high, 0) for b in batches], dtype=np.int64)
        self._without: IndexSet | None = None  # samples without rows, read at first need

    def read(self, wanted: np.ndarray) -> SampleRows:
        """The rows of the samples ``wanted`` (dataset indices, any order, repeats allowed)."""
        unique = np.unique(wanted)
        indices: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        for batch, stored, held in self._holding(unique):
            names = [f"b{batch.position}/{self.key}"]
            if self.positions:
                if POSITION_KEY not in batch.keys:
                    raise StoreError(
                        f"shard {batch.source} batch {batch.position} has no {POSITION_KEY!r}, "
                        "which a store of token rows has for every row: it is damaged"
                    )
                names.append(f"b{batch.position}/{POSITION_KEY}")
            read = batch.source.take_rows(names, held)  # those rows only, not those between
            indices.append(stored[held])
            rows.append(read[names[0]])
            if self.positions:
                positions.append(read[names[1]].to(torch.int64))
        every = np.concatenate(indices) if indices else np.empty(0, dtype=np.int64)
        order = np.argsort(every, kind="stable")  # a sample's rows are in one batch, in order
        ordered = every[order]
        starts = np.searchsorted(ordered, wanted, side="left")
        counts = np.searchsorted(ordered, wanted, side="right") - starts
        self._refuse_missing(wanted[counts == 0])
        shapes = sorted({tuple(part.shape[1:]) for part in rows})
        if len(shapes) > 1:
            raise StoreError(
                f"the rows of {self.key!r} of these samples have shapes {shapes} in "
                f"{self.store}; read them per batch with store.batches({self.key!r})"
            )
        offsets = np.cumsum(counts) - counts
        take = np.arange(counts.sum()) - np.repeat(offsets, counts) + np.repeat(starts, counts)
        gather = torch.from_numpy(order[take])
        sample = torch.from_numpy(np.repeat(np.arange(len(wanted)), counts))
        found = torch.cat(rows)[gather] if rows else torch.empty(0)
        position = torch.cat(positions)[gather] if positions else None
        if self.positions and position is None:
            position = torch.empty(0, dtype=torch.int64)
        return SampleRows(found, sample, position)

    def _holding(self, unique: np.ndarray) -> list[tuple[StoredBatch, np.ndarray, np.ndarray]]:
        """``(batch, its indices, the rows read of it that hold some of unique)`` of each
        batch that holds some; batches skipped on their summaries are not read."""
        lows = np.searchsorted(unique, self._low, side="left")
        highs = np.searchsorted(unique, self._high, side="right")
        candidates = []
        for place in np.flatnonzero(lows < highs).tolist():
            batch = self.batches[place]
            progression = batch.summary.progression
            if progression is not None:  # in [low, high]: on the progression's steps?
                start, step, _ = progression
                inside = unique[lows[place] : highs[place]]
                if not ((inside - start) % step == 0).any():
                    continue
            candidates.append(batch)
        holding = []
        for source, group in itertools.groupby(candidates, key=lambda b: b.source):
            batches = list(group)
            names = [f"b{batch.position}/{INDEX_KEY}" for batch in batches]
            read = source.read(names)
            for batch, name in zip(batches, names, strict=True):
                stored = batch.check_index(read[name]).numpy()
                held = np.isin(stored, unique)
                if batch.keep is not None:
                    held &= batch.keep.numpy()
                if held.any():
                    holding.append((batch, stored, np.flatnonzero(held)))
        return holding

    def _refuse_missing(self, missing: np.ndarray) -> None:
        """Refuse the samples asked for without a row, unless token rows stored them
        without one."""
        if not missing.size:
            return
        missing = np.unique(missing)
        absent = missing[~self.samples.contains(missing)]
        if absent.size:
            raise StoreError(
                f"{self.store} holds no sample of dataset index {_named(absent)}: it cannot "
                f"give their rows of {self.key!r}; dump those samples into it first "
                "(`store.missing_ranges()` lists the indices it lacks), or ask only for "
                "samples it holds"
            )
        if self.token_rows:
            if self._without is None:
                self._without = IndexSet()
                self._without.add([i for batch in self.batches for i in batch.without_rows])
            missing = missing[~self._without.contains(missing)]
        if missing.size:
            raise StoreError(
                f"{self.store} holds no row of {self.key!r} for dataset index "
                f"{_named(missing)} (the key was captured in only some batches; "
                f"`store.indices_of({self.key!r})` lists the samples that have it)"
            )


def _bound(value: int | None, default: int) -> int:
    return default if value is None else value


def _named(indices: np.ndarray) -> str:
    shown = ", ".join(str(i) for i in indices[:_NAMED].tolist())
    more = f" and {indices.size - _NAMED} more" if indices.size > _NAMED else ""
    return f"{shown}{more}"
