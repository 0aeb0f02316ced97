"""A store in a local directory: a temporary file, fsync, rename, then a ledger line.

The POSIX protocol of :class:`LocalBackend`:

1. **Write the shard** to ``shard-r{rank}-{seq}.safetensors.tmp``, fsync it (``durable``),
   rename it to its final name, fsync the directory: it appears whole or not at all.
2. **Then append its ledger line** to ``ledger-r{rank}.jsonl`` and fsync it: the commit
   point (see :mod:`lightning_iocatch.store.commits`). A shard without one does not exist.
3. **Readers** read the ledgers (and the ``commits/`` of a store downloaded from object
   storage), check that each committed shard is there with its recorded size, and map the
   shards' tensors with safetensors (``safe_open``) only while they are read; rows read
   at random places come from mappings kept within a reader's budget (``local_mapping``).
4. ``mode="resume"`` completes or cuts the ledgers' last lines and deletes the debris of a
   killed run (``.tmp`` files, shards without a record, temporary files of safetensors'
   own serializer carrying this store's mark); ``mode="overwrite"`` deletes the store's own
   files. Nothing else in the directory is touched.

Only the store's own files directly inside its directory are read or written
(:mod:`lightning_iocatch.store.backends.local_files`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import (
    Committed,
    Shard,
    StoreBackend,
    Write,
    check_committed_shards,
)
from lightning_iocatch.store.backends.local_files import (
    check_own_path,
    fsync_dir,
    open_own_file,
    read_store_json,
    write_json_atomic,
)
from lightning_iocatch.store.backends.local_mapping import KeptMappings, opened_shard
from lightning_iocatch.store.backends.local_records import (
    append_ledger,
    delete_commit_files,
    drop_torn_tail,
    file_crc32,
    read_commit_files,
    read_ledger_entries,
)
from lightning_iocatch.store.backends.safetensors_layout import (
    Span,
    header_length,
    header_metadata,
    parse_header,
    row_range,
    to_tensor,
)
from lightning_iocatch.store.names import (
    COMMITS,
    STORE_FILE,
    is_serializer_temp,
    is_store_file,
    ledger_name,
    ledger_rank,
    shard_rank_and_seq,
)
from lightning_iocatch.store.records import ShardRecord, format_version

__all__ = ["LocalBackend", "LocalShard"]

_SERIALIZER_MARK = b'"format":"lightning-iocatch-store/'


class LocalShard(Shard):
    """A committed shard on disk: whole tensors memory-mapped by safetensors while they are
    kept; rows read with ``pread`` at the places its header (parsed once) gives, or
    gathered from the file mapped (kept mapped between reads by ``mappings``, shared by a
    store's shards, within its budget: none by default)."""

    def __init__(self, path: Path, mappings: KeptMappings | None = None) -> None:
        self.path, self.name = path, path.name
        self.mappings = mappings if mappings is not None else KeptMappings()
        self._spans: dict[str, Span] | None = None
        self._metadata: dict[str, str] | None = None

    def __str__(self) -> str:
        return str(self.path)

    @property
    def spans(self) -> dict[str, Span]:
        if self._spans is None:
            with self._file() as fd:
                size = os.fstat(fd).st_size
                length = header_length(os.pread(fd, 8, 0), str(self))
                if 8 + length > size:
                    raise StoreError(f"shard {self} is corrupted: its header runs past its end")
                raw = os.pread(fd, length, 8)
                self._spans = parse_header(raw, size, str(self))
                self._metadata = header_metadata(raw, str(self))
        return self._spans

    def metadata(self) -> dict[str, str]:
        self.spans  # noqa: B018 (reads the header once)
        assert self._metadata is not None
        return self._metadata

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of the file mapped, no copy (a coded shard's blocks are decoded from them:
        a third less CPU than a ``pread`` of each); the mapping ends with the last view."""
        if not ranges:
            return []
        with self._file() as fd:
            size = os.fstat(fd).st_size
            if size < max(end for _, end in ranges):
                raise StoreError(f"shard {self} changed while it was read")
            if not size:  # nothing to map: every range is empty
                return [memoryview(b"") for _ in ranges]
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        view = memoryview(mapped)
        return [view[start:end] for start, end in ranges]

    def header(self) -> dict[str, tuple[str, list[int]]]:
        return {name: (span.code, list(span.shape)) for name, span in self.spans.items()}

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Views of the mapped file, mapped only as long as they are kept."""
        with self._open() as handle:
            return {name: handle.get_tensor(name) for name in names}

    def read_rows(self, names: Sequence[str], first: int, stop: int) -> dict[str, torch.Tensor]:
        """The rows, copied: one ``pread`` of each tensor's rows."""
        spans = [row_range(self.spans[name], first, stop) for name in names]
        with self._file() as fd:
            data = [os.pread(fd, span.end - span.start, span.start) for span in spans]
        if any(len(raw) != span.end - span.start for raw, span in zip(data, spans, strict=True)):
            raise StoreError(f"shard {self} changed while it was read")
        return {n: to_tensor(raw, span) for n, raw, span in zip(names, data, spans, strict=True)}

    def gather(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """The bytes, copied out of the file mapped (see :meth:`gather_many`)."""
        return self.gather_many([(offsets, width)])[0]

    def gather_many(self, asked: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        """:meth:`gather` of each ``(offsets, width)`` of ``asked``, the file mapped once for
        them all (a row's values and its scale: one mapping, not two), and kept mapped
        between reads within its store's budget (:mod:`.local_mapping`)."""
        return self.mappings.gather(str(self.path), asked)

    def crc32(self) -> int:
        return file_crc32(self.path)

    @contextlib.contextmanager
    def _open(self) -> Any:
        try:
            with safe_open(self.path, framework="pt") as handle:
                yield handle
        except SafetensorError as error:
            raise StoreError(f"shard {self.path} is corrupted: {error}") from error

    def _file(self) -> contextlib.AbstractContextManager[int]:
        return opened_shard(self.path)


class LocalBackend(StoreBackend):
    """A store in the local directory ``root`` (see the module docstring)."""

    place = "on disk"
    commit_point = "ledger line"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mappings = KeptMappings()  # shared by the shards it opens

    @property
    def path(self) -> Path:
        return self.root

    def keep_reads(self, limit: int) -> None:
        """Keep shards mapped between reads while their files add up to at most ``limit``
        bytes (see :mod:`.local_mapping`)."""
        self.mappings.resize(limit)

    def release_reads(self) -> None:
        self.mappings.release()

    def __str__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalBackend) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def contains(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root.resolve())

    # store.json

    def has_info(self) -> bool:
        return os.path.lexists(self.root / STORE_FILE)

    def read_info(self) -> dict[str, Any]:
        return read_store_json(self.root)

    def write_info(self, info: Mapping[str, Any]) -> None:
        with self._errors("prepare the feature store"):
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.root / STORE_FILE, dict(info))

    # What is there

    def names(self) -> dict[str, int]:
        """Files and links by name, other directories as ``name/``, and the files of a
        ``commits/`` folder as ``commits/{name}``."""
        try:
            listed = _list_dir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found: dict[str, int] = {}
        for name in listed:
            path = self.root / name
            if not path.is_dir() or path.is_symlink():
                found[name] = path.lstat().st_size if os.path.lexists(path) else 0
            elif name != COMMITS:
                found[name + "/"] = 0
            else:
                for entry in os.scandir(path):
                    found[f"{COMMITS}/{entry.name}"] = entry.stat(follow_symlinks=False).st_size
        return found

    def committed(self, store_format: str, *, progress: bool = False) -> Committed:
        """Local records read in a moment: no bar (``progress`` is ignored)."""
        version = format_version(store_format)
        entries = read_ledger_entries(self.root, version)
        entries += read_commit_files(self.root, store_format=store_format)
        return Committed(sorted(entries, key=lambda entry: entry.commit_order))

    def open_shards(self, committed: Committed) -> dict[str, Shard]:
        def size_of(name: str) -> int | None:
            path = check_own_path(self.root, name)
            if os.path.lexists(path) and not path.is_file():
                raise StoreError(f"shard {path} is committed but is not a regular file")
            return path.stat().st_size if path.is_file() else None

        check_committed_shards(committed.entries, size_of, lambda name: str(self.root / name))
        return {
            entry.record.file: LocalShard(self.root / entry.record.file, self.mappings)
            for entry in committed.entries
        }

    # Writing

    def write_shard(self, name: str, write: Write, *, durable: bool) -> tuple[int, int]:
        """``.tmp``, fsync, rename, fsync the directory; a failed write leaves no ``.tmp``."""
        tmp, final = self.root / (name + ".tmp"), self.root / name
        created = False
        try:
            with open_own_file(self.root, tmp.name, "xb") as handle:
                created = True
                crc, size = write(handle)
                if durable:
                    os.fsync(handle.fileno())
            os.replace(tmp, final)
            created = False
            if durable:
                fsync_dir(self.root)
        except BaseException as error:
            if created:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            if isinstance(error, OSError):
                raise StoreError(f"could not write shard {final}: {error}") from error
            raise
        return crc, size

    def commit(self, record: ShardRecord, *, durable: bool) -> None:
        """Append the record's line to its rank's ledger (always fsynced: the commit point)."""
        try:
            append_ledger(self.root / ledger_name(record.rank), record)
        except OSError as error:
            raise StoreError(
                f"shard {self.root / record.file} was written but its ledger line could not "
                f"be: {error}"
            ) from error

    def compact(self, records: Sequence[ShardRecord]) -> None:
        """Nothing: a rank's ledger already holds its records in one file."""

    # Cleaning

    def clear(self, names: Mapping[str, int], *, progress: bool = False) -> None:
        with self._errors("prepare the feature store"):
            top = sorted(name for name in names if "/" not in name)  # commits/: its own turn
            points = [n for n in top if n == STORE_FILE or ledger_rank(n) is not None]
            for name in sorted(points, key=lambda n: n != STORE_FILE):
                self._delete_own(name)  # store.json, then the ledgers: no shard counts now
            delete_commit_files(self.root)  # the commit records of a downloaded store
            for name in top:
                if name not in points:
                    self._delete_own(name)
            if names:
                fsync_dir(self.root)

    def _delete_own(self, name: str) -> None:
        """Delete ``name`` if it is one of the store's own files (or safetensors' temporary
        file of one); a symbolic link there is refused, never followed."""
        if not os.path.lexists(self.root / name):
            return
        if is_store_file(name):
            check_own_path(self.root, name, for_writing=True)
            (self.root / name).unlink()
        elif self._is_our_serializer_temp(name):
            (self.root / name).unlink()

    def clean_for_resume(self, store_format: str, *, progress: bool = False) -> Committed:
        with self._errors("prepare the feature store"):
            names = _list_dir(self.root)
            for name in names:
                if ledger_rank(name) is not None:
                    check_own_path(self.root, name, for_writing=True)  # refuses a link
                    drop_torn_tail(self.root / name)
            committed = self.committed(store_format)
            kept = {entry.record.file for entry in committed.entries}
            for name in names:
                unfinished = is_store_file(name) and name.endswith(".tmp")
                uncommitted = shard_rank_and_seq(name) is not None and name not in kept
                if unfinished or uncommitted or self._is_our_serializer_temp(name):
                    self._delete_own(name)
            fsync_dir(self.root)
        return committed

    def _is_our_serializer_temp(self, name: str) -> bool:
        """A temporary file safetensors' ``save_file`` left while writing one of our shards.

        Only a regular file whose header carries this store format's mark counts: a user's
        file that merely has such a name is kept.
        """
        if not is_serializer_temp(name):
            return False
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # a symbolic link, or gone
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return False
            head = handle.read(4096)
        return head[8:9] == b"{" and _SERIALIZER_MARK in head

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Any:
        """An ``OSError`` in the block as a :class:`StoreError` naming the directory."""
        try:
            yield
        except OSError as error:
            raise StoreError(f"cannot {doing} {self.root}: {error}") from error


def _list_dir(path: Path) -> list[str]:
    """The names in the store's directory (one place, so that a test can vary it by rank)."""
    return sorted(os.listdir(path))
