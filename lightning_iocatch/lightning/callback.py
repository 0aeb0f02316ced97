"""IOCaptureCallback: capture named submodules in Lightning's validation, test and predict loops.

Lightning's hooks decide when the catcher is armed; the capture itself is the engine's
(:mod:`lightning_iocatch.capture.catcher`). Hooks exist only while an armed loop runs: they are
registered when the loop starts and removed when it ends, raises, or the trainer tears
down, whichever comes first.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric
from typing_extensions import override

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.sharded import checked_shard_layouts
from lightning_iocatch.checks import (
    check_bool,
    check_int,
    check_optional_bool,
    parse_capture_dtype,
    parse_device,
)
from lightning_iocatch.lightning.batch_indices import BatchIndexer
from lightning_iocatch.lightning.callback_arguments import (
    checked_gradient_pass,
    checked_sinks,
    checked_spec,
    checked_stages,
    described_edits,
)
from lightning_iocatch.lightning.callback_batches import BatchSteps
from lightning_iocatch.lightning.feature_writer import FeatureWriter, bind_writers, writers_tokens
from lightning_iocatch.lightning.gradient_pass import ForwardFn, LossFn, OutputFn
from lightning_iocatch.lightning.parallel_layout import forwards_gather_parameters
from lightning_iocatch.lightning.predict_route import (
    PredictMember,
    join_predict_route,
    leave_predict_route,
)
from lightning_iocatch.lightning.probe_sink import ProbeTokens
from lightning_iocatch.lightning.process_group_exit import destroy_gloo_group_at_exit
from lightning_iocatch.lightning.sinks import CaptureSink, MemorySink

__all__ = ["IOCaptureCallback"]


class IOCaptureCallback(Callback, BatchSteps):
    """Capture inputs and outputs of named submodules of the LightningModule, and gradients.

    Args:
        spec: what to capture, e.g. ``"outputs[model.layers.5]"`` (see
            :class:`~lightning_iocatch.CaptureSpec`). Names are those of
            ``pl_module.named_modules()``: ``model.layers.0`` for ``self.model.layers[0]``.
            ``grad_outputs[...]`` and ``grad_inputs[...]`` capture the gradient of the loss
            with respect to a module's outputs or inputs: the callback then runs a forward
            and backward of its own at each batch's end, which gives every capture of the
            spec and applies ``edits``; the step's forward runs untouched
            (:mod:`~lightning_iocatch.lightning.gradient_pass`).
        stages: the loops to capture in: ``"validate"`` (``trainer.validate`` and the
            validation loop of ``trainer.fit``), ``"test"``, ``"predict"``.
        device: where captured tensors are copied; ``None`` leaves them where they are.
        dtype: cast captured floating tensors, e.g. ``torch.float16`` or ``"float16"``.
        early_exit: in predict, stop each forward as soon as everything in ``spec`` has
            been captured; ``trainer.predict`` then returns one capture dict per batch.
            Validation and test forwards always run whole.
        writer: a :class:`~lightning_iocatch.FeatureWriter`, or a directory for one, that
            dumps the predict loop's captures to disk.
        probes: validation/test probes from :mod:`lightning_iocatch.probes`, logged at the
            end of each epoch as ``iocatch/{module}/{inputs|outputs}[/{path}]/{stat}``.
        probe_tokens: which tokens of a sequence batch the probes count: by default
            (``"attention_mask"``) those where the batch's ``attention_mask`` is non-zero,
            where the batch is a mapping holding one; ``"all"`` every position; a
            :class:`~lightning_iocatch.TokenRows` the tokens it keeps; or a function of
            the batch giving a ``(batch, seq)`` mask (see
            :class:`~lightning_iocatch.lightning.probe_sink.ProbeSink`).
        sinks: further consumers of each batch's captures (see :class:`CaptureSink`).
        keep_in_memory: keep the latest run of each stage in :attr:`captures`; by
            default only when there is no sink.
        capture_sanity_check: also capture the sanity-check validation before fitting.
        pinned_memory_bytes: cap of the pinned host memory that asynchronous CUDA-to-CPU
            copies use (``0``: copy synchronously); see :class:`ModelIOCatcher`.
        edits: edits of the forward (:mod:`lightning_iocatch.capture.edits`; names as in
            the spec) applied in every captured stage; a writer's store records them, and a
            resume under other edits is refused. Each batch's edits are
            ``edit.for_batch(indices)`` with the batch's dataset indices (a
            :class:`~lightning_iocatch.capture.store_patch.StorePatch` patches each sample
            with its stored row; it refuses a DataLoader whose indices are unknown).
        loss: with gradients in ``spec``, ``loss(logits, batch)`` -> per-sample losses or
            ``(sums, counts)``, as for :class:`~lightning_iocatch.InterventionEffects` (and
            its default); the gradients are of their sum, so each sample's is its own.
        forward: with gradients, ``forward(pl_module, batch)`` runs the model (idem).
        output: with gradients, the logits of what ``forward`` returns (idem).
        shard_layouts: under tensor parallelism, the placement of a value that no parallel
            style declares, by ``"{inputs|outputs}[name]"`` (e.g.
            ``{"outputs[model.mlp.split]": Shard(-1)}``); every other value is made whole
            by itself (see :mod:`~lightning_iocatch.capture.sharded`).

    After a run, ``callback.captures[stage][dataloader_idx][name]["outputs"]`` holds one
    entry per call (the reference buffer layout), and
    ``callback.batch_indices[stage][dataloader_idx]`` the dataset indices of each batch.

    Examples:
        >>> import lightning.pytorch as pl, torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Tiny(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ...     def forward(self, x):
        ...         return self.model(x)
        ...     def predict_step(self, batch, batch_idx):
        ...         return self(batch[0])
        >>> loader = DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=5)
        >>> callback = IOCaptureCallback("outputs[model.1]", early_exit=True)
        >>> trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, accelerator="cpu")
        >>> batches = trainer.predict(Tiny(), loader)
        >>> [b["model.1"]["outputs"][0].shape for b in batches]
        [torch.Size([5, 8]), torch.Size([5, 8])]
        >>> callback.batch_indices["predict"][0]
        [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    """

    def __init__(
        self,
        spec: str,
        *,
        stages: Sequence[str] = ("validate", "predict"),
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        early_exit: bool = False,
        writer: FeatureWriter | str | os.PathLike[str] | None = None,
        probes: Sequence[Metric] = (),
        probe_tokens: ProbeTokens = "attention_mask",
        sinks: Sequence[CaptureSink] = (),
        keep_in_memory: bool | None = None,
        capture_sanity_check: bool = False,
        pinned_memory_bytes: int = 256 << 20,
        edits: Sequence[Edit] = (),
        loss: LossFn | None = None,
        forward: ForwardFn | None = None,
        output: OutputFn | None = None,
        shard_layouts: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = checked_spec(spec)
        self.shard_layouts = checked_shard_layouts(shard_layouts)
        early_exit = check_bool("early_exit", early_exit)
        self.stages = checked_stages(stages, early_exit)
        self._gradients = checked_gradient_pass(self.spec, early_exit, loss, forward, output)
        sinks, self.probes = checked_sinks(writer, probes, sinks, edits, self.stages, probe_tokens)
        self.device = parse_device("device", device)
        self.dtype = parse_capture_dtype("dtype", dtype)
        self.early_exit = early_exit
        self.capture_sanity_check = check_bool("capture_sanity_check", capture_sanity_check)
        keep_in_memory = check_optional_bool("keep_in_memory", keep_in_memory)
        self.pinned_memory_bytes = check_int("pinned_memory_bytes", pinned_memory_bytes, minimum=0)
        self._memory = (
            MemorySink() if keep_in_memory or (keep_in_memory is None and not sinks) else None
        )
        self._sinks = [*sinks, *([self._memory] if self._memory else [])]
        self._catcher: ModelIOCatcher | None = None
        self._session = None
        self._stage = None
        self._leave_route: Callable[[], None] | None = None
        self._skip_step = False
        self._forwards_gather = False  # each forward gathers parameters from every process
        self._indexer = None
        self._looked_up = None
        described = described_edits(edits)
        self.edits = list(edits)
        self._token_rows = writers_tokens(sinks)
        bind_writers(
            self, self.spec.to_string(), sinks, described
        )  # last: a refused callback binds none

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(spec=self.spec.to_string(), stages=self.stages)

    @property
    def captures(self) -> dict[str, dict[int, CaptureBuffer]]:
        """``captures[stage][dataloader_idx]``: the latest run of each stage, if kept in memory."""
        return self._memory.captures if self._memory else {}

    @property
    def batch_indices(self) -> dict[str, dict[int, list[tuple[int, ...] | None]]]:
        """``batch_indices[stage][dataloader_idx]``: dataset indices of each captured batch."""
        return self._memory.indices if self._memory else {}

    # Lightning hooks: each hands off to a private helper.

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        destroy_gloo_group_at_exit()  # sinks make collectives; see process_group_exit

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "validate" in self.stages:
            self._catcher_for(pl_module).from_spec(self.spec, edits=self.edits)  # names checked

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking or self.capture_sanity_check:
            self._start("validate", trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start("test", trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start("predict", trainer, pl_module)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("validate", trainer, batch, batch_idx, dataloader_idx)

    @override
    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("test", trainer, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("predict", trainer, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("validate", trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("test", trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("predict", trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end("validate", trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end("test", trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end("validate", trainer, pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end("test", trainer, pl_module)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end("predict", trainer, pl_module)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stopped_by(exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    # The work.

    def _catcher_for(self, pl_module: pl.LightningModule) -> ModelIOCatcher:
        if self._catcher is None or self._catcher.model is not pl_module:
            self._catcher = ModelIOCatcher(
                pl_module,
                self.device,
                dtype=self.dtype,
                pinned_memory_bytes=self.pinned_memory_bytes,
                shard_layouts=self.shard_layouts,
            )
        return self._catcher

    def _start(self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if stage not in self.stages:
            return
        self._close()  # a loop that never reached its end hook leaves nothing behind
        catcher = self._catcher_for(pl_module)
        early_exit = self.early_exit and stage == "predict"
        session = catcher.from_spec(self.spec, early_exit=early_exit, edits=self.edits)
        for sink in self._sinks:
            sink.on_loop_start(trainer, pl_module, stage)
        if self._gradients is None:  # else open only around the batch's gradient pass
            session.open()
        self._session, self._stage = session, stage
        self._indexer = BatchIndexer(stage)
        self._forwards_gather = forwards_gather_parameters(trainer, pl_module)
        if stage == "predict":
            member = PredictMember(session, lambda: self._skip_step)
            join_predict_route(pl_module, member)
            self._leave_route = lambda: leave_predict_route(pl_module, member)

    def _epoch_end(self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stage == stage:
            for sink in self._sinks:
                sink.on_epoch_end(trainer, pl_module, stage)

    def _end(self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stage != stage:
            return
        self._close()
        for sink in self._sinks:
            sink.on_loop_end(trainer, pl_module, stage)

    def _stopped_by(self, exception: BaseException) -> None:
        """Close and tell every sink, whatever fails on the way: Lightning then raises the
        run's own ``exception`` and tears down; what failed here is reported as a warning."""
        stage = self._stage
        steps = [self._close]
        if stage is not None:
            steps += [partial(sink.on_exception, stage, exception) for sink in self._sinks]
        for step in steps:
            try:
                step()
            except Exception as error:  # each step runs, whatever the others do
                warnings.warn(
                    f"IOCaptureCallback: while the run stopped on {type(exception).__name__}, "
                    f"{type(error).__name__}: {error}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _close(self) -> None:
        """Remove the hooks and restore ``predict_step``; safe to call at any time."""
        session, self._session, self._stage = self._session, None, None
        self._indexer, self._looked_up = None, None
        leave_route, self._leave_route = self._leave_route, None
        self._skip_step = False
        try:
            if leave_route is not None:
                leave_route()
        finally:
            if session is not None:
                session.close()
