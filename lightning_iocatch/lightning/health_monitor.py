"""ActivationMonitor: the health of watched modules during ``fit``, every N steps, cheaply.

On the first optimizer step of a fit (a resumed one's too) and every ``every_n_steps``-th
step (0, N, 2N, ...), the monitor opens a capture session on the LightningModule for that
step's batches (every micro-batch of a step under gradient accumulation) and closes it at
the step's end: between watched steps nothing is registered (the session, its names
resolved, is made once a fit; opening it registers its hooks). Each captured tensor of the
spec (``outputs[...]``, ``inputs[...]``, and the gradients ``grad_outputs[...]``,
``grad_inputs[...]``, taken in the training step's own backward; under a GradScaler
divided by its scale) is reduced on its device to a small statistics vector
(:func:`~lightning_iocatch.probes.health.health_statistics`, real tokens only where the
batch has an ``attention_mask``; small tensors are copied into blocks and reduced
together at the batch's end: :mod:`~lightning_iocatch.lightning.health_transform`); at
the step's end the vectors of every process are
gathered in one collective (in the layout of
:mod:`~lightning_iocatch.lightning.health_layout`, agreed once), merged, and logged
through Lightning for each flat key ``k``: ``{prefix}/{k}/mean``, ``/rms``, ``/absmax``,
``/kurtosis``, ``/dead_frac`` (units zero on every row of the step) and ``/nonfinite``
(NaN and ±inf values), sent to every logger at that step (and into
``trainer.callback_metrics``).

A NaN or inf in a watched forward or backward is traced to the first place it appeared:
the first key in the forward's execution order that has one, else, for gradients, the
first in the backward's (the last of the forward). The monitor records it in
:attr:`ActivationMonitor.nonfinite` (the step, the key, the dataset indices of the samples
whose rows of that key were not finite when ``indices=`` gives the batch's) and warns, or
with ``on_nonfinite="raise"`` stops training with that message. It decides in
``on_before_optimizer_step``, before the optimizer applies the step's update, so a raise
leaves the model as it was when the step began (under manual optimization: at the
batch's end, after the optimizer steps its ``training_step`` took).

Examples:
    >>> monitor = ActivationMonitor("outputs[model.layers.*]", every_n_steps=50)
    >>> monitor.watches(0), monitor.watches(49), monitor.watches(50)
    (True, False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.capture.session import CaptureSession
from lightning_iocatch.capture.spec import CaptureSpec
from lightning_iocatch.lightning.health_histograms import log_histograms
from lightning_iocatch.lightning.health_layout import HealthLayout, alone_figures
from lightning_iocatch.lightning.health_transform import StatisticsBlocks, _Statistics
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout
from lightning_iocatch.probes.health import (
    EDGES,
    HEAD,
    HealthFigures,
    merge_statistics,
)
from lightning_iocatch.token_mask import real_tokens

__all__ = ["ActivationMonitor", "NonFiniteError"]


class NonFiniteError(RuntimeError):
    """A NaN or inf appeared in a watched forward or backward (``on_nonfinite="raise"``)."""


class ActivationMonitor(pl.Callback):
    """Watch the modules of ``spec`` during training every ``every_n_steps`` steps.

    Args:
        spec: the values to watch, e.g. ``"outputs[model.layers.*]|grad_outputs[model.layers.*]"``
            (names as seen from the LightningModule).
        every_n_steps: watch the first optimizer step and every N-th after it (under
            manual optimization: the batch whose optimizer steps reach the next multiple of
            N, as the last batch's number of steps foretells; a batch that takes more steps
            than that may leave it to the next batch, logged at its own first step, so
            that each logged step is once and in order).
        tokens: count only the real tokens of a batch with an ``attention_mask``
            (``"attention_mask"``), or every row (``None``).
        on_nonfinite: ``"warn"``, or ``"raise"`` (a :class:`NonFiniteError` stops ``fit``).
        indices: ``indices(batch)`` -> the batch's dataset indices; those of the samples
            that hold a non-finite value are kept with it (every index where a value's
            first dimension is not the samples).
        histograms: also a histogram of ``|x|`` per key (4 bins a decade, ``1e-6`` to
            ``1e3``), logged as ``{prefix}/{key}/abs`` by the loggers that take
            histograms (Lightning's ``TensorBoardLogger`` and ``WandbLogger``).
        prefix: of the logged names.
        history_size: the watched steps :attr:`history` keeps (the oldest dropped first).

    :attr:`history` (``(step, {name: value})`` of the watched steps) and :attr:`nonfinite`
    are kept in Lightning's checkpoints: a fit resumed with ``ckpt_path=`` continues them.
    The first step of every fit is watched, a resumed one's too.

    Under ``precision="16-mixed"`` the gradients seen in the backward are those of the loss
    multiplied by the GradScaler's scale: their statistics are divided by the scale of that
    backward (each gradient is reduced as it arrives), so the figures are those of the
    true gradients. ``{prefix}/grad_overflow`` is 1 on a step whose optimizer step the
    scaler skipped (any gradient not finite: it lowered its scale); non-finite values in
    the watched gradients alone on such a step are logged, not traced or raised. Under
    DeepSpeed's float16, which scales the loss without a GradScaler, gradients are refused.
    """

    def __init__(
        self,
        spec: str,
        *,
        every_n_steps: int = 50,
        tokens: str | None = "attention_mask",
        on_nonfinite: str = "warn",
        indices: Callable[[Any], Sequence[int]] | None = None,
        histograms: bool = False,
        prefix: str = "health",
        history_size: int = 1000,
    ) -> None:
        if not _positive_int(every_n_steps):
            raise ValueError(f"`every_n_steps` must be a positive integer, got {every_n_steps!r}")
        if on_nonfinite not in ("warn", "raise"):
            raise ValueError(f"`on_nonfinite` must be 'warn' or 'raise', got {on_nonfinite!r}")
        if tokens not in ("attention_mask", None):
            raise ValueError(f"`tokens` must be 'attention_mask' or None, got {tokens!r}")
        if not _positive_int(history_size):
            raise ValueError(f"`history_size` must be a positive integer, got {history_size!r}")
        self.spec = CaptureSpec.parse(spec)
        if self.spec.is_empty:
            raise ValueError(f"the spec {spec!r} watches nothing")
        self.every_n_steps, self.tokens = every_n_steps, tokens
        self.on_nonfinite, self.indices, self.prefix = on_nonfinite, indices, prefix
        self.histograms, self.history_size = histograms, history_size
        self.last_values: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, its figures)
        self.nonfinite: list[dict[str, Any]] = []
        self._catcher: ModelIOCatcher | None = None
        self._armed: CaptureSession | None = None  # this fit's session, opened when watched
        self._session: CaptureSession | None = None  # the session while it is open
        self._blocks = StatisticsBlocks()  # the small tensors' float64 blocks, for a fit
        self._transform: _Statistics | None = None
        self._step = -1  # the optimizer step the watched batch began at
        self._named = -1  # the step its figures are logged at (a multiple of N in its steps)
        self._span = 1  # the optimizer steps a batch takes (the last batch that stepped)
        self._due, self._watched = 0, False  # the next step to watch; this batch watched
        self._began = 0  # the optimizer step the current batch began at
        self._vectors: dict[str, torch.Tensor] = {}  # flat key -> merged statistics
        self._order: dict[str, None] = {}  # the keys' prefixes, in the order captured
        self._rank = 0
        self._counted = [0]  # the global ranks whose statistics count
        self._batch_indices: list[int] = []  # the current batch's, with ``indices``
        self._samples: list[tuple[list[int], dict[str, torch.Tensor | None]]] = []  # per batch
        self._first: int | None = None  # the first step of this fit
        self._scaled = False  # a GradScaler scaled this step's backward
        self._overflows: list[torch.Tensor] = []  # a gradient not finite, at each step
        self._layout = HealthLayout(self._head())

    @property
    def state_key(self) -> str:
        return self._generate_state_key(spec=str(self.spec), prefix=self.prefix)

    def state_dict(self) -> dict[str, Any]:
        """The history and the non-finite records, for Lightning's checkpoints."""
        return {
            "history": [[step, dict(logged)] for step, logged in self.history],
            "nonfinite": [dict(record) for record in self.nonfinite],
            "last_values": dict(self.last_values),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the history of the checkpoint's fit."""
        self.history = [(int(step), dict(logged)) for step, logged in state_dict["history"]]
        del self.history[: -self.history_size]
        self.nonfinite = [dict(record) for record in state_dict["nonfinite"]]
        self.last_values = dict(state_dict.get("last_values", {}))

    def watches(self, step: int, steps: int = 1) -> bool:
        """Whether a batch whose ``steps`` optimizer steps begin at ``step`` (0 first) is
        watched: they contain a multiple of ``every_n_steps``.

        Examples:
            >>> monitor = ActivationMonitor("outputs[model.layers.*]", every_n_steps=3)
            >>> [step for step in range(0, 12, 2) if monitor.watches(step, steps=2)]
            [0, 2, 6, 8]
        """
        return -step % self.every_n_steps < max(steps, 1)

    def _due_now(self, step: int) -> bool:
        """Whether a batch beginning at optimizer step ``step`` reaches the step due, if it
        takes as many steps as the last batch that stepped."""
        return step + max(self._span, 1) - 1 >= self._due

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget()  # nothing of an earlier fit that stopped halfway
        self._first, self._span, self._due, self._watched = None, 1, 0, False
        self._layout.forget()  # the processes (maybe others than before) agree again
        self._rank = trainer.global_rank
        self._catcher = ModelIOCatcher(pl_module, None)
        self._blocks.clear()
        # the names are resolved (and checked) once, before the first step; the session
        # is opened on each watched batch and closed at its end: its hooks exist only then
        self._armed = self._catcher.from_spec(self.spec)
        _check_loss_scaling(trainer, self.spec)
        # one process per tensor-parallel group counts (each holds the whole values)
        counting = DataParallelLayout.of(trainer).counting
        self._counted = [rank for rank, counts in enumerate(counting) if counts]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._began = trainer.global_step
        if self._step >= 0 and step != self._step:
            self._finish(trainer, pl_module)  # a step left unfinished (an epoch's end)
        if self._first is None:
            self._first = step  # 0, or the step a checkpoint resumes at
        self._watched = False
        if not (self._due_now(step) or step == self._first) or self._armed is None:
            return
        self._watched = True
        # a layer swapped since the names were resolved (LoRA, quantization): resolved again
        if self._catcher is not None and not _same_modules(self._armed, pl_module):
            self._armed = self._catcher.from_spec(self.spec)
        rows = real_tokens(batch, "ActivationMonitor") if self.tokens else None
        self._batch_indices = [] if self.indices is None else [int(i) for i in self.indices(batch)]
        samples = len(self._batch_indices) if self.indices is not None else None
        self._transform = _Statistics(rows, self.histograms, samples, self._blocks)
        self._armed.take(transform=self._transform)  # a fresh buffer, with this transform
        self._armed.open()
        self._session = self._armed
        if self._step < 0:  # the step's first batch (not a later micro-batch of it)
            first = step == self._first and not self._due_now(step)
            self._named = step if first else max(step, self._due)  # the step due, or later
        self._step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if trainer.global_step > self._began:  # manual optimization: maybe several a batch
            self._span = trainer.global_step - self._began
            last = trainer.global_step - 1  # this batch's last optimizer step
            if self._watched and last >= self._due:  # the next multiple of N after it
                self._due = last - last % self.every_n_steps + self.every_n_steps
        if self._session is None:  # not watched, or finished before its optimizer step
            return
        self._fold()
        if trainer.global_step != self._step:  # the optimizer stepped: the step is whole
            self._finish(trainer, pl_module)

    def _fold(self) -> None:
        """Add the statistics of the batch just run (its forward and backward) to the step's."""
        session, self._session = self._session, None
        if session is None:
            return
        try:
            captured = session.take()
        finally:
            session.close()
        transform, self._transform = self._transform, None
        for key, held_vector in flatten_captures(captured).items():
            # a small tensor's place: its block is reduced now, all in one call
            vector = held_vector if transform is None else transform.vector(held_vector)
            if vector.numel() == 0:
                continue
            held = self._vectors.get(key)
            if held is not None and held.shape != vector.shape:  # the units' width changed
                held, vector = held[: self._head()], vector[: self._head()]  # no dead_frac
            self._vectors[key] = (
                vector if held is None else merge_statistics(torch.stack([held, vector]))
            )
        if transform is not None:
            self._order.update(transform.order)  # the first capture's place kept
            if self.indices is not None:
                self._samples.append((self._batch_indices, transform.bad_rows))
        self._batch_indices = []
        self._blocks.keep_used()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._transform is not None:
            self._transform.scale = self._loss_scale(trainer, loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._step >= 0 and self._scaled:  # after the scaler's unscale_, before its step
            self._overflows += _nonfinite_gradients(optimizer)
        if self._session is not None and pl_module.automatic_optimization:
            self._fold()  # the step's last batch: its backward has run, the update has not
            self._finish(trainer, pl_module)  # so a raise leaves the model as it was

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._step >= 0:
            self._finish(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._armed = None
        self._blocks.clear()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.discard_gradients()  # the exception is the news, not "no backward"
            session.close()
        self._forget()
        self._armed = None
        self._blocks.clear()

    def _loss_scale(self, trainer: pl.Trainer, loss: torch.Tensor) -> torch.Tensor | None:
        """The scale a GradScaler multiplied this backward's loss by, a copy on the device
        (no host sync; ``scaler.update()`` after the optimizer step changes it in place)."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        self._scaled = True
        return scaler.scale(torch.ones(1, dtype=torch.float64, device=loss.device))

    def _skipped(self) -> bool:
        """Whether the GradScaler skips an optimizer step of the watched step: it does when
        a gradient it steps on (any, watched or not) is not finite after its ``unscale_``."""
        overflows, self._overflows = self._overflows, []
        return bool(torch.stack([o.cpu() for o in overflows]).any()) if overflows else False

    def _head(self) -> int:
        """The length of a statistics vector before its per-unit part (with a histogram:
        its counts and the sum of ``|x|``)."""
        return HEAD + (len(EDGES) + 2 if self.histograms else 0)

    def _forget(self) -> None:
        """Drop a step's statistics not logged yet (a fit stopped in the middle of it)."""
        self._step, self._vectors, self._order, self._batch_indices = -1, {}, {}, []
        self._samples, self._named = [], -1
        self._scaled, self._overflows = False, []
        self._session, self._transform = None, None

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gather the step's statistics from every process (one collective, in the layout
        the processes agreed on), log them, and trace a non-finite value to its first place."""
        step, self._step, self._named = self._named, -1, -1
        vectors, self._vectors = self._vectors, {}
        order, self._order = list(self._order), {}
        samples, self._samples = self._samples, []
        scaled, self._scaled = self._scaled, False
        skipped = scaled and self._skipped()
        strategy = trainer.strategy
        several = trainer.world_size > 1
        if scaled and several:  # a process sees only its gradients (FSDP shards them):
            skipped = strategy.reduce_boolean_decision(skipped, all=False)  # as the scaler
        if several:  # one collective, in the layout the processes agreed on
            if self._layout.widths is None:
                self._layout.agree(strategy, vectors)
            figures, parts = self._layout.gathered_figures(
                strategy, vectors, self._counted, self.histograms
            )
        else:  # alone: nothing to agree on or merge, one transfer off the device
            figures, parts = alone_figures(strategy.root_device, vectors, self.histograms)
        if not figures:
            return
        logged = {
            f"{self.prefix}/{key}/{name}": value
            for key, found in figures.items()
            for name, value in found.scalars().items()
        }
        bad = [key for key, found in figures.items() if found.nan or found.inf]
        overflow = skipped and all("/grad_" in key for key in bad)  # not traced: normal
        if scaled:  # the GradScaler skipped this step's update (any gradient overflowed)
            logged[f"{self.prefix}/grad_overflow"] = float(skipped)
        for logger in trainer.loggers:  # at the watched step only, in float64 (pl_module.log
            logger.log_metrics(logged, step=step)  # would repeat it until the epoch ends)
        # for EarlyStopping and ModelCheckpoint: one tensor a figure, made at once
        values = torch.tensor(list(logged.values()), dtype=torch.float64).unbind()
        trainer.callback_metrics.update(zip(logged, values, strict=True))
        self.last_values = logged
        self.history.append((step, logged))
        del self.history[: -self.history_size]
        if self.histograms:
            log_histograms(trainer, self.prefix, figures, step)
        if bad and not overflow:
            self._trace_nonfinite(step, figures, bad, order, samples, parts)

    def _trace_nonfinite(
        self,
        step: int,
        figures: dict[str, HealthFigures],
        bad: list[str],
        order: list[str],
        samples: list[tuple[list[int], dict[str, torch.Tensor | None]]],
        parts: dict[str, torch.Tensor],
    ) -> None:
        forward = [prefix for prefix in order if "/grad_" not in prefix]
        backward = [prefix for prefix in order if "/grad_" in prefix]  # as they arrived
        where, first = next(
            (
                (prefix, key)
                for prefix in [*forward, *backward]
                for key in bad
                if key == prefix or key.startswith(prefix + "/")
            ),
            (None, bad[0]),
        )
        per_rank = parts[first][:, 6:8].sum(1)  # NaN and inf of each process
        ranks = [self._counted[row] for row, count in enumerate(per_rank.tolist()) if count]
        found = figures[first]
        message = (
            f"ActivationMonitor: at step {step}, the first non-finite value of the watched "
            f"forward and backward is in {first!r} ({found.nan} NaN, {found.inf} inf; "
            f"process {', '.join(map(str, ranks))})"
        )
        mine = _offending(samples, where) if self._rank in ranks else []
        self.nonfinite.append({"step": step, "key": first, "ranks": ranks, "indices": mine or None})
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message)
        rank_zero_warn(message)


def _positive_int(value: Any) -> bool:
    """Whether ``value`` is a positive ``int`` (not a ``bool``, which ``int`` admits)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _nonfinite_gradients(optimizer: Any) -> list[torch.Tensor]:
    """Whether a gradient of ``optimizer``'s parameters is not finite: a bool on the device
    (no host sync), none without gradients."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    found = [torch.isfinite(g).all() for g in grads if g is not None]
    if not found:
        return []
    return [~torch.stack([f.to(found[0].device) for f in found]).all()]


def _offending(
    samples: list[tuple[list[int], dict[str, torch.Tensor | None]]], where: str | None
) -> list[int]:
    """The dataset indices of the samples whose rows of ``where`` (a key's prefix) were not
    finite; a batch's every index where its rows cannot be told apart (or none did)."""
    found: list[int] = []
    for indices, bad_rows in samples:
        if where is None or where not in bad_rows:
            continue  # not captured in this batch
        flags = bad_rows[where]
        rows = [True] * len(indices) if flags is None else flags.tolist()
        found += [index for index, bad in zip(indices, rows, strict=True) if bad]
    return found or [index for indices, _ in samples for index in indices]


def _check_loss_scaling(trainer: pl.Trainer, spec: CaptureSpec) -> None:
    """Refuse gradients under a precision plugin that scales the loss without a GradScaler
    (DeepSpeed's float16): their figures would be those of the scaled loss."""
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    plugin = trainer.precision_plugin
    scaled = isinstance(plugin, DeepSpeedPrecision) and str(plugin.precision).startswith("16")
    if spec.has_gradients and scaled:
        raise ValueError(
            f"ActivationMonitor: DeepSpeed with precision={plugin.precision!r} scales the "
            "loss inside its engine, without a GradScaler the monitor can read, so the "
            "watched gradients would be those of the scaled loss: watch outputs or inputs "
            "only, or train in 'bf16-mixed' or '32-true'"
        )


def _same_modules(session: CaptureSession, root: torch.nn.Module) -> bool:
    """Whether each module ``session`` hooks is still the one at its name in ``root``."""
    for name, module in session.modules.items():
        try:
            if root.get_submodule(name) is not module:
                return False
        except AttributeError:  # the name is gone
            return False
    return True
