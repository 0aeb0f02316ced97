"""FeatureStore: read what FeatureWriter wrote, rows in dataset-index order, ranks merged.

Opening a store reads its JSON metadata and ledgers only; tensors are memory-mapped from
the safetensors shards when asked for. Nothing is unpickled and no code from the files runs.
"""

from __future__ import annotations

import difflib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.ledger import (
    INDEX_KEY,
    ShardRecord,
    file_crc32,
    read_ledgers,
    read_store_json,
)

__all__ = ["FeatureStore"]


@dataclass(frozen=True)
class _BatchLocation:
    shard: Path
    position: int
    rows: int


class FeatureStore:
    """A feature store on disk: ``store[key]`` is a tensor with one row per sample.

    Args:
        path: the directory a :class:`~lightning_iocatch.FeatureWriter` wrote.
        dataloader_idx: which predict dataloader's captures to read.

    ``store.keys()`` lists the flat keys (``"model.h.0/outputs"``), ``store.indices`` the
    dataset indices present (sorted), ``len(store)`` their count, ``store.metadata`` the
    spec, dtypes, library versions and shards. Rows of ``store[key]`` are in dataset-index
    order, whichever rank wrote them. Batches whose trailing shapes differ (variable
    sequence length) are read per batch with :meth:`batches`. A dump is shown in
    :class:`~lightning_iocatch.FeatureWriter`'s example; the command line
    ``lightning-iocatch inspect PATH`` prints the same facts.
    """

    def __init__(self, path: str | os.PathLike[str], *, dataloader_idx: int = 0) -> None:
        self.path = Path(path)
        self._info = read_store_json(self.path)
        self._records = read_ledgers(self.path)
        self.dataloader_idx = dataloader_idx
        self._batches: list[_BatchLocation] = []
        self._dtypes: dict[str, str] = {}
        self._shapes: dict[str, list[int] | None] = {}
        for record in self._records:
            shard = self._checked_shard(record)
            mine = [
                _BatchLocation(shard, position, batch.rows)
                for position, batch in enumerate(record.batches)
                if batch.dataloader_idx == dataloader_idx
            ]
            if mine:
                self._batches += mine
                self._note_keys(record)
        self._row_indices = self._read_indices()
        self._order = torch.argsort(self._row_indices, stable=True)

    def _note_keys(self, record: ShardRecord) -> None:
        self._dtypes.update(record.keys)
        for key, shape in record.shapes.items():
            known = self._shapes.setdefault(key, shape)
            if known != shape:
                self._shapes[key] = None

    def _checked_shard(self, record: ShardRecord) -> Path:
        shard = self.path / record.file
        if not shard.is_file():
            raise StoreError(f"shard {shard} is in the ledger but missing on disk")
        size = shard.stat().st_size
        if size != record.bytes:
            raise StoreError(
                f"shard {shard} is {size} bytes, the ledger says {record.bytes}: it was "
                "truncated or replaced"
            )
        return shard

    def _parts(self, key: str) -> Iterator[torch.Tensor]:
        """``key`` of every stored batch, in writing order, opening each shard once."""
        for shard, group in itertools.groupby(self._batches, key=lambda location: location.shard):
            try:
                with safe_open(shard, framework="pt") as handle:
                    names = set(handle.keys())
                    tensors = []
                    for location in group:
                        name = f"b{location.position}/{key}"
                        if name not in names:
                            raise StoreError(
                                f"{key!r} was not captured in batch {location.position} of {shard}"
                            )
                        tensors.append(handle.get_tensor(name))  # memory-mapped
            except SafetensorError as error:
                raise StoreError(f"shard {shard} is corrupted: {error}") from error
            yield from tensors

    def _read_indices(self) -> torch.Tensor:
        parts = list(self._parts(INDEX_KEY))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    @property
    def metadata(self) -> dict[str, Any]:
        """``store.json`` plus what the ledgers say: keys (dtype, row shape), shards, ranks, bytes.

        A key's ``shape`` is that of one row, ``None`` where batches differ.
        """
        return {
            **self._info,
            "keys": {
                key: {"dtype": self._dtypes[key], "shape": self._shapes.get(key)}
                for key in self.keys()
            },
            "shards": [record.file for record in self._records],
            "ranks": sorted({record.rank for record in self._records}),
            "bytes": sum(record.bytes for record in self._records),
            "rows": len(self),
        }

    def keys(self) -> list[str]:
        """The flat keys of the captured tensors, sorted."""
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

    def duplicated_indices(self) -> list[int]:
        """Dataset indices present more than once (a sound store has none)."""
        values, counts = torch.unique(self._row_indices, return_counts=True)
        return values[counts > 1].tolist()

    def missing_indices(self, expected: int | None = None) -> list[int]:
        """Indices absent from ``range(expected)`` (default: up to the largest index present)."""
        total = expected
        if total is None:
            total = int(self._row_indices.max()) + 1 if len(self) else 0
        present = torch.zeros(total, dtype=torch.bool)
        inside = self._row_indices[self._row_indices < total]
        present[inside] = True
        return torch.nonzero(~present).flatten().tolist()

    def _check_key(self, key: str) -> None:
        if key not in self._dtypes:
            close = difflib.get_close_matches(key, list(self._dtypes), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise KeyError(f"no key {key!r} in {self.path}{hint} Keys: {self.keys()}")

    def batches(self, key: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(dataset_indices, tensor)`` per stored batch, in writing order."""
        self._check_key(key)
        yield from zip(self._parts(INDEX_KEY), self._parts(key), strict=True)

    def __getitem__(self, key: str) -> torch.Tensor:
        """All rows of ``key`` in dataset-index order (memory-mapped for a single batch)."""
        self._check_key(key)
        parts = list(self._parts(key))
        trailing = {tuple(part.shape[1:]) for part in parts}
        if len(trailing) > 1:
            raise StoreError(
                f"{key!r} has rows of different shapes across batches ({sorted(trailing)[:3]}...); "
                f"read it per batch with store.batches({key!r})"
            )
        if len(parts) == 1 and bool((self._order == torch.arange(len(self))).all()):
            return parts[0]
        return torch.cat(parts)[self._order]

    def verify(self) -> None:
        """Check every shard's CRC-32 against the ledger (reads every byte)."""
        for record in self._records:
            shard = self.path / record.file
            if file_crc32(shard) != record.crc32:
                raise StoreError(f"shard {shard} does not match its checksum: it is corrupted")

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, keys={len(self._dtypes)})"
