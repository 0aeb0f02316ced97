"""FeatureWriter: stream each predict batch's captures into a crash-safe, sharded store.

The Lightning side of the store's writer: it decides on rank 0 what the directory allows
and broadcasts that decision, then hands each batch's flattened captures to a
:class:`~lightning_iocatch.store.writer.ShardWriter` (the Trainer-free core, where the
writing rules live). See :mod:`lightning_iocatch.store.names` and
:mod:`lightning_iocatch.store.commits` for the format and :class:`~lightning_iocatch.FeatureStore`
to read it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.checks import check_bool, check_int, parse_dtype
from lightning_iocatch.errors import CaptureError, StoreError
from lightning_iocatch.lightning.batch_indices import missing_indices_reason
from lightning_iocatch.lightning.function_records import adopt_fingerprints, refuse_undecidable
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout
from lightning_iocatch.lightning.sinks import STAGES, BatchCaptures, CaptureSink
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.plan import MODES, Mode, StorePlan, prepare_store
from lightning_iocatch.store.shard_codec import check_codec
from lightning_iocatch.store.shard_file import STORABLE_DTYPES
from lightning_iocatch.store.tokens import TokenRows
from lightning_iocatch.store.writer import ShardWriter

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FeatureWriter", "bind_writers", "writers_tokens"]

# The key of a module's whole output (a module that returns one tensor): the user asked
# for exactly this tensor, so it must have a row per sample.
_WHOLE_OUTPUT = re.compile(r"[^/]*/(?:grad_)?outputs(@[0-9]+)?")


def _required(key: str, tokens: bool) -> bool:
    """Whether ``key`` must have a row per sample (per selected token, with token rows: only
    for a module's first call; later calls, such as ``generate()``'s decoding steps with
    one new token, are stored once per batch)."""
    match = _WHOLE_OUTPUT.fullmatch(key)
    return match is not None and not (tokens and match.group(1))


def _flatten(captures: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Every captured tensor under its flat key; two values with one key are refused."""
    try:
        return flatten_captures(captures)
    except CaptureError as error:
        raise StoreError(f"FeatureWriter: {error}") from error


class FeatureWriter(CaptureSink):
    """Write predict-loop captures to ``path`` as safetensors shards plus JSON metadata.

    Args:
        path: the store directory (created if needed), or an fsspec URL of a prefix on
            object storage (``s3://bucket/run``, ``gs://...``, ``memory://...``), written
            with the object protocol of :mod:`lightning_iocatch.store.backends.objects`.
        mode: ``"create"`` refuses a directory that is not empty; ``"resume"`` continues
            an interrupted dump, writing only the samples not yet committed; ``"overwrite"``
            deletes a previous store's files first (and nothing else).
        max_shard_bytes: a shard is written once its batches hold this many bytes.
        dtype: cast floating tensors for storage: a floating ``torch.dtype`` or its name
            (``"float16"``, ``"bfloat16"``: stored natively, bit for bit as
            ``tensor.to(torch.bfloat16)``). An 8-bit float (``"float8_e4m3fn"``,
            ``"float8_e5m2"``) stores each floating tensor with a float32 scale per row
            (``max|x| / 448`` for e4m3fn; see :mod:`~lightning_iocatch.store.shard_file`),
            computed on the capture's device; readers return it dequantized (float32 by
            default, or the ``dtype=`` they ask for). A key whose rows are single values
            (0-d, shape ``(batch,)`` or ``(batch, 1)``) is stored as float32, unscaled: a
            4-byte scale per 1-byte value would make it bigger than float32. A float64
            value beyond float32's range (these keys are read in float32) is refused. The fnuz
            variants (``"float8_e4m3fnuz"``, largest 240; ``"float8_e5m2fnuz"``, largest
            57344) are stored the same way; they have no negative zero (-0.0 reads 0.0) and
            no infinity (an infinity reads NaN).
        codec: ``"zstd"`` compresses each shard's tensors losslessly (needs
            ``pip install lightning-iocatch[zstd]``), in blocks of whole rows (about 1 MiB)
            so that a read of some rows, also a ranged read on object storage, fetches and
            decodes only their blocks; each block carries a checksum, so a damaged one is
            refused, never decoded into garbage. ``None`` (default): no codec. Invisible
            to readers.
        queue_size: batches waiting for the writer thread before ``on_batch`` blocks.
        durable: fsync every shard before it is renamed and recorded, so a committed shard
            survives a machine crash. ``False`` keeps the atomic rename and the ledger (a
            killed process still loses nothing committed) but leaves flushing to the OS.
        stage: the loop whose captures are written: ``"predict"``, the one loop a dump
            runs once over the data (a validation loop runs every epoch, so its dump
            would be rewritten or refused each time: capture it with a sink of your own).
        tokens: store one row per selected token of ``(batch, seq, ...)`` captures (or one
            per sample, reduced over the selected tokens), with each row's position and
            token id: a :class:`~lightning_iocatch.store.tokens.TokenRows`. The callback
            applies it as it captures, on the model's device, so every sink of the callback
            gets token rows in predict.
        storage_options: fsspec options for a URL ``path`` (credentials, endpoint, ...),
            passed through as they are.
        shards_in_flight: shards written at once: uploads kept going on object storage
            (default 4), one at a time on disk (default 1).

    Memory: the writer holds at most ``shards_in_flight`` shards being written and one
    being filled (each ``max_shard_bytes`` plus the batch that fills it), and
    ``queue_size + 1`` more batches, whatever the speed of the disk or the network.

    Each dataset index is written once: rows already committed (``mode="resume"``) or
    already written are dropped, the rest of their batch is written. A tensor with a row
    per sample (first dimension = the batch's number of samples) is stored row by row; any
    other tensor is stored once per batch (see :mod:`lightning_iocatch.store.exactly_once`), except
    a module's whole output, which must have a row per sample.

    Examples:
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
        dtype: torch.dtype | str | None = None,
        queue_size: int = 4,
        durable: bool = True,
        stage: str = "predict",
        tokens: TokenRows | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shards_in_flight: int | None = None,
        codec: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if stage != "predict":
            raise ValueError(
                f"`stage` must be 'predict' (FeatureWriter dumps the predict loop, which runs "
                f"once over the data; {STAGES} are the loops), got {stage!r}"
            )
        self.backend = open_backend(path, storage_options)
        self.path = self.backend.path  # a local directory, or an ObjectLocation
        self.mode = mode
        self.max_shard_bytes = check_int("max_shard_bytes", max_shard_bytes, minimum=1)
        self.dtype = parse_dtype("dtype", dtype)
        if self.dtype is not None and self.dtype not in STORABLE_DTYPES:
            raise ValueError(f"`dtype` {dtype!r} is a dtype safetensors cannot store")
        self.codec = check_codec(codec)
        self.queue_size = check_int("queue_size", queue_size, minimum=1)
        self.shards_in_flight = (
            None
            if shards_in_flight is None
            else check_int("shards_in_flight", shards_in_flight, minimum=1)
        )
        self.durable = check_bool("durable", durable)
        self.stage = stage
        if tokens is not None and not isinstance(tokens, TokenRows):
            raise TypeError(f"`tokens` must be a TokenRows or None, got {type(tokens).__name__}")
        self.tokens = tokens
        self._spec: str | None = None
        self.edits: list[Any] | None = None  # the callback's edits, described
        self._owner: object | None = None  # the IOCaptureCallback it belongs to
        self._dumped = False  # one writer, one dump
        self._core: ShardWriter | None = None
        self._rows_before = self._bytes_before = 0

    @property
    def spec(self) -> str | None:
        """The capture spec of the :class:`~lightning_iocatch.IOCaptureCallback` this writer
        belongs to (recorded in ``store.json``); ``None`` before it is given to one."""
        return self._spec

    def bind(self, owner: object, spec: str) -> None:
        """Belong to the callback ``owner``, which captures ``spec``: a writer belongs to
        one callback (its store records one spec)."""
        self.check_unbound()
        self._owner, self._spec = owner, spec

    def check_unbound(self) -> None:
        """Refuse a writer that already belongs to a callback."""
        if self._owner is not None:
            raise ValueError(
                f"this FeatureWriter ({self.path}) already belongs to another "
                f"IOCaptureCallback (spec {self._spec!r}); a writer belongs to one callback, "
                "whose spec its store records: give each callback its own FeatureWriter"
            )

    @property
    def rows_written(self) -> int:
        """Rows this writer wrote (over all its loops)."""
        return self._rows_before + (self._core.rows_written if self._core else 0)

    @property
    def bytes_written(self) -> int:
        """Bytes of shards this writer wrote (over all its loops)."""
        return self._bytes_before + (self._core.bytes_written if self._core else 0)

    # CaptureSink

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == self.stage:
            self._end(abort=True)  # a loop that never reached its end leaves nothing running
            if self._dumped and self.mode != "resume":
                raise StoreError(
                    f"this FeatureWriter (mode={self.mode!r}) already wrote its dump to "
                    f"{self.path} in an earlier trainer.predict, and a second run in that "
                    "mode would write over it: for another dump give the callback a new "
                    "FeatureWriter with another path; to continue this one (say, after a "
                    "failure), IOCaptureCallback(..., writer=FeatureWriter(path, "
                    "mode='resume'))"
                )
            reason = missing_indices_reason(trainer, stage)
            if reason is not None:
                raise StoreError(f"FeatureWriter stores rows by dataset index, but {reason}")
            layout = DataParallelLayout.of(trainer)
            self._core = ShardWriter(
                self.backend,
                rank=layout.rank,  # one writer per tensor-parallel group, named by its data
                writes=layout.counts,  # rank; the others check and skip the same batches
                plan=self._plan(trainer, layout),
                max_shard_bytes=self.max_shard_bytes,
                queue_size=self.queue_size,
                shards_in_flight=self.shards_in_flight,
                durable=self.durable,
                dtype=self.dtype,
                codec=self.codec,
            )
            self._dumped = True  # from here on the path holds this writer's dump

    def skip_batch(self, stage: str, dataloader_idx: int, indices: tuple[int, ...] | None) -> bool:
        if stage != self.stage or not indices or self._core is None:
            return False
        return self._core.has(dataloader_idx, indices)

    def on_batch(self, batch: BatchCaptures) -> None:
        if batch.stage == self.stage and self._core is not None:
            self._write(self._core, batch)

    def on_loop_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != self.stage:
            return
        error: Exception | None = None
        try:
            self._end(abort=False)
        except Exception as caught:  # raised below, once every process has finished
            error = caught
        # Every process's shards are committed before predict returns on any of them, so
        # the store can be read right after it (on rank 0, say).
        everyone = trainer.strategy.reduce_boolean_decision(error is None, all=True)
        if error is not None:
            raise error
        if not everyone:
            raise StoreError(
                f"the writer of another process failed at the end of the dump to {self.path}; "
                "its own error says why"
            )

    def on_exception(self, stage: str, exception: BaseException) -> None:
        if stage == self.stage:
            # Ctrl-C stops at once; any other failure still commits the complete batches.
            # The run already fails with ``exception``: a writer error is not raised over it.
            with contextlib.suppress(StoreError):
                self._end(abort=isinstance(exception, KeyboardInterrupt))

    # The work

    def _plan(self, trainer: pl.Trainer, layout: DataParallelLayout) -> StorePlan:
        """Decide on rank 0 and broadcast, so that every rank gets the same answer."""
        local: BaseException | None = None
        outcome: StorePlan | str | None = None
        if trainer.global_rank == 0:
            settings: dict[str, Any] = {
                "spec": self.spec,
                "stage": self.stage,
                "dtype": str(self.dtype).removeprefix("torch.") if self.dtype else None,
                "tokens": self.tokens.settings() if self.tokens else None,
                "world_size": layout.size,  # the data-parallel ranks, each writing its share
            }
            if self.edits is not None:  # only then: stores of dumps without edits resume
                settings["edits"] = self.edits
            # in setup, before Lightning's own bar starts: a bar where the Trainer shows one
            progress = None if trainer.progress_bar_callback is not None else False
            try:
                adopt_fingerprints(self.backend, self.mode, settings)
                outcome = prepare_store(self.backend, self.mode, settings, progress=progress)
                refuse_undecidable(self.backend, settings, outcome)
            except Exception as error:  # raised below, on every rank
                local, outcome = error, str(error) or type(error).__name__
        outcome = trainer.strategy.broadcast(outcome, src=0)
        if local is not None:
            raise local
        if not isinstance(outcome, StorePlan):
            raise StoreError(str(outcome))
        try:
            sees = self.backend.read_info() == outcome.store_json
        except (StoreError, OSError):
            sees = False
        if not trainer.strategy.reduce_boolean_decision(sees, all=True):
            raise StoreError(
                f"not every process sees the store that rank 0 prepared at {self.path}: "
                "FeatureWriter needs one directory that all processes share (a node-local "
                "path on several machines would split the store); use a shared filesystem"
            )
        return outcome

    def _write(self, core: ShardWriter, batch: BatchCaptures) -> None:
        if batch.indices is None:
            raise StoreError(
                "FeatureWriter needs the dataset index of every sample, which Lightning records "
                "for torch DataLoaders in trainer.predict; this batch came without them"
            )
        if (self.tokens is None) != (batch.tokens is None):
            raise StoreError(
                f"FeatureWriter(tokens={self.tokens!r}) got a batch captured "
                f"{'without' if batch.tokens is None else 'with'} a token selection; give the "
                "writer to IOCaptureCallback(writer=...), which applies its `tokens`"
            )
        tensors = _flatten(batch.captures)
        core.write(
            tensors,
            batch.indices,
            dataloader_idx=batch.dataloader_idx,
            batch_idx=batch.batch_idx,
            repeated=batch.repeated,
            required=[key for key in tensors if _required(key, batch.tokens is not None)],
            tokens=batch.tokens,
            token_keys=batch.captures.transformed_keys(),
        )

    def _end(self, *, abort: bool) -> None:
        core, self._core = self._core, None
        if core is None:
            return
        try:
            if abort:
                core.abort()
            else:
                core.close()
        finally:
            self._rows_before += core.rows_written
            self._bytes_before += core.bytes_written


def bind_writers(
    owner: object, spec: str, sinks: Sequence[CaptureSink], edits: list[Any] | None = None
) -> None:
    """Make the writers among ``sinks`` belong to the callback ``owner``, which captures
    ``spec`` under ``edits`` (described), or refuse before binding any of them."""
    writers = [sink for sink in sinks if isinstance(sink, FeatureWriter)]
    if len({id(writer) for writer in writers}) < len(writers):
        raise ValueError(
            "a FeatureWriter is given twice to one IOCaptureCallback (as `writer` and in "
            "`sinks`, or twice in `sinks`): give it once"
        )
    for writer in writers:
        writer.check_unbound()
    for writer in writers:
        writer.bind(owner, spec)
        writer.edits = edits


def writers_tokens(sinks: Sequence[CaptureSink]) -> TokenRows | None:
    """The ``tokens`` of the callback's writers: one capture serves them all, so they agree."""
    writers = [sink for sink in sinks if isinstance(sink, FeatureWriter)]
    found = {repr(writer.tokens.settings() if writer.tokens else None) for writer in writers}
    if len(found) > 1:
        raise ValueError(
            "the writers of one IOCaptureCallback must have the same `tokens` (the callback "
            "captures once for all of them); use one callback per kind of rows"
        )
    return writers[0].tokens if writers else None
