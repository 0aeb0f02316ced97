"""ShardWriter: write batches of captured tensors into a feature store, each sample once.

The Trainer-free core of :class:`~lightning_iocatch.FeatureWriter`; nothing here imports
Lightning. The caller passes its rank. The one decision that every process must share,
:func:`prepare_store` (check the directory against the mode, clean it, write
``store.json``, read what is committed), runs on one process and returns a plain
:class:`StorePlan` for the caller to broadcast. The format is :mod:`lightning_iocatch.ledger`'s.

The writer's rules:

- **Each dataset index once.** A row whose dataset index is already committed (an earlier,
  interrupted run) or already written in this run, or that a sampler marks as padding, is
  dropped; the rest of its batch is written. The decision is per row, per dataloader.
- **Rows and batches.** A tensor whose first dimension is the batch's number of samples
  is stored row by row. Any other tensor (no dimension, or a first dimension of another
  size, such as rotary position embeddings with batch dimension 1) is stored once per
  batch and listed in the ledger record's ``per_batch``. A key keeps the kind it got when
  first stored (also across a resume): a key stored row by row that later arrives without
  a row per sample is not stored for that batch and is named, with the reason, in the
  record's ``skipped``. A key in ``required`` that lacks a row per sample is refused.
- **Refused on the calling thread.** A tensor safetensors cannot store (sparse, nested,
  meta, or a dtype outside :data:`STORABLE_DTYPES`) raises
  :class:`~lightning_iocatch.StoreError` naming its key, before anything is queued.
- **Memory.** The writer holds at most one shard (``max_shard_bytes`` plus the batch that
  fills it) and ``queue_size + 1`` more batches (those queued and the one being handed
  over). A shard is written straight from the tensors, with no serialized copy.
- **Failures.** The writer thread catches every exception and hands it to the calling
  thread, which raises it as a :class:`~lightning_iocatch.StoreError` at its next call;
  :meth:`ShardWriter.abort` drops what is not committed and stops within one chunk write.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import queue
import stat
import struct
import sys
import threading
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import IO, Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from lightning_iocatch.errors import StoreError
from lightning_iocatch.ledger import (
    FORMAT,
    INDEX_KEY,
    STORE_FILE,
    BatchRecord,
    ShardRecord,
    append_ledger,
    check_own_path,
    drop_torn_tail,
    fsync_dir,
    is_serializer_temp,
    is_store_file,
    ledger_name,
    ledger_rank,
    open_own_file,
    read_ledger_entries,
    read_store_json,
    shard_name,
    shard_rank_and_seq,
    write_json_atomic,
)

__all__ = [
    "MODES",
    "STORABLE_DTYPES",
    "Mode",
    "ShardWriter",
    "StorePlan",
    "prepare_store",
]

Mode = Literal["create", "resume", "overwrite"]
MODES: tuple[Mode, ...] = ("create", "resume", "overwrite")

STORABLE_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
"""The dtypes a store holds, with their safetensors names (safetensors has no complex128)."""

_CHUNK = 16 << 20  # bytes written (and checksummed) between two looks at a cancellation
_SERIALIZER_MARK = b'"format":"lightning-iocatch-store/'
_STOP = object()
_ROWS, _BATCH = "rows", "batch"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _IndexSet:
    """Non-negative integers as a bit array: one bit per index up to the largest one."""

    def __init__(self, bits: bytes = b"") -> None:
        self.bits = bytearray(bits)

    def __contains__(self, index: int) -> bool:
        byte = index >> 3
        return byte < len(self.bits) and bool(self.bits[byte] >> (index & 7) & 1)

    def add(self, index: int) -> None:
        byte = index >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits))))
        self.bits[byte] |= 1 << (index & 7)


@dataclass(frozen=True)
class StorePlan:
    """What :func:`prepare_store` found and decided, for every process to share (it pickles).

    Attributes:
        store_json: the store's metadata as prepared; every process checks that it reads the same.
        committed: per dataloader, the dataset indices already committed, as a bit array.
        next_seq: per rank, the sequence number of its next shard.
        row_keys: keys the store already holds row by row.
        batch_keys: keys the store already holds once per batch.
    """

    store_json: dict[str, Any]
    committed: dict[int, bytes] = field(default_factory=dict)
    next_seq: dict[int, int] = field(default_factory=dict)
    row_keys: frozenset[str] = frozenset()
    batch_keys: frozenset[str] = frozenset()


# Preparing the directory: on one process only


def _list_dir(path: Path) -> list[str]:
    """The names in the store's directory (one place, so that a test can vary it by rank)."""
    return sorted(os.listdir(path))


def _versions() -> dict[str, str]:
    versions = {"torch": str(torch.__version__)}
    for package in ("lightning", "safetensors", "lightning-iocatch"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def prepare_store(path: Path, mode: Mode, settings: Mapping[str, Any]) -> StorePlan:
    """Make ``path`` ready for writing in ``mode``; call it on one process, before any writes.

    ``"create"`` needs an empty or missing directory; ``"overwrite"`` deletes the store's
    own files there (nothing else); ``"resume"`` needs a store written with the same
    ``settings`` (``spec``, ``stage``, ``dtype``; ``world_size`` may differ), completes or
    cuts the ledgers' last lines, deletes the debris of the interrupted run, and reads
    which dataset indices are committed. ``settings`` go into a new ``store.json``.

    Raises:
        StoreError: naming the path, what is wrong and the fix.
    """
    try:
        if mode == "resume":
            return _resume(path, settings)
        path.mkdir(parents=True, exist_ok=True)
        names = _list_dir(path)
        if mode == "create" and names:
            shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if names[3:] else "")
            raise StoreError(
                f"{path} is not empty; use FeatureWriter(..., mode='resume') to continue an "
                f"interrupted dump there, mode='overwrite' to replace it, or another path "
                f"(it holds {shown})"
            )
        if mode == "overwrite":
            for name in names:
                if is_store_file(name):
                    check_own_path(path, name, for_writing=True)  # refuses a symbolic link
                    (path / name).unlink()
                elif _is_our_serializer_temp(path, name):
                    (path / name).unlink()
            fsync_dir(path)
        info = {
            "format": FORMAT,
            **settings,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "libraries": _versions(),
        }
        write_json_atomic(path / STORE_FILE, info)
        return StorePlan(read_store_json(path))
    except OSError as error:
        raise StoreError(f"cannot prepare the feature store {path}: {error}") from error


def _resume(path: Path, settings: Mapping[str, Any]) -> StorePlan:
    if not os.path.lexists(path / STORE_FILE):
        raise StoreError(
            f"nothing to resume in {path}: it holds no {STORE_FILE}; use mode='create'"
        )
    info = read_store_json(path)
    for name in ("spec", "stage", "dtype"):
        had, now = info.get(name), settings.get(name)
        if name == "spec" and (had is None or now is None):
            continue  # a writer used without IOCaptureCallback knows no spec
        if had != now:
            raise StoreError(
                f"{path} holds captures with {name} {had!r}, but this writer's {name} is "
                f"{now!r}; resume with the same {name}, or write to another path"
            )
    names = _list_dir(path)
    for name in names:
        if ledger_rank(name) is not None:
            check_own_path(path, name, for_writing=True)  # refuses a symbolic link
            drop_torn_tail(path / name)
    entries = read_ledger_entries(path)
    committed_files = {entry.record.file for entry in entries}
    for name in names:
        unfinished = is_store_file(name) and name.endswith(".tmp")
        uncommitted = shard_rank_and_seq(name) is not None and name not in committed_files
        if unfinished or uncommitted:
            check_own_path(path, name, for_writing=True)
            (path / name).unlink()
        elif _is_our_serializer_temp(path, name):
            (path / name).unlink()
    fsync_dir(path)
    committed: dict[int, _IndexSet] = {}
    next_seq: dict[int, int] = {}
    row_keys: set[str] = set()
    batch_keys: set[str] = set()
    for entry in entries:
        record = entry.record
        rank_seq = shard_rank_and_seq(record.file)
        if rank_seq is not None:
            next_seq[rank_seq[0]] = max(next_seq.get(rank_seq[0], 0), rank_seq[1] + 1)
        shard = check_own_path(path, record.file)
        try:
            with safe_open(shard, framework="pt") as handle:
                for position, batch in enumerate(record.batches):
                    indices = handle.get_tensor(f"b{position}/{INDEX_KEY}")
                    if tuple(indices.shape) != (batch.rows,):
                        raise StoreError(
                            f"shard {shard} holds {tuple(indices.shape)} indices in batch "
                            f"{position}, but {entry.where} says {batch.rows} rows: it is damaged"
                        )
                    seen = committed.setdefault(batch.dataloader_idx, _IndexSet())
                    for index in indices.tolist():
                        seen.add(index)
        except (SafetensorError, OSError) as error:
            raise StoreError(
                f"shard {shard}, committed by {entry.where}, cannot be read: {error}"
            ) from error
        batch_keys.update(record.per_batch)
        row_keys.update(key for key in record.keys if key not in record.per_batch)
    return StorePlan(
        store_json=info,
        committed={dataloader: bytes(seen.bits) for dataloader, seen in committed.items()},
        next_seq=next_seq,
        row_keys=frozenset(row_keys - batch_keys),
        batch_keys=frozenset(batch_keys),
    )


def _is_our_serializer_temp(path: Path, name: str) -> bool:
    """A temporary file safetensors' ``save_file`` left while writing one of our shards.

    Only a regular file whose header carries this store format's mark counts: a user's
    file that merely has such a name is kept.
    """
    if not is_serializer_temp(name):
        return False
    try:
        fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # a symbolic link, or gone
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return False
        head = handle.read(4096)
    return head[8:9] == b"{" and _SERIALIZER_MARK in head


# Writing


@dataclass
class _Batch:
    record: BatchRecord
    tensors: dict[str, torch.Tensor]  # includes INDEX_KEY
    per_batch: frozenset[str]
    skipped: dict[str, str]
    nbytes: int


class _Cancelled(Exception):
    """The writer was aborted while a shard was being written (caught by the writer thread)."""


def _write_all(handle: IO[bytes], data: memoryview) -> None:
    while data:
        written = handle.write(data)
        data = data[written or 0 :]


def _serialize(
    handle: IO[bytes],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    cancelled: threading.Event,
) -> tuple[int, int]:
    """Write ``tensors`` as a safetensors file to ``handle``; return its CRC-32 and size.

    The data is written straight from the tensors' memory (no serialized copy), largest
    element size first so that every tensor is aligned; the CRC-32 is that of the file's
    bytes, computed on the way.
    """
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": STORABLE_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    crc = zlib.crc32(head)
    _write_all(handle, memoryview(head))
    for name in order:
        data = tensors[name].reshape(-1).view(torch.uint8).numpy().data
        for start in range(0, len(data), _CHUNK):
            if cancelled.is_set():
                raise _Cancelled
            chunk = data[start : start + _CHUNK]
            crc = zlib.crc32(chunk, crc)
            _write_all(handle, chunk)
    return crc, len(head) + offset


def _unpin(batch: _Batch) -> None:
    """Move pinned captures to ordinary memory, so the capture's pinned budget is freed now
    rather than when the shard is written (the copy runs on the writer thread)."""
    for key, tensor in batch.tensors.items():
        if tensor.is_pinned():
            batch.tensors[key] = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _shapes(batches: list[_Batch]) -> dict[str, list[int] | None]:
    """Per key: the shape of a row (of the whole tensor for per-batch keys); ``None`` where
    batches differ."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for batch in batches:
        for key, tensor in batch.tensors.items():
            if key != INDEX_KEY:
                shape = tensor.shape if key in batch.per_batch else tensor.shape[1:]
                shapes.setdefault(key, set()).add(tuple(shape))
    return {key: list(next(iter(seen))) if len(seen) == 1 else None for key, seen in shapes.items()}


class ShardWriter:
    """Writes one process's batches into a store's shards and ledger, on a writer thread.

    Args:
        path: the store directory, prepared by :func:`prepare_store`.
        rank: this process's rank (names its shards and ledger).
        plan: what :func:`prepare_store` returned (on any process).
        max_shard_bytes: a shard is written once its batches hold this many bytes.
        queue_size: batches waiting for the writer thread before :meth:`write` blocks.
        durable: fsync each shard and the directory before its ledger line is written.
        dtype: cast floating tensors to this dtype for storage.

    The thread starts with the first batch. Call :meth:`close` at the end (it writes what
    is queued and raises the thread's error, if any) or :meth:`abort` to stop at once.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "store"
        >>> plan = prepare_store(path, "create", {"spec": None, "stage": "predict", "dtype": None})
        >>> writer = ShardWriter(path, rank=0, plan=plan)
        >>> writer.write({"x": torch.ones(3, 2)}, indices=[0, 1, 2])
        3
        >>> writer.write({"x": torch.ones(2, 2)}, indices=[2, 3])  # index 2 is already written
        1
        >>> writer.close()
        >>> writer.rows_written
        4
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int,
        plan: StorePlan,
        max_shard_bytes: int = 256 << 20,
        queue_size: int = 4,
        durable: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise StoreError("the feature store format is little-endian; this machine is not")
        self.path = Path(path)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.durable = durable
        self.dtype = dtype
        self._seen = {dataloader: _IndexSet(bits) for dataloader, bits in plan.committed.items()}
        self._kinds = {key: _ROWS for key in plan.row_keys} | {k: _BATCH for k in plan.batch_keys}
        self._next_seq = plan.next_seq.get(rank, 0)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._cancel = threading.Event()
        self._done = threading.Event()  # set by the writer thread as its last act
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.rows_written = 0
        self.bytes_written = 0

    # The calling thread

    def has(self, dataloader_idx: int, indices: Sequence[int]) -> bool:
        """True when every one of ``indices`` is committed or already written in this run."""
        seen = self._seen.get(dataloader_idx)
        return seen is not None and all(index in seen for index in indices)

    def write(
        self,
        tensors: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        dataloader_idx: int = 0,
        batch_idx: int = 0,
        repeated: Sequence[bool] | None = None,
        required: Collection[str] = (),
    ) -> int:
        """Queue one batch: ``tensors`` by key, ``indices`` the dataset index of each sample.

        ``repeated`` marks samples that are padding (not written); ``required`` names keys
        that must have a row per sample. Returns the number of rows that will be written
        (rows already committed or written are dropped). Blocks while the queue is full.

        Raises:
            StoreError: a tensor that cannot be stored (naming its key), an index that is
                not a non-negative integer, or an earlier failure of the writer thread.
        """
        self._raise_error()
        if self._closed:
            raise StoreError(f"the writer of {self.path} is closed")
        if INDEX_KEY in tensors:
            raise StoreError(f"{INDEX_KEY!r} is the store's own key for dataset indices; rename it")
        rows = len(indices)
        stored = {key: self._storable(key, tensor) for key, tensor in tensors.items()}
        for key in required:
            tensor = stored.get(key)
            if tensor is not None and not (tensor.dim() and tensor.shape[0] == rows):
                raise StoreError(
                    f"FeatureWriter stores one row per sample, but {key!r} has shape "
                    f"{tuple(tensor.shape)} for a batch of {rows} samples; capture a module "
                    "whose output has the batch dimension first"
                )
        keep = self._new_rows(dataloader_idx, batch_idx, indices, repeated)
        if not keep:
            return 0
        positions = list(keep)
        select = torch.tensor(positions) if len(positions) < rows else None
        batch = {INDEX_KEY: torch.tensor(list(keep.values()), dtype=torch.int64)}
        per_batch: set[str] = set()
        skipped: dict[str, str] = {}
        for key, tensor in stored.items():
            has_rows = bool(tensor.dim()) and tensor.shape[0] == rows
            kind = self._kinds.setdefault(key, _ROWS if has_rows else _BATCH)
            if kind == _BATCH:
                batch[key] = tensor.contiguous()
                per_batch.add(key)
            elif has_rows:
                batch[key] = tensor.index_select(0, select) if select is not None else tensor
                batch[key] = batch[key].contiguous()
            else:
                skipped[key] = (
                    f"shape {tuple(tensor.shape)} has no row per sample in a batch of {rows} "
                    "samples, though earlier batches stored this key row by row"
                )
        seen = self._seen.setdefault(dataloader_idx, _IndexSet())
        for index in keep.values():
            seen.add(index)
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in batch.values())
        record = BatchRecord(dataloader_idx, batch_idx, len(keep))
        self._put(_Batch(record, batch, frozenset(per_batch), skipped, nbytes))
        return len(keep)

    def close(self) -> None:
        """Write what is queued, wait for the writer thread, and raise its error if it failed.

        Interrupted while waiting (Ctrl-C), it aborts instead.
        """
        try:
            self._stop()
        except BaseException:
            self.abort()
            raise
        self._raise_error()

    def abort(self) -> None:
        """Stop now: queued batches are dropped and a shard being written is abandoned.

        What is committed stays committed. Returns once the writer thread has ended (within
        one chunk write or fsync); a failure of the thread is not raised.
        """
        self._cancel.set()
        self._stop()

    def _storable(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        problem = None
        if tensor.is_nested:
            problem = "a nested tensor; store its components as separate outputs"
        elif tensor.layout != torch.strided:
            problem = f"a {tensor.layout} tensor; make it dense (`.to_dense()`) in the model"
        elif tensor.is_meta:
            problem = "a meta tensor, which holds no data"
        else:
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            if tensor.dtype not in STORABLE_DTYPES:
                names = ", ".join(_dtype_name(dtype) for dtype in STORABLE_DTYPES)
                problem = (
                    f"of dtype {_dtype_name(tensor.dtype)}, which safetensors cannot store "
                    f"(it stores {names}); convert it in the model"
                )
        if problem is not None:
            raise StoreError(f"FeatureWriter cannot store {key!r}: it is {problem}")
        return tensor.detach().to("cpu").resolve_conj().resolve_neg()

    def _new_rows(
        self,
        dataloader_idx: int,
        batch_idx: int,
        indices: Sequence[int],
        repeated: Sequence[bool] | None,
    ) -> dict[int, int]:
        """The rows to write (new indices, first occurrence, not padding): position -> index."""
        seen = self._seen.get(dataloader_idx, _IndexSet())
        keep: dict[int, int] = {}
        fresh: set[int] = set()
        for position, value in enumerate(indices):
            try:
                index = operator.index(value)
            except TypeError:
                index = -1
            if index < 0 or isinstance(value, bool):
                raise StoreError(
                    f"FeatureWriter needs a non-negative integer dataset index for every "
                    f"sample, but batch {batch_idx} of dataloader {dataloader_idx} has "
                    f"{value!r}; use a sampler that yields dataset positions"
                )
            padding = repeated is not None and position < len(repeated) and repeated[position]
            if index in seen or index in fresh or padding:
                continue
            keep[position] = index
            fresh.add(index)
        return keep

    def _put(self, item: _Batch) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"iocatch-writer-r{self.rank}", daemon=True
            )
            self._thread.start()
        while True:  # wait for room, but notice when the writer thread failed meanwhile
            self._raise_error()
            if self._done.is_set():
                raise StoreError(f"the writer thread of {self.path} has ended")
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _stop(self) -> None:
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        while not self._done.is_set():
            try:
                self._queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                continue
        # An Event, not Thread.join: a join interrupted by Ctrl-C can leave a live thread
        # marked as stopped (CPython 3.11, bpo-45274), and the abort must still wait for it.
        self._done.wait()
        thread.join()
        self._thread = None

    def _raise_error(self) -> None:
        error = self._error
        if error is None:
            return
        if isinstance(error, StoreError):
            raise error
        raise StoreError(
            f"the writer thread of {self.path} (rank {self.rank}) failed: "
            f"{type(error).__name__}: {error}"
        ) from error

    # The writer thread

    def _run(self) -> None:
        pending: list[_Batch] = []
        try:
            size = 0
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if self._cancel.is_set() or not isinstance(item, _Batch):
                    continue
                _unpin(item)
                if pending and self._dtype_changes(pending, item):
                    self._write_shard(pending)
                    pending, size = [], 0
                pending.append(item)
                size += item.nbytes
                del item  # only ``pending`` holds the batch from here
                if size >= self.max_shard_bytes:
                    self._write_shard(pending)
                    pending, size = [], 0
            if pending and not self._cancel.is_set():
                self._write_shard(pending)
        except _Cancelled:
            pass
        except BaseException as error:  # handed to the calling thread by _raise_error
            self._error = error
        finally:
            pending.clear()
            with contextlib.suppress(queue.Empty):  # free what waits, release a blocked put
                while True:
                    self._queue.get_nowait()
            self._done.set()

    @staticmethod
    def _dtype_changes(pending: list[_Batch], item: _Batch) -> bool:
        """A key whose dtype differs from the pending batches': its shard must close first."""
        dtypes = {key: tensor.dtype for batch in pending for key, tensor in batch.tensors.items()}
        return any(dtypes.get(key, t.dtype) != t.dtype for key, t in item.tensors.items())

    def _write_shard(self, batches: list[_Batch]) -> None:
        name = shard_name(self.rank, self._next_seq)
        tmp, final = self.path / (name + ".tmp"), self.path / name
        tensors = {
            f"b{position}/{key}": tensor
            for position, batch in enumerate(batches)
            for key, tensor in batch.tensors.items()
        }
        metadata = {"format": FORMAT, "rank": str(self.rank)}
        created = False
        try:
            with open_own_file(self.path, tmp.name, "xb") as handle:
                created = True
                crc, size = _serialize(handle, tensors, metadata, self._cancel)
                if self.durable:
                    os.fsync(handle.fileno())
            os.replace(tmp, final)
            created = False
            if self.durable:
                fsync_dir(self.path)
        except BaseException as error:
            if created:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            if isinstance(error, OSError):
                raise StoreError(f"could not write shard {final}: {error}") from error
            raise
        skipped: dict[str, str] = {}
        for batch in batches:
            for key, reason in batch.skipped.items():
                skipped.setdefault(key, reason)
        record = ShardRecord(
            file=name,
            rank=self.rank,
            bytes=size,
            crc32=crc,
            batches=tuple(batch.record for batch in batches),
            keys={
                key: _dtype_name(tensor.dtype)
                for batch in batches
                for key, tensor in batch.tensors.items()
                if key != INDEX_KEY
            },
            shapes=_shapes(batches),
            per_batch=tuple(sorted(set().union(*(batch.per_batch for batch in batches)))),
            skipped=skipped,
        )
        try:
            append_ledger(self.path / ledger_name(self.rank), record)
        except OSError as error:
            raise StoreError(
                f"shard {final} was written but its ledger line could not be: {error}"
            ) from error
        self._next_seq += 1
        self.rows_written += sum(batch.record.rows for batch in batches)
        self.bytes_written += size
