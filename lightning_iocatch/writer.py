"""FeatureWriter: stream each predict batch's captures into a crash-safe, sharded store.

Batches are handed to a writer thread through a bounded queue (back-pressure instead of
unbounded memory); the thread packs them into safetensors shards of about
``max_shard_bytes`` and commits each shard atomically, then records it in the rank's
append-only ledger. See :mod:`lightning_iocatch.ledger` for the format and
:class:`~lightning_iocatch.FeatureStore` to read it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lightning_iocatch.errors import StoreError
from lightning_iocatch.keys import flatten_captures
from lightning_iocatch.ledger import (
    FORMAT,
    INDEX_KEY,
    STORE_FILE,
    BatchRecord,
    ShardRecord,
    append_ledger,
    drop_torn_tail,
    fsync_dir,
    is_store_file,
    ledger_name,
    read_ledgers,
    read_store_json,
    shard_crc32,
    shard_name,
    shard_rank_and_seq,
    write_json_atomic,
)
from lightning_iocatch.sinks import BatchCaptures, CaptureSink

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FeatureWriter"]

Mode = Literal["create", "resume", "overwrite"]
MODES = ("create", "resume", "overwrite")
_STOP = object()


@dataclass
class _Batch:
    record: BatchRecord
    tensors: dict[str, torch.Tensor]  # includes INDEX_KEY
    nbytes: int


def _versions() -> dict[str, str]:
    versions = {"torch": str(torch.__version__)}
    for package in ("lightning", "safetensors", "lightning-iocatch"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def _unpin(batch: _Batch) -> None:
    """Move pinned captures to ordinary memory, so the capture's pinned budget is freed now
    rather than when the shard fills up (the copy runs here, off the forward's path)."""
    for key, tensor in batch.tensors.items():
        if tensor.is_pinned():
            batch.tensors[key] = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _row_shapes(batches: list[_Batch]) -> dict[str, list[int] | None]:
    """The shape of one row of each key, or ``None`` where batches disagree."""
    shapes: dict[str, set[tuple[int, ...]]] = {}
    for batch in batches:
        for key, tensor in batch.tensors.items():
            if key != INDEX_KEY:
                shapes.setdefault(key, set()).add(tuple(tensor.shape[1:]))
    return {key: list(next(iter(seen))) if len(seen) == 1 else None for key, seen in shapes.items()}


class FeatureWriter(CaptureSink):
    """Write predict-loop captures to ``path`` as safetensors shards plus JSON metadata.

    Args:
        path: the store directory (created if needed).
        mode: ``"create"`` refuses a directory that is not empty; ``"resume"`` continues
            an interrupted dump, skipping the batches already committed; ``"overwrite"``
            deletes a previous store's files first.
        max_shard_bytes: a shard is committed once it holds this many bytes. The writer
            holds at most about two shards (one filling, one committing) in memory.
        dtype: cast floating tensors for storage (e.g. ``torch.float16``).
        queue_size: batches waiting for the writer thread before ``on_batch`` blocks.
        durable: fsync every shard before it is renamed and recorded, so a committed shard
            survives a machine crash. ``False`` keeps the atomic rename and the ledger (a
            killed process still loses nothing committed) but leaves flushing to the OS.
        stage: the loop whose captures are written (``"predict"``; others are ignored).

    Every captured tensor must have one row per sample (the batch dimension first).

    Example:
        >>> import tempfile, lightning.pytorch as pl
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from lightning_iocatch import FeatureStore, IOCaptureCallback
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        ...     def predict_step(self, batch, batch_idx):
        ...         return self.body(batch[0])
        >>> path = tempfile.mkdtemp() + "/features"
        >>> dump = IOCaptureCallback("outputs[body.0]", writer=FeatureWriter(path))
        >>> trainer = pl.Trainer(callbacks=[dump], logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, accelerator="cpu")
        >>> trainer.predict(Net(), DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=4),
        ...                 return_predictions=False)
        >>> store = FeatureStore(path)
        >>> store.keys(), store["body.0/outputs"].shape, store.indices.tolist()
        (['body.0/outputs'], torch.Size([10, 3]), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: Mode = "create",
        max_shard_bytes: int = 256 << 20,
        dtype: torch.dtype | None = None,
        queue_size: int = 4,
        durable: bool = True,
        stage: str = "predict",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if max_shard_bytes <= 0:
            raise ValueError(f"`max_shard_bytes` must be positive, got {max_shard_bytes}")
        if queue_size < 1:
            raise ValueError(f"`queue_size` must be at least 1, got {queue_size}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating-point dtype or None, got {dtype}")
        self.path = Path(path)
        self.mode = mode
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self.queue_size = queue_size
        self.durable = durable
        self.stage = stage
        self.spec: str | None = None  # set by IOCaptureCallback
        self._committed: dict[int, set[int]] = {}
        self._queue: queue.Queue[Any] | None = None
        self._commits: queue.Queue[Any] | None = None
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._rank = 0
        self._next_seq = 0
        self.rows_written = 0
        self.bytes_written = 0

    # CaptureSink

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != self.stage:
            return
        self._rank = trainer.global_rank
        self._prepare_directory(trainer)
        self._error = None
        self._start_threads()

    def skip_batch(self, stage: str, dataloader_idx: int, indices: tuple[int, ...] | None) -> bool:
        if stage != self.stage or not indices:
            return False
        committed = self._committed.get(dataloader_idx, set())
        return all(index in committed for index in indices)

    def on_batch(self, batch: BatchCaptures) -> None:
        if batch.stage != self.stage or self._queue is None:
            return
        self._raise_thread_error()
        item = self._prepare_batch(batch)
        while True:  # wait for room, but notice when the writer thread died meanwhile
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise_thread_error()

    def on_loop_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == self.stage:
            self._finish()
            self._raise_thread_error()

    def on_exception(self, stage: str, exception: BaseException) -> None:
        if stage == self.stage:
            self._finish()  # commit the batches that are complete; errors are already raised

    # Preparing the directory

    def _prepare_directory(self, trainer: pl.Trainer) -> None:
        """Check the mode against what is on disk, on every rank, before anyone writes."""
        self.path.mkdir(parents=True, exist_ok=True)
        ours = [p for p in self.path.iterdir() if is_store_file(p.name)]
        if self.mode == "create" and any(self.path.iterdir()):
            raise StoreError(
                f"{self.path} is not empty; use FeatureWriter(..., mode='resume') to continue "
                "an interrupted dump there, mode='overwrite' to replace it, or another path"
            )
        if self.mode == "resume" and not (self.path / STORE_FILE).exists():
            raise StoreError(
                f"nothing to resume in {self.path}: it holds no {STORE_FILE}; use mode='create'"
            )
        if self.mode == "resume":
            self._check_spec(read_store_json(self.path))
        trainer.strategy.barrier("iocatch-writer-checked")
        if trainer.global_rank == 0:
            if self.mode == "overwrite":
                for stale in ours:
                    stale.unlink()
            if self.mode == "resume":
                self._remove_debris()
            else:
                write_json_atomic(self.path / STORE_FILE, self._store_json(trainer))
        trainer.strategy.barrier("iocatch-writer-prepared")
        records = read_ledgers(self.path)
        self._committed = self._committed_indices(records)
        own = [shard_rank_and_seq(r.file) for r in records if r.rank == self._rank]
        self._next_seq = max((seq for _, seq in filter(None, own)), default=-1) + 1
        drop_torn_tail(self.path / ledger_name(self._rank))

    def _check_spec(self, existing: dict[str, Any]) -> None:
        if self.spec is not None and existing.get("spec") not in (None, self.spec):
            raise StoreError(
                f"{self.path} holds captures of spec {existing['spec']!r}, not {self.spec!r}; "
                "resume with the same spec, or write to another path"
            )

    def _store_json(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "spec": self.spec,
            "stage": self.stage,
            "dtype": str(self.dtype).removeprefix("torch.") if self.dtype else None,
            "world_size": trainer.world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "libraries": _versions(),
        }

    def _remove_debris(self) -> None:
        """Delete ``.tmp`` files and shards that no ledger line vouches for."""
        committed = {record.file for record in read_ledgers(self.path)}
        for path in self.path.iterdir():
            is_shard = path.name.startswith("shard-") and is_store_file(path.name)
            if path.name.endswith(".tmp") or (is_shard and path.name not in committed):
                path.unlink()
        fsync_dir(self.path)

    def _committed_indices(self, records: list[ShardRecord]) -> dict[int, set[int]]:
        committed: dict[int, set[int]] = {}
        for record in records:
            with safe_open(self.path / record.file, framework="pt") as shard:
                for position, batch in enumerate(record.batches):
                    indices = shard.get_tensor(f"b{position}/{INDEX_KEY}").tolist()
                    committed.setdefault(batch.dataloader_idx, set()).update(indices)
        return committed

    # Batches

    def _prepare_batch(self, batch: BatchCaptures) -> _Batch:
        if batch.indices is None:
            raise StoreError(
                "FeatureWriter needs the dataset index of every sample, which Lightning records "
                "for torch DataLoaders in trainer.predict; this batch came without them"
            )
        rows = len(batch.indices)
        tensors = {INDEX_KEY: torch.tensor(batch.indices, dtype=torch.int64)}
        for key, tensor in flatten_captures(batch.captures).items():
            if tensor.dim() == 0 or tensor.shape[0] != rows:
                raise StoreError(
                    f"FeatureWriter stores one row per sample, but {key!r} has shape "
                    f"{tuple(tensor.shape)} for a batch of {rows} samples; capture a module "
                    "whose output has the batch dimension first"
                )
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            tensors[key] = tensor.to("cpu").contiguous()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return _Batch(BatchRecord(batch.dataloader_idx, batch.batch_idx, rows), tensors, nbytes)

    # The writer threads: one serializes shards to .tmp files (and fsyncs them), the other
    # commits each (checksum, rename, ledger line) while the next one is being serialized.

    def _start_threads(self) -> None:
        self._queue = queue.Queue(maxsize=self.queue_size)
        self._commits = queue.Queue(maxsize=1)
        self._threads = [
            threading.Thread(target=self._serialize_loop, name=f"iocatch-shards-r{self._rank}"),
            threading.Thread(target=self._commit_loop, name=f"iocatch-commits-r{self._rank}"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _serialize_loop(self) -> None:
        assert self._queue is not None and self._commits is not None
        pending: list[_Batch] = []
        size = 0
        while (item := self._queue.get()) is not _STOP:
            if self._error is not None:
                continue  # keep draining so that the producer never blocks forever
            _unpin(item)
            pending.append(item)
            size += item.nbytes
            if size >= self.max_shard_bytes:
                self._serialize(pending)
                pending, size = [], 0
        if pending and self._error is None:
            self._serialize(pending)
        self._commits.put(_STOP)

    def _serialize(self, batches: list[_Batch]) -> None:
        assert self._commits is not None
        tmp = self.path / (shard_name(self._rank, self._next_seq) + ".tmp")
        tensors = {
            f"b{position}/{key}": tensor
            for position, batch in enumerate(batches)
            for key, tensor in batch.tensors.items()
        }
        try:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "rank": str(self._rank)})
            if self.durable:
                with open(tmp, "rb+") as handle:
                    os.fsync(handle.fileno())
        except (OSError, SafetensorError) as error:
            tmp.unlink(missing_ok=True)
            self._error = StoreError(f"could not write shard {tmp}: {error}")
            return
        self._next_seq += 1
        self._commits.put((tmp, tensors, batches))

    def _commit_loop(self) -> None:
        assert self._commits is not None
        while (item := self._commits.get()) is not _STOP:
            tmp, tensors, batches = item
            if self._error is not None:
                tmp.unlink(missing_ok=True)
                continue
            try:
                self._commit(tmp, tensors, batches)
            except BaseException as error:  # handed to the main thread by _raise_thread_error
                tmp.unlink(missing_ok=True)
                self._error = error

    def _commit(self, tmp: Path, tensors: dict[str, torch.Tensor], batches: list[_Batch]) -> None:
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        try:
            crc = shard_crc32(tmp, tensors)
            os.replace(tmp, final)
            if self.durable:
                fsync_dir(self.path)
        except OSError as error:
            raise StoreError(f"could not write shard {tmp}: {error}") from error
        keys = {
            key: str(tensor.dtype).removeprefix("torch.")
            for batch in batches
            for key, tensor in batch.tensors.items()
            if key != INDEX_KEY
        }
        record = ShardRecord(
            file=final.name,
            rank=self._rank,
            bytes=final.stat().st_size,
            crc32=crc,
            batches=tuple(batch.record for batch in batches),
            keys=keys,
            shapes=_row_shapes(batches),
        )
        try:
            append_ledger(self.path / ledger_name(self._rank), record)
        except OSError as error:
            raise StoreError(
                f"shard {final} was written but its ledger line could not be: {error}"
            ) from error
        self.rows_written += sum(batch.record.rows for batch in batches)
        self.bytes_written += record.bytes

    def _finish(self) -> None:
        threads, self._threads = self._threads, []
        if not threads or self._queue is None:
            return
        self._queue.put(_STOP)
        for thread in threads:
            thread.join()
        self._queue = self._commits = None

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise self._error
