"""FeatureStore: read what FeatureWriter wrote, rows in dataset-index order, ranks merged.

Opening a store reads its JSON metadata and its commit records, nothing of its shards
(format ``/3``; see :mod:`~lightning_iocatch.store.stored_batches`): its memory grows with
the batches, not the rows. A shard's header is checked against its record before its
first tensor is read; tensors are memory-mapped from the safetensors shards (or read with
ranged requests) when asked for. Nothing is unpickled and no code from the files runs, and
only the store's own files inside its place are read (see :mod:`lightning_iocatch.store.names`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from lightning_iocatch.checks import parse_read_dtype
from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.backends.coded import CodedShard, KeptBlocks
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.coverage import gaps, listed, refuse_duplicates, sample_array
from lightning_iocatch.store.names import POSITION_KEY, TOKEN_ID_KEY
from lightning_iocatch.store.progress import progress_bar, show_progress
from lightning_iocatch.store.sample_rows import RowLookup, SampleRows, as_indices
from lightning_iocatch.store.stored_batches import (
    CommittedShard,
    RowBatch,
    StoredBatch,
    first_commits,
    read_key,
    read_row_batches,
    stored_batches,
)
from lightning_iocatch.suggest import close_names

__all__ = ["FeatureStore"]

OnDuplicate = Literal["error", "first"]
"""What a reader does with a sample stored twice: refuse the store, or keep its first commit."""
_ON_DUPLICATE = ("error", "first")


class FeatureStore:
    """A feature store on disk: ``store[key]`` is a tensor with one row per sample.

    Args:
        path: the directory a :class:`~lightning_iocatch.FeatureWriter` wrote, or its fsspec
            URL (``s3://bucket/run``): then opening reads the commit records and each shard's
            header with ranged requests, and a key's rows are read with ranged requests of
            their tensors, never whole shards (see :mod:`~.backends.ranged_reads`).
        dataloader_idx: which predict dataloader's captures to read; one the store does
            not hold is refused, naming those it holds.
        on_duplicate: what to do when the store holds a dataset index more than once (a
            sound dump never does): ``"error"`` (default) refuses to open it, naming the
            indices; ``"first"`` reads each such index from its first commit, commits
            ordered by (rank, shard sequence number, batch position in the shard) — each
            rank's ledger order, ranks in ascending order, the same on every read — and
            drops the later copies. :meth:`duplicated_indices` lists them either way.
        verify: check every shard's CRC-32 (reading every byte) before reading anything
            from the shards, as :meth:`verify` does.
        storage_options: fsspec options for a URL ``path`` (credentials, endpoint, ...).
        dtype: the floating dtype (or its name) every floating key is read as. Default
            ``None``: as stored (``bfloat16`` stays ``bfloat16``), except that a key stored
            in 8-bit floats with a scale per row (``FeatureWriter(dtype="float8_e4m3fn")``)
            is read dequantized as float32 (``metadata["keys"][key]["scaled"]`` says so).
        progress: progress bars on stderr for :meth:`verify` (per shard checked) and, on
            object storage, for reading the commit records when opening: ``True``,
            ``False``, or ``None`` (default) for bars only when stderr is a terminal.

    What can be read:

    - ``store[key]``: every row, in dataset-index order (``store.indices``), for a key
      stored with one row per sample in every batch with the same row shape.
    - ``store.rows(key) -> (indices, rows)``: a key present in only some batches (a
      decoding step only some sequences reached, a data-dependent branch, the ``@1`` key
      of a call that did not always happen), with the ascending dataset indices of its own
      rows; ``store.indices_of(key)`` gives those indices without reading the rows.
    - ``store.rows_at(key, indices)``: the rows of chosen samples in the order asked (e.g.
      a batch's, to patch them into another run), reading only the batches holding them.
    - ``store.batches(key)`` yields ``(indices, tensor)`` per stored batch: for a key whose
      row shape differs between batches (sequence length varying by batch), and for a key
      stored once per batch without a row per sample (``metadata["per_batch"]``, e.g.
      rotary embeddings with batch dimension 1), whose ``tensor`` applies to all of that
      batch's ``indices``.

    ``store[key]`` and ``store.rows(key)`` refuse what they cannot return exactly, naming
    the method that reads it. ``store.keys()`` lists every stored key, ``len(store)`` and
    ``store.indices`` count the rows (dataset indices) of the dataloader, ``store.metadata``
    has the spec, dtypes, library versions and shards. The command line ``lightning-iocatch
    inspect PATH`` prints the same facts.

    Damage is never read silently: a ledger line that is not a valid record or fails its
    checksum, a ledger record naming a file that is not one of the store's shards, a
    symbolic link leading outside the directory, a shard whose size or header disagrees
    with its record: each raises :class:`~lightning_iocatch.StoreError` naming the file
    (and the ledger line). The checks see the directory as it is when read; a store being
    changed by another process while it is read is not protected against.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | StoreBackend,
        *,
        dataloader_idx: int = 0,
        on_duplicate: OnDuplicate = "error",
        verify: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        backend = open_backend(path, storage_options)
        self.dtype = parse_read_dtype("dtype", dtype)
        self._progress = show_progress(progress)
        if type(dataloader_idx) is not int:
            raise TypeError(f"`dataloader_idx` must be an int, got {dataloader_idx!r}")
        if dataloader_idx < 0:
            raise ValueError(f"`dataloader_idx` must be non-negative, got {dataloader_idx}")
        if on_duplicate not in _ON_DUPLICATE:
            raise ValueError(f"`on_duplicate` must be one of {_ON_DUPLICATE}, got {on_duplicate!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"`verify` must be True or False, got {verify!r}")
        self.backend = backend
        self.path = backend.path  # a local directory, or an ObjectLocation
        self.dataloader_idx = dataloader_idx
        self._info = backend.read_info()
        committed = backend.committed(self._info["format"], progress=self._progress)
        shards = backend.open_shards(committed)
        self._records = [entry.record for entry in committed.entries]
        self._kept = KeptBlocks()  # decoded blocks of shards written with a codec
        self._sources = [
            CommittedShard(shards[e.record.file], e, self.dtype, self._kept)
            for e in committed.entries
        ]
        if verify:
            self.verify()
        present = sorted({b.dataloader_idx for record in self._records for b in record.batches})
        if dataloader_idx not in present and (present or dataloader_idx != 0):
            raise StoreError(
                f"{self.path} holds no captures of dataloader_idx={dataloader_idx}; it holds "
                f"dataloader_idx {present}"
            )
        self._dataloaders = present
        tokens = self._info.get("tokens") or {}
        stored = stored_batches(self._sources, dataloader_idx)
        token_rows = bool(tokens) and tokens.get("reduce") is None
        self._token_rows = token_rows
        self._lookups: dict[str, RowLookup] = {}
        self._batches, self._samples, duplicated = first_commits(stored, token_rows=token_rows)
        if duplicated.size and on_duplicate == "error":
            refuse_duplicates(self.path, stored, duplicated)
        self._duplicated = duplicated
        self._rows = sum(batch.kept_rows for batch in self._batches)
        self._dtypes: dict[str, set[str]] = {}
        for batch in self._batches:
            for key in batch.keys:
                self._dtypes.setdefault(key, set()).add(batch.dtype(key))
        self._sorted_indices: torch.Tensor | None = None

    # What is stored

    @property
    def metadata(self) -> dict[str, Any]:
        """``store.json`` plus what the commit records say (no shard is read).

        ``keys``: each key's stored ``dtype`` and ``shape``: that of one row (for a key
        stored once per batch, of the whole tensor), ``None`` where batches differ; a key
        stored in 8-bit floats with a scale per row also has ``"scaled": "row"`` and
        ``"read_as"``, the dtype it is read as.
        ``per_batch``: keys stored once per batch, with their number of batches.
        ``skipped``: keys the writer did not store, with the reason. ``codecs``: the
        lossless codecs of its shards (``[]`` for none; invisible to reads). Also ``shards``,
        ``ranks``, ``bytes`` (of every dataloader), ``dataloaders`` and ``rows``.
        """
        skipped = {key: why for record in self._records for key, why in record.skipped.items()}
        per_batch = Counter(key for batch in self._batches for key in batch.per_batch)
        return {
            **self._info,
            "keys": {key: self._key_info(key) for key in self.keys()},
            "per_batch": dict(sorted(per_batch.items())),
            "skipped": skipped,
            "shards": [record.file for record in self._records],
            "codecs": sorted({r.codec for r in self._records if r.codec is not None}),
            "ranks": sorted({record.rank for record in self._records}),
            "bytes": sum(record.bytes for record in self._records),
            "dataloaders": list(self._dataloaders),
            "rows": len(self),
        }

    def _key_info(self, key: str) -> dict[str, Any]:
        info = {"dtype": "|".join(sorted(self._dtypes[key])), "shape": self._shape(key)}
        if any(key in batch.source.record.scaled for batch in self._holders(key)):
            read_as = self.dtype or torch.float32
            info |= {"scaled": "row", "read_as": str(read_as).removeprefix("torch.")}
        return info

    def _shape(self, key: str) -> list[int] | None:
        shapes = {batch.shape(key) for batch in self._holders(key)}
        shape = next(iter(shapes)) if len(shapes) == 1 else None
        return None if shape is None else list(shape)

    def keys(self) -> list[str]:
        """The flat keys of the captured tensors, sorted (also those of only some batches)."""
        return sorted(self._dtypes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._dtypes

    @property
    def indices(self) -> torch.Tensor:
        """The dataset index of each row of ``store[key]``, ascending (read at first use)."""
        if self._sorted_indices is None:
            parts = [batch.kept_indices() for batch in self._batches]
            every = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
            self._sorted_indices = every.sort(stable=True).values
        return self._sorted_indices

    def __len__(self) -> int:
        return self._rows

    def row_count(self, key: str) -> int:
        """The number of rows that hold ``key`` (of batches, for a key stored once per batch)."""
        self._check_key(key)
        return sum(batch.kept_rows for batch in self._holders(key))

    def stored_batches(self) -> list[StoredBatch]:
        """This dataloader's stored batches in commit order (rank, shard sequence number,
        position), each with the rows read from it (``keep``; see ``on_duplicate``)."""
        return list(self._batches)

    def duplicated_indices(self) -> list[int]:
        """Dataset indices stored more than once (a sound store has none).

        Only a store opened with ``on_duplicate="first"`` can have any: each is read once.
        """
        return self._duplicated.tolist()

    def missing_ranges(
        self, expected: int | None = None, *, limit: int | None = None
    ) -> list[tuple[int, int]]:
        """The indices absent from ``range(expected)`` (default: up to the largest index
        present), as ascending half-open ranges ``(start, stop)``: one per gap, whatever its
        length (a sparse or damaged index costs one range, not one flag per index); the
        first ``limit`` of them where given.

        Example: a store of indices 0..4 and 8 has ``missing_ranges(10) == [(5, 8), (9, 10)]``.
        """
        return gaps(self._samples, expected, limit)

    def missing_count(self, expected: int | None = None) -> int:
        """How many indices :meth:`missing_ranges` holds."""
        return sum(stop - start for start, stop in self.missing_ranges(expected))

    def missing_indices(self, expected: int | None = None) -> list[int]:
        """Indices absent from ``range(expected)`` (default: up to the largest index present),
        one by one; more than ten million are refused: :meth:`missing_ranges` lists them."""
        return listed(self.missing_ranges(expected), self.path)

    @property
    def sample_count(self) -> int:
        """The number of stored samples (also those of token rows that have no row)."""
        return len(self._samples)

    @property
    def samples(self) -> torch.Tensor:
        """The dataset indices of every stored sample, ascending, each once (also those of
        token rows that have no row: no selected token). Made on each call, one int64 per
        sample: :attr:`sample_count` and :meth:`missing_ranges` need no such array."""
        return sample_array(self._samples)

    # Reading

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError(f"`key` must be a str, got {type(key).__name__}")
        if key not in self._dtypes:
            close = close_names(key, self._dtypes, cutoff=0.5)  # keeps the key's indices
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise KeyError(f"no key {key!r} in {self.path}{hint or '.'} Keys: {self.keys()}")

    def _holders(self, key: str) -> list[StoredBatch]:
        return [batch for batch in self._batches if key in batch.keys]

    def indices_of(self, key: str) -> torch.Tensor:
        """The ascending dataset indices of the rows that hold ``key`` (reads their
        ``__index__`` tensors, nothing else)."""
        self._check_key(key)
        parts = [batch.kept_indices() for batch in self._holders(key)]
        return torch.cat(parts).sort().values if parts else torch.empty(0, dtype=torch.int64)

    def batches(self, key: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(dataset_indices, tensor)`` per stored batch holding ``key``, in commit order.

        Reads every key, whatever its shapes: ``tensor`` has one row per index, or, for a
        key stored once per batch (``metadata["per_batch"]``), is that batch's one tensor
        and ``dataset_indices`` its samples, each once (also in a store of token rows).
        """
        self._check_key(key)
        for batch, indices, tensor in read_key(self._holders(key), key):
            if not indices.numel():
                continue
            if key in batch.per_batch:  # the batch's samples, once each (also for token rows)
                yield indices.unique_consecutive(), tensor
            else:
                yield indices, batch.kept(tensor)

    def row_batches(self, key: str, share: tuple[int, int] = (0, 1)) -> Iterator[RowBatch]:
        """Yield each stored batch of ``key``'s rows with their coordinates, in commit order:
        ``RowBatch(indices, positions, token_ids, rows)`` (``positions``, ``token_ids``:
        ``None`` where the store has none). A sample's token rows all come in one batch, in
        position order: one pass reads each row once with its neighbours. ``share=(r, n)``
        reads only every ``n``-th batch from the ``r``-th: one process's share of ``n``."""
        self._check_key(key)
        self._refuse_unless_rows(key, any_shape=True)
        holders = self._holders(key)
        coordinates = [
            name
            for name in (POSITION_KEY, TOKEN_ID_KEY)
            if name != key and all(name in batch.keys for batch in holders)
        ]
        part, parts = share
        yield from read_row_batches(holders[part::parts], key, coordinates)

    def _refuse_unless_rows(self, key: str, *, any_shape: bool = False) -> None:
        holders = self._holders(key)
        if any(key in batch.per_batch for batch in holders):
            raise StoreError(
                f"{key!r} is stored once per batch, without a row per sample; read it with "
                f"store.batches({key!r}), which yields (indices, tensor) per batch"
            )
        if not any_shape and self._shape(key) is None:
            raise StoreError(
                f"{key!r} has rows of different shapes across batches; read it per batch "
                f"with store.batches({key!r})"
            )
        if len(self._dtypes[key]) > 1:
            raise StoreError(
                f"{key!r} is stored as {' and '.join(sorted(self._dtypes[key]))} in different "
                f"batches; read it per batch with store.batches({key!r})"
            )

    def rows(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, rows)``: the rows of ``key`` and their ascending dataset indices.

        For every key with one row per sample, also one present in only some batches
        (``rows[i]`` belongs to dataset sample ``indices[i]``); rows of different shapes
        and tensors stored once per batch are refused, naming :meth:`batches`.
        """
        self._check_key(key)
        self._refuse_unless_rows(key)
        indices, parts = [], []
        for batch, kept, tensor in read_key(self._holders(key), key):
            indices.append(kept)
            parts.append(batch.kept(tensor))
        every = torch.cat(indices)
        order = torch.argsort(every, stable=True)
        if len(parts) == 1 and bool((order == torch.arange(len(order))).all()):
            return every, parts[0]  # memory-mapped, no copy
        return every[order], torch.cat(parts)[order]

    def rows_at(self, key: str, indices: Sequence[int] | torch.Tensor) -> SampleRows:
        """The rows of ``key`` of the samples ``indices`` (dataset indices, in any order,
        repeats allowed), in that order: ``SampleRows(rows, sample, position)``; for a
        store of one row per sample ``rows[i]`` is sample ``indices[i]``'s; for token rows,
        each sample's rows with their positions (see
        :class:`~lightning_iocatch.store.sample_rows.SampleRows`). Reads only the stored
        batches that hold some of them, skipping the others on their records' summaries.

        Raises:
            StoreError: an index the store does not hold, or holds without a row of
                ``key``, naming them and the store; rows of different shapes or dtypes.
        """
        self._check_key(key)
        self._refuse_unless_rows(key, any_shape=True)
        if key not in self._lookups:
            self._lookups[key] = RowLookup(
                self._holders(key),
                key,
                positions=POSITION_KEY in self._dtypes and key != POSITION_KEY,
                token_rows=self._token_rows,
                store=f"the store {self.path}"
                + (f" (dataloader_idx={self.dataloader_idx})" if self.dataloader_idx else ""),
                samples=self._samples,
            )
        return self._lookups[key].read(as_indices(indices))

    def mean(self, key: str) -> torch.Tensor:
        """The mean row of ``key`` over its rows (each sample once), accumulated in float64
        one stored batch at a time; e.g. for ``Mean(module, store.mean(key))`` ablation, or
        ``Steer(module, a.mean(key) - b.mean(key))``."""
        self._check_key(key)
        self._refuse_unless_rows(key)
        total, count = torch.zeros(self._shape(key) or (), dtype=torch.float64), 0
        for batch, _, tensor in read_key(self._holders(key), key):
            rows = batch.kept(tensor)
            total += rows.to(torch.float64).sum(0)
            count += len(rows)
        if not count:
            raise StoreError(f"{key!r} has no rows in {self.path}: it has no mean")
        return total / count

    def __getitem__(self, key: str) -> torch.Tensor:
        """All rows of ``key`` in dataset-index order (memory-mapped for a single batch).

        Only for keys with a row for every sample; see :meth:`rows` and :meth:`batches`.
        """
        self._check_key(key)
        self._refuse_unless_rows(key)
        present = self.row_count(key)
        if present != len(self):
            raise StoreError(
                f"{key!r} is stored for {present} of the {len(self)} rows (it was captured in "
                f"only some batches); read it with store.rows({key!r}), which returns "
                "(indices, rows)"
            )
        return self.rows(key)[1]

    def verify(self) -> None:
        """Check every shard's CRC-32 against its record, and every batch's ``__index__``
        against its summary (reads every byte), with a bar per shard where the store shows
        them (its ``progress``)."""
        shards = len(self._sources)
        with progress_bar(self._progress, "verify", total=shards, unit="shard") as advance:
            for source in self._sources:
                if source.shard.crc32() != source.record.crc32:
                    if isinstance(source.shard, CodedShard):
                        source.shard.check_blocks()  # names the damaged block, where one is
                    raise StoreError(f"shard {source} does not match its checksum: it is corrupted")
                source.indices(range(len(source.record.batches)))
                advance(1)

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, keys={len(self._dtypes)})"
