"""ShardWriter: write batches of captured tensors into a feature store, each sample once.

The Trainer-free core of :class:`~lightning_iocatch.FeatureWriter`; nothing here imports
Lightning. The caller passes its rank and the :class:`~lightning_iocatch.store.plan.StorePlan`
that one process made with :func:`~lightning_iocatch.store.plan.prepare_store`. Which rows
and keys are written is :mod:`lightning_iocatch.store.exactly_once`'s decision; what a shard
holds and what its record says, :mod:`lightning_iocatch.store.shard_contents`'; the files are
:mod:`lightning_iocatch.store.names`' and :mod:`lightning_iocatch.store.commits`'s format.

The writer's own rules:

- **Memory.** The writer holds at most ``shards_in_flight`` shards being written, and one
  being filled (each ``max_shard_bytes`` plus the batch that fills it), and
  ``queue_size + 1`` more batches (those queued and the one being handed over). A shard
  is written straight from the tensors, with no serialized copy (an upload holds one
  block of its filesystem's buffer besides: s3fs's ``default_block_size``). With a codec,
  each batch is coded on the writer thread as it arrives, beside the model's next
  forwards rather than all after the last one, and only its coded bytes are kept.
- **Shards in flight.** On object storage, where a request waits on the network,
  ``shards_in_flight`` shards (default 4) are uploaded at once, each committed by its own
  record once its upload completes: a shard committed before an earlier one of its rank
  is fine, since each counts alone, and a resume redoes the rows of those not committed.
  On disk, one at a time (default 1). A writer that closes having committed every shard
  gathers their records into one manifest (see :mod:`~.backends.manifests`).
- **Failures.** The writer thread catches every exception and hands it to the calling
  thread, which raises it as a :class:`~lightning_iocatch.StoreError` at its next call;
  :meth:`ShardWriter.abort` drops what is not committed and stops within one chunk write.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import IO, Any

import torch

from lightning_iocatch.checks import check_int, parse_dtype
from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.exactly_once import RowSelector, SelectedBatch
from lightning_iocatch.store.in_flight import ShardsInFlight
from lightning_iocatch.store.names import shard_name
from lightning_iocatch.store.plan import StorePlan
from lightning_iocatch.store.records import ShardRecord
from lightning_iocatch.store.shard_codec import ShardEncoder, check_codec
from lightning_iocatch.store.shard_contents import (
    batch_tensors,
    shapes_only,
    shard_record,
    shard_tensors,
)
from lightning_iocatch.store.shard_file import STORABLE_DTYPES, write_safetensors
from lightning_iocatch.store.tokens import TokenSelection

__all__ = ["ShardWriter"]

_CHUNK = 16 << 20  # bytes written (and checksummed) between two looks at a cancellation
_STOP = object()


class _Cancelled(Exception):
    """The writer was aborted while a shard was being written (caught by the writer thread)."""


def _serialize(
    handle: IO[bytes],
    batches: list[SelectedBatch],
    rank: int,
    cancelled: threading.Event,
    coded: ShardEncoder | None = None,
) -> tuple[int, int]:
    """Write a shard of ``batches`` (tensors ``b{position}/{key}``), or of their tensors as
    ``coded`` already holds them; return its CRC-32 and size.

    Raises :class:`_Cancelled` between two chunks once ``cancelled`` is set.
    """

    def stop_if_cancelled() -> None:
        if cancelled.is_set():
            raise _Cancelled

    tensors, metadata = shard_tensors(batches, rank)
    if coded is not None:
        tensors = coded.tensors
        metadata.update(coded.metadata())
    return write_safetensors(
        handle, tensors, metadata, chunk_bytes=_CHUNK, before_chunk=stop_if_cancelled
    )


class ShardWriter:
    """Writes one process's batches into a store's shards and ledger, on a writer thread.

    Args:
        path: the store directory or fsspec URL (``s3://bucket/run``), prepared by
            :func:`~lightning_iocatch.store.plan.prepare_store`.
        rank: this process's rank (names its shards and ledger).
        plan: what ``prepare_store`` returned (on any process).
        max_shard_bytes: a shard is written once its batches hold this many bytes.
        queue_size: batches waiting for the writer thread before :meth:`write` blocks.
        durable: fsync each shard and the directory before its ledger line is written
            (local stores; on object storage a completed upload is durable).
        dtype: cast floating tensors to this dtype (or its name) for storage; an 8-bit
            float (``"float8_e4m3fn"``) stores them with a float32 scale per row (see
            :mod:`~lightning_iocatch.store.shard_file`), read back dequantized.
        shards_in_flight: shards written at once (default: 4 on object storage, 1 on disk);
            the memory bound grows with it (see the module docstring).
        storage_options: fsspec options for a URL ``path`` (credentials, endpoint).
        codec: ``"zstd"`` compresses each shard's tensors losslessly, in blocks of whole
            rows that a reader decodes only where it reads (see
            :mod:`~lightning_iocatch.store.shard_codec`); ``None`` (default) for none.
        writes: ``False`` for a process that sees the same batches as a writer of its
            ``rank`` (another process of its tensor-parallel group): each batch is checked
            and its rows marked as written, exactly as there (so both skip the same
            batches and refuse the same ones), and nothing is written.

    The thread starts with the first batch. Call :meth:`close` at the end (it writes what
    is queued and raises the thread's error, if any) or :meth:`abort` to stop at once.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lightning_iocatch.store.plan import prepare_store
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
        path: str | os.PathLike[str] | StoreBackend,
        *,
        rank: int,
        plan: StorePlan,
        max_shard_bytes: int = 256 << 20,
        queue_size: int = 4,
        durable: bool = True,
        dtype: torch.dtype | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shards_in_flight: int | None = None,
        codec: str | None = None,
        writes: bool = True,
    ) -> None:
        if sys.byteorder != "little":
            raise StoreError("the feature store format is little-endian; this machine is not")
        self.backend = open_backend(path, storage_options)
        in_flight = self.backend.shards_in_flight if shards_in_flight is None else shards_in_flight
        self.shards_in_flight = check_int("shards_in_flight", in_flight, minimum=1)
        self.path = self.backend.path  # a local directory, or an ObjectLocation
        self.rank = rank
        self.writes = writes
        self.max_shard_bytes = max_shard_bytes
        self.durable = durable
        self.dtype = parse_dtype("dtype", dtype)
        if self.dtype is not None and self.dtype not in STORABLE_DTYPES:
            raise ValueError(f"`dtype` {dtype!r} is a dtype safetensors cannot store")
        self._rows = RowSelector(plan, self.dtype)
        self.codec = check_codec(codec)
        self._next_seq = plan.next_seq.get(rank, 0)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._cancel = threading.Event()
        self._done = threading.Event()  # set by the writer thread as its last act
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._counts = threading.Lock()  # what several threads note of the shards they commit
        self._committed: list[ShardRecord] = []
        self.rows_written = 0
        self.bytes_written = 0

    # The calling thread

    def has(self, dataloader_idx: int, indices: Sequence[int]) -> bool:
        """True when every one of ``indices`` is committed or already written in this run."""
        return self._rows.has(dataloader_idx, indices)

    def write(
        self,
        tensors: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        dataloader_idx: int = 0,
        batch_idx: int = 0,
        repeated: Sequence[bool] | None = None,
        required: Collection[str] = (),
        tokens: TokenSelection | None = None,
        token_keys: Collection[str] | None = None,
    ) -> int:
        """Queue one batch: ``tensors`` by key, ``indices`` the dataset index of each sample.

        ``repeated`` marks samples that are padding (not written); ``required`` names keys
        that must have a row per sample. ``tokens``: the batch's token selection, when the
        tensors were captured with it as the session's transform
        (``catcher(..., transform=selection)``), and ``token_keys`` the keys it selected
        (``buffer.transformed_keys()``; required with ``tokens``, ``()`` where it selected
        none): those are stored one row per token, with their coordinates (``__position__``
        and ``__token_id__`` keys). Returns the number of rows that will be written (rows of
        samples already committed or written are dropped). Blocks while the queue is full.

        Raises:
            StoreError: a tensor that cannot be stored (naming its key), an index that is
                not a non-negative integer, ``tokens`` without ``token_keys`` or token keys
                naming no tensor, or an earlier failure of the writer thread.
        """
        self._raise_error()
        if self._closed:
            raise StoreError(f"the writer of {self.path} is closed")
        _check_token_keys(tensors, tokens, token_keys)
        batch = self._rows.select(
            tensors,
            indices,
            dataloader_idx=dataloader_idx,
            batch_idx=batch_idx,
            repeated=repeated,
            required=required,
            tokens=tokens,
            token_keys=token_keys or (),
        )
        if batch is None:
            return 0
        if self.writes:
            self._put(batch)
        return batch.record.rows

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

    def _put(self, item: SelectedBatch) -> None:
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
        pending: list[SelectedBatch] = []
        dtypes: dict[str, torch.dtype] = {}  # the pending batches' keys, kept as they come
        coded = self._encoder()  # the pending batches coded as they come, with a codec
        shards = ShardsInFlight(self.shards_in_flight, f"iocatch-upload-r{self.rank}")
        try:
            size = 0
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if self._cancel.is_set() or not isinstance(item, SelectedBatch):
                    continue
                if pending and _dtype_changes(dtypes, item):
                    shards.write(self._write_shard(pending, coded))
                    pending, size, dtypes, coded = [], 0, {}, self._encoder()
                if coded is not None:  # coded now; the batch keeps its tensors' shapes only
                    coded.add(batch_tensors(item, len(pending)))
                    item = shapes_only(item)
                pending.append(item)
                dtypes.update((key, t.dtype) for key, t in item.tensors.items())
                size += item.nbytes
                del item  # only ``pending`` holds the batch from here
                if size >= self.max_shard_bytes:
                    shards.write(self._write_shard(pending, coded))
                    pending, size, dtypes, coded = [], 0, {}, self._encoder()
            if pending and not self._cancel.is_set():
                shards.write(self._write_shard(pending, coded))
            pending, coded = [], None
            shards.finish()
            if not self._cancel.is_set():  # every shard committed: one record of them all
                self.backend.compact(self._committed)
        except _Cancelled:
            pass
        except BaseException as error:  # handed to the calling thread by _raise_error
            self._error = error
            self._cancel.set()  # shards still in flight stop at their next chunk
        finally:
            pending.clear()
            coded = None
            with contextlib.suppress(BaseException):
                shards.finish()  # never leaves a thread writing behind
            with contextlib.suppress(queue.Empty):  # free what waits, release a blocked put
                while True:
                    self._queue.get_nowait()
            self._done.set()

    def _encoder(self) -> ShardEncoder | None:
        return None if self.codec is None else ShardEncoder(self.codec)

    def _write_shard(
        self, batches: list[SelectedBatch], coded: ShardEncoder | None
    ) -> Callable[[], None]:
        """The shard's sequence number, now; its writing (``coded``: with a codec, its coded
        tensors), then its record (the commit point, see :mod:`~.backends.base`), when the
        returned function is called."""
        name = shard_name(self.rank, self._next_seq)
        self._next_seq += 1

        def write() -> None:
            crc, size = self.backend.write_shard(
                name,
                lambda handle: _serialize(handle, batches, self.rank, self._cancel, coded),
                durable=self.durable,
            )
            record = shard_record(name, self.rank, crc, size, batches, self.codec)
            self.backend.commit(record, durable=self.durable)
            with self._counts:
                self._committed.append(record)
                self.rows_written += sum(batch.record.rows for batch in batches)
                self.bytes_written += size

        return write


def _check_token_keys(
    tensors: Mapping[str, torch.Tensor],
    tokens: TokenSelection | None,
    token_keys: Collection[str] | None,
) -> None:
    """Refuse a token selection whose selected tensors are not named: without them, its
    token rows would be stored once per batch, found out only when read."""
    if tokens is not None and token_keys is None:
        raise StoreError(
            "ShardWriter.write got `tokens` without `token_keys`, the keys of the tensors the "
            "selection selected (only those are stored one row per token); pass "
            "`token_keys=` the keys it changed: `transformed_keys()` of the CaptureBuffer "
            "captured with it as its transform (FeatureWriter passes them), or () for none"
        )
    unknown = sorted(set(token_keys or ()) - set(tensors))
    if unknown:
        raise StoreError(
            f"`token_keys` name {unknown[0]!r}, which is not a tensor of this batch (it has "
            f"{sorted(tensors)}); name the keys of `tensors` the token selection selected"
        )


def _dtype_changes(dtypes: dict[str, torch.dtype], item: SelectedBatch) -> bool:
    """A key whose dtype differs from the pending batches' (``dtypes``, kept as batches
    join rather than rebuilt from them each batch: tiny batches made that quadratic in a
    shard): its shard must close first."""
    return any(dtypes.get(key, t.dtype) != t.dtype for key, t in item.tensors.items())
