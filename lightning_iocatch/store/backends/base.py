"""The one interface of a store's place, and of a committed shard read from it.

Everything above the backends (the writing core, the resume and overwrite plan, the reader,
the training reader, export, the command line) works through :class:`StoreBackend` and
:class:`Shard` and never asks where a store lives. Two implementations:

- :class:`~lightning_iocatch.store.backends.local.LocalBackend`, a directory: shards are
  written to a temporary name, fsynced and renamed, then committed by a line appended to
  the rank's ledger; shards are read memory-mapped.
- :class:`~lightning_iocatch.store.backends.objects.ObjectBackend`, a prefix on object
  storage through fsspec: a shard object is uploaded, then committed by its own commit
  record object; shards are read with ranged requests.

The commit point is the same idea in both: a shard without its record (a ledger line, a
commit record) does not exist, and both kinds of record are read wherever the store lives
(a store copied between disk and object storage keeps its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.object_location import ObjectLocation
from lightning_iocatch.store.backends.safetensors_layout import Span
from lightning_iocatch.store.commits import LedgerEntry
from lightning_iocatch.store.records import ShardRecord

__all__ = ["Committed", "Shard", "StoreBackend", "Write", "check_committed_shards"]

Write = Callable[[IO[bytes]], tuple[int, int]]
"""Writes a shard's bytes to an open handle; returns their CRC-32 and size."""


@dataclass(frozen=True)
class Committed:
    """What a store's place holds committed, as read at one moment: the record of every
    committed shard (both kinds of commit point, by rank then sequence number) and, where
    the same listing gave them, the sizes of the objects there (so that the shards can be
    checked without asking again)."""

    entries: list[LedgerEntry]
    sizes: Mapping[str, int] | None = None


def check_committed_shards(
    entries: Sequence[LedgerEntry],
    size_of: Callable[[str], int | None] | None,
    where: Callable[[str], str],
) -> None:
    """Every committed shard recorded once, there, and of its recorded size; a
    :class:`StoreError` naming the shard and its record otherwise. ``size_of(name)``:
    the shard's size, ``None`` where it is missing; ``where(name)``: its path or URL.
    Without ``size_of``, only that each is recorded once."""
    first: dict[str, LedgerEntry] = {}
    for entry in entries:
        name = entry.record.file
        if name in first:
            raise StoreError(
                f"shard {name} is recorded twice, in {first[name].where} and {entry.where}: "
                "the records are damaged"
            )
        first[name] = entry
        if size_of is None:
            continue
        size = size_of(name)
        if size is None:
            raise StoreError(f"shard {where(name)} is committed ({entry.where}) but missing")
        if size != entry.record.bytes:
            raise StoreError(
                f"shard {where(name)} is {size} bytes, its record says {entry.record.bytes} "
                f"({entry.where}): it was truncated or replaced"
            )


class Shard(ABC):
    """A committed shard as a reader sees it; compared by identity. Nothing is read from it
    until asked: its header on first use (then kept), tensors and rows each time.

    ``str(shard)`` is where it is (a path or a URL), for messages.
    """

    name: str

    @abstractmethod
    def header(self) -> dict[str, tuple[str, list[int]]]:
        """Tensor name -> (safetensors dtype code, shape), read once."""

    @abstractmethod
    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (``b{j}/{key}``), whole."""

    @abstractmethod
    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[first, stop)`` of the tensors ``names``, reading only their bytes."""

    @property
    @abstractmethod
    def spans(self) -> dict[str, Span]:
        """Tensor name -> where its bytes lie in the shard (from the header, read once)."""

    @abstractmethod
    def gather(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """The ``width`` bytes at each of ``offsets`` (absolute, in the shard), as a
        ``uint8`` array of ``(len(offsets), width)``, reading about only those bytes."""

    @abstractmethod
    def crc32(self) -> int:
        """The CRC-32 of all of the shard's bytes (reads every byte)."""

    @abstractmethod
    def metadata(self) -> dict[str, str]:
        """The safetensors header's ``__metadata__`` (read with the header, once)."""

    @abstractmethod
    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """The bytes ``[start, end)`` of each of ``ranges`` (absolute, in the shard), read
        together (one request per run of close ranges on object storage)."""


class StoreBackend(ABC):
    """Where a store lives, with the operations every part of the store needs.

    ``str(backend)`` is the location as the user gave it (a path or a URL). A backend
    pickles (DataLoader workers, DDP ranks), making its connections anew in each process.
    """

    @property
    @abstractmethod
    def path(self) -> Path | ObjectLocation:
        """The location: a local directory, or the prefix on object storage."""

    place: str
    """How messages say where the store's bytes are: ``"on disk"``, ``"under the prefix"``."""
    commit_point: str
    """What commits a shard here: ``"ledger line"``, ``"commit record"``."""
    shards_in_flight: int = 1
    """How many shards a writer writes at once here by default."""

    # store.json

    @abstractmethod
    def has_info(self) -> bool:
        """Whether the store's ``store.json`` exists."""

    @abstractmethod
    def read_info(self) -> dict[str, Any]:
        """``store.json``, checked; a :class:`~lightning_iocatch.StoreError` where there is no
        store or it is damaged."""

    @abstractmethod
    def write_info(self, info: Mapping[str, Any]) -> None:
        """Write ``store.json`` at once (creating the place if needed)."""

    # What is there

    @abstractmethod
    def names(self) -> dict[str, int]:
        """Every file or object at the store's place, by name relative to it
        (``commits/r000-000000.json``), with its size: the store's own and anyone else's."""

    @abstractmethod
    def committed(self, store_format: str, *, progress: bool = False) -> Committed:
        """The record of every committed shard, by rank then sequence number (both kinds of
        commit point); damage is an error naming the file and line or object. ``progress``
        (here and below): a bar on stderr where the work can be long (object storage)."""

    @abstractmethod
    def open_shards(self, committed: Committed) -> dict[str, Shard]:
        """Each committed shard by name, once it is there with its recorded size (see
        :func:`check_committed_shards`); nothing is read from it yet."""

    def contains(self, path: Path) -> bool:
        """Whether the local ``path`` is inside the store's place."""
        return False

    def keep_reads(self, limit: int) -> None:  # noqa: B027 (optional: most keep nothing)
        """Let the shards opened keep what their reads map between reads, within ``limit``
        bytes of files (twice a reader's shuffle window, when shuffled); by default they
        keep nothing."""

    def release_reads(self) -> None:  # noqa: B027 (optional: most keep nothing)
        """Let go of what the shards' reads kept (an epoch's end)."""

    # Writing

    @abstractmethod
    def write_shard(self, name: str, write: Write, *, durable: bool) -> tuple[int, int]:
        """Write the shard ``name`` with ``write`` so that it is there whole or not at all;
        ``durable``: on stable storage before this returns. Its CRC-32 and size."""

    @abstractmethod
    def commit(self, record: ShardRecord, *, durable: bool) -> None:
        """Commit ``record``'s shard: from here on it counts."""

    @abstractmethod
    def compact(self, records: Sequence[ShardRecord]) -> None:
        """Gather the records of shards committed by one writer, so that a reader reads
        them at once (object storage: manifests); nothing where they already are (a ledger)."""

    # Cleaning

    @abstractmethod
    def clear(self, names: Mapping[str, int], *, progress: bool = False) -> None:
        """Delete the store's own files or objects among ``names`` (what :meth:`names` gave;
        ``mode="overwrite"``), nothing else: ``store.json`` first, then the commit points,
        then the shards."""

    @abstractmethod
    def clean_for_resume(self, store_format: str, *, progress: bool = False) -> Committed:
        """Make the store ready to continue (``mode="resume"``): complete or cut the last
        ledger lines, delete what no record commits (debris of a killed run) and nothing
        else. What is committed, as :meth:`committed` gives it."""
