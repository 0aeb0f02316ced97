"""The batches of a store as its readers see them: planned from the records, checked when read.

A store of format ``/3`` is opened from its commit records alone: each batch's record says
its rows, its keys and a summary of its dataset indices (:class:`~.records.IndexSummary`),
so nothing is read from a shard to open it. What is read later is checked first: a
:class:`CommittedShard` checks its safetensors header against its record once, before
its first tensor is read (:func:`check_header`), and every ``__index__`` read is checked
against its batch's summary (its CRC-32). A key stored in 8-bit floats with a scale per
row is read dequantized (:func:`~.shard_file.dequantize`) by :class:`CommittedShard`, in
the floating dtype its reader asks for (default float32): no reader decodes by hand.
Stores of the formats ``/1`` and ``/2`` (records without summaries) have their headers
and indices read at opening instead, as before.

:func:`first_commits` decides, batch by batch in commit order, which rows are read when a
dataset index is stored twice, keeping the indices seen as intervals
(:class:`~.index_set.IndexSet`): a batch whose indices are a progression that none seen
before overlaps is taken on its summary, and only the others (irregular, overlapping, or
repeating an index within a row-per-sample batch) have their indices read.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Shard
from lightning_iocatch.store.backends.coded import CodedShard, KeptBlocks
from lightning_iocatch.store.backends.safetensors_layout import Span, row_width, to_tensor
from lightning_iocatch.store.commits import LedgerEntry
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.names import INDEX_KEY, POSITION_KEY, TOKEN_ID_KEY
from lightning_iocatch.store.records import BatchRecord, IndexSummary, ShardRecord
from lightning_iocatch.store.shard_file import READABLE_CODES, dequantize, dtype_name, scale_name

__all__ = [
    "CommittedShard",
    "StoredBatch",
    "check_header",
    "first_commits",
    "holds_any",
    "read_key",
    "stored_batches",
]

_TENSOR_NAME = re.compile(r"b(0|[1-9][0-9]*)(\.scale)?/(.+)", re.ASCII | re.DOTALL)
# safetensors' dtype codes, by the names FeatureWriter records; F8_E8M0 is read, never written
_DTYPES = {code: dtype_name(dtype) for code, dtype in READABLE_CODES.items()}


class CommittedShard:
    """A committed shard with its record: its header is checked against the record once,
    before any tensor is read from it; its ``__index__`` tensors against their summaries.

    ``dtype``: the floating dtype floating keys are read as (``None``: as stored, and
    float32 for a key stored scaled, which is always read dequantized). ``kept``: where
    a shard written with a codec keeps its decoded blocks (shared by a reader's shards).
    """

    def __init__(
        self,
        shard: Shard,
        entry: LedgerEntry,
        dtype: torch.dtype | None = None,
        kept: KeptBlocks | None = None,
    ) -> None:
        if entry.record.codec is not None:
            shard = CodedShard(shard, kept)  # read as the tensors it was given
        self.shard, self.entry, self.dtype = shard, entry, dtype
        self._checked = False

    @property
    def record(self) -> ShardRecord:
        return self.entry.record

    @property
    def name(self) -> str:
        return self.shard.name

    def __str__(self) -> str:
        return str(self.shard)

    def stored_keys(self) -> list[frozenset[str]]:
        """The keys each batch holds, as the header says (checked against the record)."""
        stored = check_header(self.shard.header(), self.entry, self.shard)
        self._checked = True
        return [frozenset(batch) for batch in stored]

    def _check(self) -> None:
        if not self._checked:
            self.stored_keys()

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (``b{j}/{key}``), whole, in the dtype asked."""
        self._check()
        return self._decoded(names, self.shard.read([*names, *self._scales_of(names)]))

    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[first, stop)`` of the tensors ``names``, in the dtype asked."""
        self._check()
        read = self.shard.read_rows([*names, *self._scales_of(names)], first, stop)
        return self._decoded(names, read)

    def take_rows(self, names: Sequence[str], rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows ``rows`` (row numbers) of the tensors ``names``, in that order and the dtype
        asked: only the bytes of those rows are read (of a coded shard, the blocks holding
        them), never the rows between them."""
        self._check()
        read = {}
        for name in [*names, *self._scales_of(names)]:
            span = self.shard.spans[name]
            held = span.shape[0] if span.shape else 0
            if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < held:
                raise StoreError(f"shard {self} tensor {name!r} has {held} rows, not those asked")
            width = row_width(span)
            taken = self.shard.gather(span.start + rows.astype(np.int64) * width, width)
            part = Span(span.code, (len(rows), *span.shape[1:]), 0, taken.size)
            read[name] = to_tensor(taken.reshape(-1).data, part)
        return self._decoded(names, read)

    def _scales_of(self, names: Sequence[str]) -> dict[str, str]:
        """The scales' tensor name of each of ``names`` stored scaled."""
        scaled = self.record.scaled
        if not scaled:
            return {}
        found = {}
        for name in names:
            match = _TENSOR_NAME.fullmatch(name)
            if match is not None and match.group(3) in scaled:
                found[scale_name(int(match.group(1)), match.group(3))] = name
        return found

    def _decoded(
        self, names: Sequence[str], read: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``read`` with scaled tensors dequantized and floating ones cast to ``dtype``."""
        scales = {name: scale for scale, name in self._scales_of(names).items()}
        out = {}
        for name in names:
            tensor = read[name]
            if name in scales:
                tensor = dequantize(tensor, read[scales[name]], self.dtype or torch.float32)
            elif self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            out[name] = tensor
        return out

    def spans(self) -> dict[str, Span]:
        """Where each tensor lies (the header, checked against the record first)."""
        self._check()
        return self.shard.spans

    def gather(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """Bytes at some places of the shard (see :meth:`Shard.gather`)."""
        self._check()
        return self.shard.gather(offsets, width)

    def gather_many(self, asked: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        """:meth:`gather` of each ``(offsets, width)``, together where the shard can (a
        local shard maps its file once for them all)."""
        self._check()
        together = getattr(self.shard, "gather_many", None)
        if together is not None:
            return list(together(asked))
        return [self.shard.gather(offsets, width) for offsets, width in asked]

    def indices(self, positions: Sequence[int]) -> list[torch.Tensor]:
        """The ``__index__`` of the batches at ``positions``, each checked against its record."""
        read = self.read([f"b{position}/{INDEX_KEY}" for position in positions])
        indices = list(read.values())
        for position, index in zip(positions, indices, strict=True):
            self.record.batches[position].check_indices(index, f"shard {self} batch {position}")
        return indices

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_checked": False}  # each process checks what it reads


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One stored batch of one dataloader: what its record says, and which rows are read.

    ``keep`` marks the rows read (``None``: all of them; see :func:`first_commits`);
    ``without_rows`` are the samples it stored with no row (token rows), those counted here.
    """

    source: CommittedShard
    position: int
    keys: frozenset[str]
    summary: IndexSummary
    keep: torch.Tensor | None = None
    without_rows: tuple[int, ...] = ()

    @property
    def record(self) -> BatchRecord:
        return self.source.record.batches[self.position]

    @property
    def rows(self) -> int:
        """Rows stored."""
        return self.record.rows

    @property
    def kept_rows(self) -> int:
        """Rows read."""
        return self.rows if self.keep is None else int(self.keep.sum())

    @property
    def per_batch(self) -> frozenset[str]:
        """Its keys stored once for the batch, without a row per sample."""
        return self.keys & frozenset(self.source.record.per_batch)

    def dtype(self, key: str) -> str:
        return self.source.record.keys[key]

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The shape of a row of ``key`` (of the whole tensor, for a key stored once per
        batch), where every batch of its shard has the same; else ``None``."""
        shape = self.source.record.shapes.get(key)
        return None if shape is None else tuple(shape)

    def read_indices(self) -> torch.Tensor:
        """The dataset index of every stored row (checked against the record)."""
        name = f"b{self.position}/{INDEX_KEY}"
        return self.check_index(self.source.read_rows([name], 0, self.rows)[name])

    def check_index(self, index: torch.Tensor) -> torch.Tensor:
        """``index``, once it is what the record and summary say of this batch's."""
        where = f"shard {self.source} batch {self.position}"
        self.record.check_indices(index, where)
        self.summary.check(index, where)
        return index

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of this batch that are read (``rows`` has one per stored row)."""
        return rows if self.keep is None else rows[self.keep]

    def kept_indices(self) -> torch.Tensor:
        """The dataset indices of the rows read."""
        return self.kept(self.read_indices())


def stored_batches(sources: Iterable[CommittedShard], dataloader_idx: int) -> list[StoredBatch]:
    """The batches of ``dataloader_idx`` in ``sources`` (in commit order), nothing read from
    a shard of format ``/3``; the header and indices of an older one are read and checked."""
    batches = []
    for source in sources:
        record = source.record
        mine = [p for p, b in enumerate(record.batches) if b.dataloader_idx == dataloader_idx]
        if not mine:
            continue
        if any(record.batches[p].index is None for p in mine):  # formats /1 and /2
            batches += _read_older(source, mine)
            continue
        every = frozenset(record.keys)
        for position in mine:
            batch = record.batches[position]
            keys = every if batch.keys is None else frozenset(batch.keys)
            assert batch.index is not None
            batches.append(StoredBatch(source, position, keys, batch.index))
    return batches


def _read_older(source: CommittedShard, positions: list[int]) -> list[StoredBatch]:
    """Batches of a shard whose record has no index summaries: its header gives each
    batch's keys, its indices their summaries."""
    keys = source.stored_keys()
    indices = source.indices(positions)
    return [
        StoredBatch(source, position, keys[position], IndexSummary.of(index))
        for position, index in zip(positions, indices, strict=True)
    ]


def first_commits(
    batches: Sequence[StoredBatch], *, token_rows: bool
) -> tuple[list[StoredBatch], IndexSet, np.ndarray]:
    """``batches`` (in commit order) set to read each dataset index from its first commit
    only, every index stored (as intervals), and the indices stored more than once
    (ascending; none in a sound store).

    A row per sample: an index in more than one row is duplicated, and its first row is
    read. Token rows (``token_rows``): a sample's rows are stored together, so an index in
    more than one batch is duplicated, and every row of it in its first batch is read.
    Indices are read only for batches that cannot be decided from their summaries.
    """
    seen = IndexSet()
    duplicated: list[np.ndarray] = []
    read: list[StoredBatch] = []
    for batch in batches:
        without = np.asarray(batch.record.without_rows, dtype=np.int64)
        earlier = seen.contains(without) if without.size else np.zeros(0, dtype=bool)
        progression = known_members(batch.summary)
        unique_rows = token_rows or batch.summary.samples == batch.rows
        keep = None
        if not batch.rows:
            pass
        elif progression is None or not unique_rows or seen.overlap(*progression).size:
            index = batch.read_indices().numpy()
            if token_rows:  # every row of a sample not seen before
                fresh = ~seen.contains(index)
                duplicated.append(np.unique(index[~fresh]))
            else:  # the first row of an index not seen before
                fresh = np.zeros(index.size, dtype=bool)
                fresh[np.unique(index, return_index=True)[1]] = True
                fresh &= ~seen.contains(index)
                duplicated.append(index[~fresh])
            keep = None if fresh.all() else torch.from_numpy(fresh)
            seen.add(index)
        else:
            seen.add_progression(*progression)
        if without.size:
            duplicated.append(without[earlier])
            seen.add(without)
        kept = tuple(int(i) for i in without[~earlier])
        if keep is None and kept == batch.without_rows:
            read.append(batch)
        else:
            read.append(
                StoredBatch(batch.source, batch.position, batch.keys, batch.summary, keep, kept)
            )
    found = np.unique(np.concatenate(duplicated)) if duplicated else np.empty(0, np.int64)
    return read, seen, found


def known_members(summary: IndexSummary) -> tuple[int, int, int] | None:
    """``(start, step, count)`` of a batch's distinct indices where its summary tells them:
    a progression in row order, or two samples in any order (its lowest and highest)."""
    if summary.progression is None and summary.samples == 2 and summary.low is not None:
        assert summary.high is not None
        return summary.low, summary.high - summary.low, 2
    return summary.progression


def holds_any(batch: StoredBatch, indices: IndexSet) -> bool:
    """Whether ``batch`` stored any of ``indices`` (read only where its summary cannot tell)."""
    without = batch.record.without_rows
    if without and indices.contains(without).any():
        return True
    progression = known_members(batch.summary)
    if not batch.rows:
        return False
    if progression is not None:
        return bool(indices.overlap(*progression).size)
    return bool(indices.contains(batch.read_indices().numpy()).any())


def read_key(
    batches: Sequence[StoredBatch], key: str
) -> Iterator[tuple[StoredBatch, torch.Tensor, torch.Tensor]]:
    """``(batch, indices, tensor)`` of each of ``batches`` (in commit order, all holding
    ``key``): the dataset indices of the rows it reads, checked, and ``key`` whole; each
    shard opened once."""
    for batch, indices, tensors in read_keys(batches, (key,)):
        yield batch, indices, tensors[key]


def read_keys(
    batches: Sequence[StoredBatch], keys: Sequence[str]
) -> Iterator[tuple[StoredBatch, torch.Tensor, dict[str, torch.Tensor]]]:
    """:func:`read_key` of several keys, all held by every batch, read together."""
    for source, group in itertools.groupby(batches, key=lambda b: b.source):
        held = list(group)
        names = [f"b{b.position}/{name}" for b in held for name in (INDEX_KEY, *keys)]
        tensors = source.read(names)
        for batch in held:
            index = tensors[f"b{batch.position}/{INDEX_KEY}"]
            found = {key: tensors[f"b{batch.position}/{key}"] for key in keys}
            batch.check_index(index)
            for key, tensor in found.items():
                rows = key in batch.per_batch or (tensor.dim() and len(tensor) == batch.rows)
                if not rows:  # the header was checked: the file changed since
                    raise StoreError(f"shard {source} changed while it was read")
            yield batch, batch.kept(index), found


class RowBatch(NamedTuple):
    """One stored batch of a key's rows with their coordinates (see
    :meth:`~lightning_iocatch.FeatureStore.row_batches`): each row's dataset index
    (``indices``), token ``positions`` and ``token_ids`` (``None`` where the store has
    none), and the ``rows``."""

    indices: torch.Tensor
    positions: torch.Tensor | None
    token_ids: torch.Tensor | None
    rows: torch.Tensor


def read_row_batches(
    batches: Sequence[StoredBatch], key: str, coordinates: Sequence[str]
) -> Iterator[RowBatch]:
    """Each of ``batches``' rows of ``key`` with the ``coordinates`` keys it holds of
    ``(POSITION_KEY, TOKEN_ID_KEY)``, the rows read only (see :meth:`StoredBatch.kept`)."""
    for batch, indices, tensors in read_keys(batches, (key, *coordinates)):
        kept = {name: batch.kept(tensor) for name, tensor in tensors.items()}
        position, token_id = (kept.get(name) for name in (POSITION_KEY, TOKEN_ID_KEY))
        yield RowBatch(indices, position, token_id, kept[key])


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
        position, key = int(match.group(1)), match.group(3)
        if match.group(2):
            if key not in record.scaled:
                raise damaged(f"it holds {name!r}, scales of a key the record does not scale")
            continue  # checked with its key's tensor
        batch = record.batches[position]
        rows = batch.rows
        dtype = _DTYPES.get(code, code)
        if key == INDEX_KEY:
            if dtype != "int64" or list(shape) != [rows]:
                raise damaged(f"{name!r} is {dtype} {shape}, the record says int64 [{rows}]")
            continue
        if key not in record.keys or (batch.keys is not None and key not in batch.keys):
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
        if key in record.scaled:
            found = header.get(scale_name(position, key))
            if found is None or (found[0], list(found[1])) != ("F32", list(shape[:1])):
                raise damaged(
                    f"the scales of {name!r} are {found}, the record says F32 {list(shape[:1])}"
                )
    for position, batch in enumerate(record.batches):
        if f"b{position}/{INDEX_KEY}" not in header:
            raise damaged(f"batch {position} has no {INDEX_KEY!r}")
        listed = batch.keys if batch.keys is not None or batch.index is None else record.keys
        lacking = sorted(set(listed or ()) - set(stored[position]))
        if lacking:
            raise damaged(f"batch {position} lacks {lacking}, which the record lists for it")
    if set(record.keys) - seen:
        raise damaged(f"it lacks {sorted(set(record.keys) - seen)}, which the record lists")
    return stored
