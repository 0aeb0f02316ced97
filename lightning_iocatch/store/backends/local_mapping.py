"""Rows of local shards gathered from memory maps kept between reads, within a budget of
the files' bytes.

A read of rows at random places of a file maps it, copies the rows and unmaps it; each
page it touches is a page fault, and a fault costs more than copying a row (about 2.5 µs
a 512-byte row from the page cache, measured on this project's CI machine, against 0.2
to 0.7 µs from a mapping kept). :class:`KeptMappings` keeps a reader's shards mapped
between reads while their files' sizes add up to at most ``limit`` bytes (all the pages
a mapping can hold resident), the least recently read unmapped first, and at most
``most`` files (each mapping holds a file descriptor); a file larger than ``limit`` alone
is mapped for each read. :class:`~lightning_iocatch.store.training.StoreRows` sets the
limit to twice its shuffle window's bytes and lets go of every mapping when an epoch's
iterator ends or is closed. With ``limit`` 0 (the default) nothing is kept: each read
maps the file for itself alone.

A file replaced or changed since it was mapped (another device, inode, size or
modification time, as ``os.stat`` of its path says before each read) is mapped anew;
rows past its end are refused.

Examples:
    >>> import os, tempfile
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.bin")
    >>> with open(path, "wb") as file:
    ...     _ = file.write(bytes(range(16)))
    >>> kept = KeptMappings(limit=1 << 20)
    >>> kept.gather(path, [(np.array([8, 0]), 4)])[0].tolist()
    [[8, 9, 10, 11], [0, 1, 2, 3]]
    >>> kept.mapped
    1
    >>> kept.release()
    >>> kept.mapped
    0
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.safetensors_layout import byte_rows

__all__ = ["KeptMappings", "opened_shard"]

_MOST = 64
"""Files kept mapped at most (each holds a file descriptor)."""

Identity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)


@dataclass(frozen=True)
class _Mapping:
    identity: Identity
    data: np.ndarray  # the file's bytes, a view of its mapping (which it keeps alive)


class KeptMappings:
    """Files mapped for reading, kept between reads within ``limit`` bytes of files and
    ``most`` files (see the module docstring); safe across threads. Pickled empty (each
    process maps its own)."""

    def __init__(self, limit: int = 0, most: int = _MOST) -> None:
        self.limit, self.most = limit, most
        self._files: OrderedDict[str, _Mapping] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"limit": self.limit, "most": self.most}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit"], state["most"])  # type: ignore[misc]

    @property
    def mapped(self) -> int:
        """The files mapped now."""
        return len(self._files)

    def resize(self, limit: int) -> None:
        """Keep at most ``limit`` bytes of files mapped from now on."""
        with self._lock:
            self.limit = limit
            self._drop()

    def release(self) -> None:
        """Unmap every file kept (each once the reads holding it are done)."""
        with self._lock:
            self._files.clear()
            self._bytes = 0

    def gather(self, path: str, asked: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        """For each ``(offsets, width)``: the ``width`` bytes at each offset of the file
        ``path``, as ``(len(offsets), width)`` uint8 rows in the order asked."""
        if not any(width and len(offsets) for offsets, width in asked):
            return [np.empty((len(offsets), width), dtype=np.uint8) for offsets, width in asked]
        if self.limit <= 0:  # nothing kept: mapped for this call only
            with opened_shard(path) as fd:
                return _rows(path, _mapped(path, fd), asked)
        return _rows(path, self._mapping(path).data, asked)

    def _mapping(self, path: str) -> _Mapping:
        """``path`` mapped: the mapping kept if the file is the one mapped, else anew (kept
        if it fits)."""
        try:
            now = _identity(os.stat(path))
        except OSError as error:
            raise StoreError(f"cannot read shard {path}: {error}") from error
        with self._lock:
            kept = self._files.get(path)
            if kept is not None and kept.identity == now:
                self._files.move_to_end(path)
                return kept
        with opened_shard(path) as fd:
            mapping = _Mapping(_identity(os.fstat(fd)), _mapped(path, fd))
        with self._lock:
            held = self._files.pop(path, None)
            if held is not None:
                self._bytes -= len(held.data)
            if len(mapping.data) <= self.limit:
                self._files[path] = mapping
                self._bytes += len(mapping.data)
                self._drop()
        return mapping

    def _drop(self) -> None:
        """Unmap the least recently read files while more than ``limit`` bytes or ``most``
        files are kept (each unmapped once the reads holding it are done)."""
        while self._files and (self._bytes > self.limit or len(self._files) > self.most):
            _, mapping = self._files.popitem(last=False)
            self._bytes -= len(mapping.data)


def _identity(stat: os.stat_result) -> Identity:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@contextlib.contextmanager
def opened_shard(path: str | os.PathLike[str]) -> Iterator[int]:
    """The shard file ``path`` opened for reading, as a descriptor closed after (a
    :class:`StoreError` where it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise StoreError(f"cannot read shard {path}: {error}") from error
    try:
        yield fd
    finally:
        os.close(fd)


def _mapped(path: str, fd: int) -> np.ndarray:
    """The bytes of the open file ``fd``, mapped read-only (empty: nothing to map)."""
    if not os.fstat(fd).st_size:
        return np.empty(0, dtype=np.uint8)
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:  # ValueError: cut to nothing since the fstat
        raise StoreError(f"cannot map shard {path}: {error}") from error
    return np.frombuffer(mapped, dtype=np.uint8)  # holds the mapping while it lives


def _rows(path: str, data: np.ndarray, asked: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
    """The rows ``asked`` of the file's bytes ``data`` (copies)."""
    for offsets, width in asked:
        if width and len(offsets) and (offsets.min() < 0 or len(data) < int(offsets.max()) + width):
            raise StoreError(f"shard {path} changed while it was read")
    return [
        byte_rows(data, width)[offsets]
        if width and len(offsets)
        else np.empty((len(offsets), width), dtype=np.uint8)
        for offsets, width in asked
    ]
