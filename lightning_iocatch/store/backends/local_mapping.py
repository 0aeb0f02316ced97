"""Rows of local shards gathered from memory maps kept between reads, within a budget of
resident bytes.

A read of rows at random places of a file maps it, copies the rows and unmaps it; each
page it touches is a page fault, and a fault costs more than copying a row (about 2.5 µs
a 512-byte row from the page cache, measured on this project's CI machine, against 0.2
µs from a mapping kept). :class:`KeptMappings` keeps a store's shards mapped between
reads, the least recently used unmapped once the pages they may hold resident exceed
``limit`` bytes (a reader's shuffle window: :class:`~lightning_iocatch.store.training.
StoreRows` sets it), so the memory of a read stays bounded by the window, not the store.
With ``limit`` 0 (the default) nothing is kept: each read maps the file for itself alone.

Resident pages are counted in the kernel's fault-around granules (64 KiB: a fault maps
the cached pages around it too); a shard whose granules alone pass the limit is unmapped
after each read. A file replaced or resized since it was mapped (another inode, size or
modification time) is mapped again; rows past its end are refused.

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
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.safetensors_layout import byte_rows

__all__ = ["GRANULE", "KeptMappings"]

GRANULE = 64 << 10
"""Bytes a page fault may make resident (Linux' default ``fault_around_bytes``)."""


@dataclass
class _Mapping:
    identity: tuple[int, int, int, int]  # device, inode, size, modification time
    mapped: mmap.mmap | None
    data: np.ndarray
    touched: np.ndarray = field(init=False)  # per granule: whether a read touched it

    def __post_init__(self) -> None:
        self.touched = np.zeros(-(-len(self.data) // GRANULE), dtype=bool)

    @property
    def resident(self) -> int:
        """Bytes of the granules touched (an upper bound of the pages it holds)."""
        return int(self.touched.sum()) * GRANULE


class KeptMappings:
    """Files mapped for reading, kept between reads within ``limit`` resident bytes (see
    the module docstring); safe across threads. Pickled empty (each process maps its
    own)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._files: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit"])  # type: ignore[misc]

    @property
    def mapped(self) -> int:
        """The files mapped now."""
        return len(self._files)

    def resize(self, limit: int) -> None:
        """Keep at most ``limit`` resident bytes mapped from now on."""
        with self._lock:
            self.limit = limit
            self._drop()

    def gather(self, path: str, asked: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
        """For each ``(offsets, width)``: the ``width`` bytes at each offset of the file
        ``path``, as ``(len(offsets), width)`` uint8 rows in the order asked."""
        out = [np.empty((len(offsets), width), dtype=np.uint8) for offsets, width in asked]
        todo = [n for n, (offsets, width) in enumerate(asked) if width and len(offsets)]
        if not todo:
            return out
        mapping = self._mapping(path)
        size = mapping.identity[2]
        for n in todo:
            offsets, width = asked[n]
            if offsets.min() < 0 or size < int(offsets.max()) + width:
                raise StoreError(f"shard {path} changed while it was read")
        for n in todo:
            offsets, width = asked[n]
            # in file order: a fault maps the pages around it, which the next rows use
            order = np.argsort(offsets, kind="stable")
            out[n][order] = byte_rows(mapping.data, width)[offsets[order]]
        with self._lock:
            for n in todo:
                offsets, width = asked[n]
                first, last = offsets // GRANULE, (offsets + width - 1) // GRANULE
                mapping.touched[first] = True
                mapping.touched[last] = True  # a row spans at most two granules ...
                for between in np.flatnonzero(last - first > 1).tolist():  # ... or more
                    mapping.touched[first[between] : last[between] + 1] = True
            if self._files.get(path) is mapping:
                self._drop()
        return out

    def _mapping(self, path: str) -> _Mapping:
        """``path`` mapped: the mapping kept if the file is the one mapped, else anew."""
        try:
            stat = os.stat(path)
        except OSError as error:
            raise StoreError(f"cannot read shard {path}: {error}") from error
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            kept = self._files.get(path)
            if kept is not None and kept.identity == identity:
                self._files.move_to_end(path)
                return kept
        mapping = _map(path, identity)
        with self._lock:
            self._files[path] = mapping
            self._files.move_to_end(path)
        return mapping

    def _drop(self) -> None:
        """Unmap the least recently used files while those kept hold more than ``limit``
        resident bytes (the last used too, if it alone does: mapped anew on its next read)."""
        total = sum(mapping.resident for mapping in self._files.values())
        while self._files and total > self.limit:
            _, mapping = self._files.popitem(last=False)
            total -= mapping.resident  # unmapped once the reads holding it are done


def _map(path: str, identity: tuple[int, int, int, int]) -> _Mapping:
    """The file ``path`` mapped read-only (its size as ``identity`` says, checked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise StoreError(f"cannot read shard {path}: {error}") from error
    try:
        if os.fstat(fd).st_size != identity[2]:
            raise StoreError(f"shard {path} changed while it was read")
        if not identity[2]:
            return _Mapping(identity, None, np.empty(0, dtype=np.uint8))
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return _Mapping(identity, mapped, np.frombuffer(mapped, dtype=np.uint8))
