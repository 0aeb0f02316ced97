"""FeatureStore: read what FeatureWriter wrote, rows in dataset-index order, ranks merged.

Opening a store reads its JSON metadata, its ledgers and each shard's header (checked
against its ledger record); tensors are memory-mapped from the safetensors shards when
asked for. Nothing is unpickled and no code from the files runs, and only the store's own
files inside its directory are read (see :mod:`lightning_iocatch.store.names`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.commits import LedgerEntry
from lightning_iocatch.store.names import INDEX_KEY
from lightning_iocatch.store.stored_batches import StoredBatch, check_header, read_first_commits
from lightning_iocatch.suggest import close_names

__all__ = ["FeatureStore"]

OnDuplicate = Literal["error", "first"]
_MAX_LISTED = 10_000_000  # missing indices listed one by one
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

    What can be read:

    - ``store[key]``: every row, in dataset-index order (``store.indices``), for a key
      stored with one row per sample in every batch with the same row shape.
    - ``store.rows(key) -> (indices, rows)``: a key present in only some batches (a
      decoding step only some sequences reached, a data-dependent branch, the ``@1`` key
      of a call that did not always happen), with the ascending dataset indices of its own
      rows; ``store.indices_of(key)`` gives those indices without reading the rows.
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
    ) -> None:
        backend = open_backend(path, storage_options)
        if type(dataloader_idx) is not int:
            raise TypeError(f"`dataloader_idx` must be an int, got {dataloader_idx!r}")
        if dataloader_idx < 0:
            raise ValueError(f"`dataloader_idx` must be non-negative, got {dataloader_idx}")
        if on_duplicate not in _ON_DUPLICATE:
            raise ValueError(f"`on_duplicate` must be one of {_ON_DUPLICATE}, got {on_duplicate!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"`verify` must be True or False, got {verify!r}")
        self.path = backend  # str(store.path): the location as given
        self.dataloader_idx = dataloader_idx
        self._info = backend.read_info()
        entries = backend.committed(self._info["format"])
        self._shards = backend.open_shards(entries)
        self._records = [entry.record for entry in entries]
        if verify:
            self.verify()
        present = sorted({b.dataloader_idx for record in self._records for b in record.batches})
        if dataloader_idx not in present and (present or dataloader_idx != 0):
            raise StoreError(
                f"{self.path} holds no captures of dataloader_idx={dataloader_idx}; it holds "
                f"dataloader_idx {present}"
            )
        self._dataloaders = present
        self._batches = [
            batch
            for entry in entries
            if any(b.dataloader_idx == dataloader_idx for b in entry.record.batches)
            for batch in self._read_batches(entry)
        ]
        self._duplicated = self._find_duplicates(on_duplicate)
        kept = [batch.kept_indices for batch in self._batches]
        self._row_indices = torch.cat(kept) if kept else torch.empty(0, dtype=torch.int64)
        without = [batch.without_rows for batch in self._batches]
        self._samples = torch.cat([self._row_indices, *without]).unique()
        self._order = torch.argsort(self._row_indices, stable=True)
        self._dtypes = self._key_dtypes()

    # Opening: every check before any tensor is read

    def _read_batches(self, entry: LedgerEntry) -> list[StoredBatch]:
        """This dataloader's batches of one shard, its header checked against the record."""
        record, shard = entry.record, self._shards[entry.record.file]
        mine = [p for p, b in enumerate(record.batches) if b.dataloader_idx == self.dataloader_idx]
        stored = check_header(shard.header(), entry, shard)
        indices = shard.read([f"b{position}/{INDEX_KEY}" for position in mine])
        batches = []
        for position, index in zip(mine, indices.values(), strict=True):
            record.batches[position].check_indices(index, f"shard {shard} batch {position}")
            batches.append(
                StoredBatch(
                    shard=shard,
                    position=position,
                    shapes=stored[position],
                    dtypes={key: record.keys[key] for key in stored[position]},
                    per_batch=frozenset(record.per_batch) & set(stored[position]),
                    indices=index,
                    keep=None,
                    without_rows=torch.tensor(
                        record.batches[position].without_rows, dtype=torch.int64
                    ),
                )
            )
        return batches

    def _find_duplicates(self, on_duplicate: OnDuplicate) -> list[int]:
        tokens = self._info.get("tokens") or {}
        token_rows = bool(tokens) and tokens.get("reduce") is None
        batches, duplicated = read_first_commits(self._batches, token_rows=token_rows)
        if duplicated.numel() and on_duplicate == "error":
            shards = sorted(
                {
                    b.shard.name
                    for b in self._batches
                    if bool(torch.isin(b.indices, duplicated).any())
                }
            )
            raise StoreError(
                f"{self.path} holds {duplicated.numel()} dataset indices more than once, e.g. "
                f"{duplicated[:10].tolist()} (in {', '.join(shards[:4])}"
                f"{', ...' if len(shards) > 4 else ''}); open it with "
                "FeatureStore(..., on_duplicate='first') to read each index from its first "
                "commit (StoreRows and export_dataset take it too; `lightning-iocatch export "
                "--on-duplicate first`), or `lightning-iocatch inspect` it"
            )
        self._batches = batches
        return [int(value) for value in duplicated.tolist()]

    def _key_dtypes(self) -> dict[str, set[str]]:
        dtypes: dict[str, set[str]] = {}
        for batch in self._batches:
            for key, dtype in batch.dtypes.items():
                dtypes.setdefault(key, set()).add(dtype)
        return dtypes

    # What is stored

    @property
    def metadata(self) -> dict[str, Any]:
        """``store.json`` plus what the ledgers and shards say.

        ``keys``: each key's ``dtype`` and ``shape``: that of one row (for a key stored
        once per batch, of the whole tensor), ``None`` where batches differ.
        ``per_batch``: keys stored once per batch, with their number of batches.
        ``skipped``: keys the writer did not store, with the reason. Also ``shards``,
        ``ranks``, ``bytes`` (of every dataloader), ``dataloaders`` and ``rows``.
        """
        skipped: dict[str, str] = {}
        for record in self._records:
            skipped.update(record.skipped)
        return {
            **self._info,
            "keys": {
                key: {"dtype": "|".join(sorted(self._dtypes[key])), "shape": self._shape(key)}
                for key in self.keys()
            },
            "per_batch": {
                key: sum(key in b.per_batch for b in self._batches)
                for key in self.keys()
                if any(key in b.per_batch for b in self._batches)
            },
            "skipped": skipped,
            "shards": [record.file for record in self._records],
            "ranks": sorted({record.rank for record in self._records}),
            "bytes": sum(record.bytes for record in self._records),
            "dataloaders": list(self._dataloaders),
            "rows": len(self),
        }

    def _shape(self, key: str) -> list[int] | None:
        shapes = {
            b.shapes[key] if key in b.per_batch else b.shapes[key][1:]
            for b in self._batches
            if key in b.shapes
        }
        return list(next(iter(shapes))) if len(shapes) == 1 else None

    def keys(self) -> list[str]:
        """The flat keys of the captured tensors, sorted (also those of only some batches)."""
        return sorted(self._dtypes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._dtypes

    @property
    def indices(self) -> torch.Tensor:
        """The dataset index of each row of ``store[key]``, ascending."""
        return self._row_indices[self._order]

    def __len__(self) -> int:
        return int(self._row_indices.numel())

    def stored_batches(self) -> list[StoredBatch]:
        """This dataloader's stored batches in commit order (rank, shard sequence number,
        position), each with the rows read from it (``keep``; see ``on_duplicate``)."""
        return list(self._batches)

    def duplicated_indices(self) -> list[int]:
        """Dataset indices stored more than once (a sound store has none).

        Only a store opened with ``on_duplicate="first"`` can have any: each is read once.
        """
        return list(self._duplicated)

    def missing_ranges(self, expected: int | None = None) -> list[tuple[int, int]]:
        """The indices absent from ``range(expected)`` (default: up to the largest index
        present), as ascending half-open ranges ``(start, stop)``: one per gap, whatever its
        length (a sparse or damaged index costs one range, not one flag per index).

        Example: a store of indices 0..4 and 8 has ``missing_ranges(10) == [(5, 8), (9, 10)]``.
        """
        if expected is not None and (type(expected) is not int or expected < 0):
            raise ValueError(f"`expected` must be a non-negative int or None, got {expected!r}")
        samples = self._samples
        stop = expected
        if stop is None:
            stop = int(samples[-1]) + 1 if samples.numel() else 0
        ends = torch.cat([torch.tensor([-1]), samples[samples < stop], torch.tensor([stop])])
        gaps = (ends.diff() > 1).nonzero().flatten().tolist()
        return [(int(ends[i]) + 1, int(ends[i + 1])) for i in gaps]

    def missing_indices(self, expected: int | None = None) -> list[int]:
        """Indices absent from ``range(expected)`` (default: up to the largest index present),
        one by one; more than ten million are refused: :meth:`missing_ranges` lists them."""
        ranges = self.missing_ranges(expected)
        count = sum(stop - start for start, stop in ranges)
        if count > _MAX_LISTED:
            raise StoreError(
                f"{count} dataset indices are missing from {self.path}, too many to list one by "
                "one; store.missing_ranges() gives them as ranges"
            )
        return [index for start, stop in ranges for index in range(start, stop)]

    @property
    def samples(self) -> torch.Tensor:
        """The dataset indices of every stored sample, ascending, each once (also those of
        token rows that have no row: no selected token)."""
        return self._samples

    # Reading

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError(f"`key` must be a str, got {type(key).__name__}")
        if key not in self._dtypes:
            close = close_names(key, self._dtypes, cutoff=0.5)  # keeps the key's indices
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise KeyError(f"no key {key!r} in {self.path}{hint or '.'} Keys: {self.keys()}")

    def _holders(self, key: str) -> list[StoredBatch]:
        return [batch for batch in self._batches if key in batch.shapes]

    def _stored(self, key: str) -> Iterator[tuple[StoredBatch, torch.Tensor]]:
        """``key`` of every batch holding it, in commit order, opening each shard once."""
        for shard, group in itertools.groupby(self._holders(key), key=lambda b: b.shard):
            batches = list(group)
            names = [f"b{b.position}/{key}" for b in batches]
            tensors = shard.read(names)
            parts = [(b, tensors[name]) for b, name in zip(batches, names, strict=True)]
            for batch, tensor in parts:
                if tuple(tensor.shape) != batch.shapes[key]:  # the file changed since opening
                    raise StoreError(f"shard {shard} changed while it was read")
            yield from parts

    def indices_of(self, key: str) -> torch.Tensor:
        """The ascending dataset indices of the rows that hold ``key`` (no tensor is read)."""
        self._check_key(key)
        parts = [batch.kept_indices for batch in self._holders(key)]
        return torch.cat(parts).sort().values if parts else torch.empty(0, dtype=torch.int64)

    def batches(self, key: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(dataset_indices, tensor)`` per stored batch holding ``key``, in commit order.

        Reads every key, whatever its shapes: ``tensor`` has one row per index, or, for a
        key stored once per batch (``metadata["per_batch"]``), is that batch's one tensor
        and ``dataset_indices`` its samples, each once (also in a store of token rows).
        """
        self._check_key(key)
        for batch, tensor in self._stored(key):
            indices = batch.kept_indices
            if not indices.numel():
                continue
            if key in batch.per_batch:  # the batch's samples, once each (also for token rows)
                yield indices.unique_consecutive(), tensor
            else:
                yield indices, batch.kept(tensor)

    def _refuse_unless_rows(self, key: str) -> None:
        holders = self._holders(key)
        if any(key in batch.per_batch for batch in holders):
            raise StoreError(
                f"{key!r} is stored once per batch, without a row per sample; read it with "
                f"store.batches({key!r}), which yields (indices, tensor) per batch"
            )
        trailing = sorted({batch.shapes[key][1:] for batch in holders})
        if len(trailing) > 1:
            raise StoreError(
                f"{key!r} has rows of different shapes across batches ({trailing[:3]}...); "
                f"read it per batch with store.batches({key!r})"
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
        for batch, tensor in self._stored(key):
            indices.append(batch.kept_indices)
            parts.append(batch.kept(tensor))
        every = torch.cat(indices)
        order = torch.argsort(every, stable=True)
        if len(parts) == 1 and bool((order == torch.arange(len(order))).all()):
            return every, parts[0]  # memory-mapped, no copy
        return every[order], torch.cat(parts)[order]

    def __getitem__(self, key: str) -> torch.Tensor:
        """All rows of ``key`` in dataset-index order (memory-mapped for a single batch).

        Only for keys with a row for every sample; see :meth:`rows` and :meth:`batches`.
        """
        self._check_key(key)
        self._refuse_unless_rows(key)
        present = sum(int(batch.kept_indices.numel()) for batch in self._holders(key))
        if present != len(self):
            raise StoreError(
                f"{key!r} is stored for {present} of the {len(self)} rows (it was captured in "
                f"only some batches); read it with store.rows({key!r}), which returns "
                "(indices, rows)"
            )
        return self.rows(key)[1]

    def verify(self) -> None:
        """Check every shard's CRC-32 against its ledger record (reads every byte)."""
        for record in self._records:
            shard = self._shards[record.file]
            if shard.crc32() != record.crc32:
                raise StoreError(f"shard {shard} does not match its checksum: it is corrupted")

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, keys={len(self._dtypes)})"
