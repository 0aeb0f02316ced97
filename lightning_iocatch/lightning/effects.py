"""InterventionEffects: what each variant's edits do to the model, as validation metrics.

On every batch of ``trainer.validate``, ``trainer.test`` and the validation loop of ``fit``,
the callback runs the batch's forward clean and under each named variant's edits
(:class:`~lightning_iocatch.capture.variants.Variants`: the variants share the computation
before their first edit), and at the end of the epoch logs, per variant ``v``:

- ``{prefix}/clean/loss`` and ``{prefix}/{v}/loss``: the loss (default: next-token cross
  entropy, see :func:`next_token_loss`), a mean over the loss's terms (tokens) of the epoch;
- ``{prefix}/{v}/kl``: KL(clean || variant) of the output distributions (softmax over the
  last dimension), a mean over positions (tokens where the batch has an ``attention_mask``);
- ``{prefix}/{v}/loss_recovered`` for each ``v`` of ``recovered={v: baseline}``:
  ``(loss_baseline - loss_v) / (loss_baseline - loss_clean)``, e.g. a sparse autoencoder's
  splice against zero ablation ("CE loss recovered").

Each sample's sums are computed in float64, kept with its dataset index, and at the end of
the epoch gathered from every process, the samples Lightning's ``DistributedSampler``
repeated to even out the ranks dropped, and summed in dataset-index order: a run on any
number of processes logs the values of a 1-process run (also when the data does not divide
evenly). Where a dataloader gives no dataset indices (see
:func:`~lightning_iocatch.lightning.batch_indices.missing_indices_reason`), samples are
summed as they come, the repeats of Lightning's ``DistributedSampler`` (shuffling or not)
still dropped by their places; another sampler's repeats are counted: a warning says so.

The clean forward is the validation step's own where the step calls the model as
``forward`` does (an argument without value equality: the very object), in the context
``forward``'s calls start in (recorded from the batch's start and replayed, checked call
by call: :meth:`~lightning_iocatch.capture.variants.Variants.record`); else the callback
says so once and runs its own. The forwards run in the loop's precision and
inference mode, each on its own copy of the batch as the loader gave it, and apart from
other sessions open on the model (an ``IOCaptureCallback``'s): they neither capture nor
edit them. Edits that need the batch's dataset indices (a
:class:`~lightning_iocatch.capture.store_patch.StorePatch`) get them.

Examples:
    >>> from lightning_iocatch.capture import Zero
    >>> effects = InterventionEffects({"zero": [Zero("model.transformer.h.6")]})
    >>> sorted(effects.names())
    ['effects/clean/loss', 'effects/zero/kl', 'effects/zero/loss']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.replay import Recorder
from lightning_iocatch.capture.snapshots import map_tensors
from lightning_iocatch.capture.store_patch import refuse_left_padding
from lightning_iocatch.capture.variants import CLEAN, Variants
from lightning_iocatch.lightning.batch_indices import BatchIndexer, missing_indices_reason
from lightning_iocatch.lightning.effect_terms import (
    LossFn,
    call_forward,
    default_forward,
    default_output,
    effect_columns,
    kl_per_sample,
    next_token_loss,
    ratio,
)
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout
from lightning_iocatch.probes.base import _gather_tensors

__all__ = ["InterventionEffects", "kl_per_sample", "next_token_loss"]

_KEYS = 3  # the key columns of a sample's row: dataloader, rank (-1: index known), index


class InterventionEffects(pl.Callback):
    """Logs the effect of each variant's edits on every validation and test batch.

    Args:
        variants: name -> edits (:mod:`~lightning_iocatch.capture.edits`; module names as
            seen from the LightningModule, e.g. ``"model.transformer.h.6"``).
        recovered: variant -> baseline variant, for ``loss_recovered``.
        loss: ``loss(logits, batch)`` -> per-sample losses, or per-sample ``(sums,
            counts)``; default :func:`next_token_loss`.
        forward: ``forward(pl_module, batch)`` runs the model; default: ``pl_module(**batch)``
            for a mapping, ``pl_module(x)`` for ``(x, y)``.
        output: the logits of what ``forward`` returns; default: its ``.logits``, or itself.
        share: share the computation before each variant's edit point (see
            :mod:`~lightning_iocatch.capture.variants` for when that is exact).
        reuse: reuse the validation step's own forward as the clean one, where the step
            calls the model as ``forward`` does, in the same context (checked call by call,
            when each starts; else said once, and the clean forward runs apart).
        prefix: of the logged names.
    """

    def __init__(
        self,
        variants: Mapping[str, Sequence[Edit]],
        *,
        recovered: Mapping[str, str] | None = None,
        loss: LossFn | None = None,
        forward: Callable[[pl.LightningModule, Any], Any] | None = None,
        output: Callable[[Any], torch.Tensor] | None = None,
        share: bool = True,
        reuse: bool = True,
        prefix: str = "effects",
    ) -> None:
        if not variants or CLEAN in variants:
            raise ValueError(f"`variants` must name at least one variant, not {CLEAN!r}")
        recovered = dict(recovered or {})
        for variant, baseline in recovered.items():
            if variant not in variants or baseline not in variants:
                raise ValueError(
                    f"`recovered` maps {variant!r} to {baseline!r}: both must be variants "
                    f"({sorted(variants)})"
                )
        self.variants = {name: list(edits) for name, edits in variants.items()}
        self.recovered = recovered
        self.loss = loss or next_token_loss
        self.forward = forward or default_forward
        self.output = output or default_output
        self.share, self.reuse, self.prefix = share, reuse, prefix
        self.last_values: dict[str, float] = {}
        self._runner: Variants | None = None
        self._indexer: BatchIndexer | None = None
        self._rows: list[torch.Tensor] = []
        self._counts = True  # this process counts its samples (see parallel_layout)
        self._counter = 0
        self._stage = "validate"
        self._given: Any = None
        self._reuse = reuse
        self._recording: Recorder | None = None

    def names(self, suffix: str = "") -> list[str]:
        """The names logged each epoch (``suffix``: the dataloader's, with several)."""
        found = [f"{self.prefix}/{CLEAN}/loss{suffix}"]
        for name in self.variants:
            found += [f"{self.prefix}/{name}/loss{suffix}", f"{self.prefix}/{name}/kl{suffix}"]
            if name in self.recovered:
                found.append(f"{self.prefix}/{name}/loss_recovered{suffix}")
        return found

    # the loops
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, "validate")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, "test")

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_start(trainer, batch)

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch_start(trainer, batch)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._batch(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_recording()
        self._log(trainer, pl_module)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_recording()
        self._log(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._drop_recording()  # no hook outlives a failure

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            self._indexer = None
            return
        if self._runner is None or self._runner.catcher.model is not pl_module:
            catcher = ModelIOCatcher(pl_module, None)
            self._runner = Variants(catcher, self.variants, share=self.share, say=rank_zero_warn)
        self._indexer = BatchIndexer(stage)
        self._stage = stage
        self._rows, self._counter = [], 0
        self._counts = DataParallelLayout.of(trainer).counts  # one per tensor-parallel group
        self._reuse = self.reuse
        reason = missing_indices_reason(trainer, stage)
        if reason is not None and trainer.world_size > 1:
            rank_zero_warn(
                f"InterventionEffects: {reason}; its samples are summed as they come, and a "
                "sample the sampler repeats across processes is counted again unless it is "
                "Lightning's DistributedSampler (whose repeats are told by their places)"
            )

    def _batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        """The batch as the loader gave it, before the step (which may write into it), and
        the step's forward recorded, to be reused as the clean one."""
        if self._indexer is None or self._runner is None:
            return
        self._given = map_tensors(batch, torch.clone)
        self._drop_recording()
        if self._reuse:
            self._recording = self._runner.record()

    def _drop_recording(self) -> None:
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.remove()

    def _batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int,
    ) -> None:  # fmt: skip
        if self._indexer is None or self._runner is None:
            return  # the sanity check: nothing is logged for it
        batch, self._given = (batch if self._given is None else self._given), None
        indices = self._indexer(trainer, batch_idx, dataloader_idx)
        repeated = self._indexer.repeated(batch_idx, dataloader_idx)
        refuse_left_padding([e for edits in self.variants.values() for e in edits], batch)
        precision = trainer.strategy.precision_plugin  # autocast, as around the step itself
        context = (
            precision.val_step_context if self._stage == "validate" else precision.test_step_context
        )
        recorded, self._recording = self._recording, None
        with context():  # and in the loop's grad mode (inference mode): as the step runs
            outputs = self._runner(lambda: self._forward(pl_module, batch), indices, recorded)
        if recorded is not None and not self._runner.reused:
            self._reuse = False  # said once: the step calls the model otherwise
        logits = {name: self.output(value) for name, value in outputs.items()}
        variants = [logits[name] for name in self.variants]
        columns = effect_columns(logits[CLEAN], variants, batch, self.loss)
        size = len(columns[0])
        if indices is None or len(indices) != size:  # unknown: as they come, rank by rank
            rank = float(trainer.global_rank)
            order = torch.arange(self._counter, self._counter + size, dtype=torch.float64)
        else:  # known: in dataset-index order, each sample once
            rank, order = -1.0, torch.tensor(indices, dtype=torch.float64)
        self._counter += size
        keys = [torch.full((size,), float(dataloader_idx)), torch.full((size,), rank), order]
        rows = torch.stack(
            [key.double() for key in keys]
            + [column.detach().to("cpu", torch.float64) for column in columns],
            dim=1,
        )
        if repeated is not None and len(repeated) == size:
            rows = rows[~torch.tensor(repeated, dtype=torch.bool)]
        if self._counts:  # else another process of this tensor-parallel group has them
            self._rows.append(rows)

    def _forward(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        """One forward, on its own copy of the batch (a model may write into its input)."""
        own = map_tensors(batch, torch.clone)
        return call_forward(self.forward, pl_module, own, "InterventionEffects")

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._indexer is None:
            return
        width = _KEYS + 2 + 4 * len(self.variants)
        mine = torch.cat(self._rows) if self._rows else torch.empty(0, width, dtype=torch.float64)
        rows = in_sample_order(_gathered(trainer, mine))
        loaders = sorted({int(x) for x in rows[:, 0].tolist()})
        counts = trainer.num_val_batches if self._stage == "validate" else trainer.num_test_batches
        several = len(counts) > 1  # the loop's dataloaders, whether or not each gave rows
        for loader in loaders:
            suffix = f"/dataloader_idx_{loader}" if several else ""
            sums = _sum_in_order(rows[rows[:, 0] == loader, _KEYS:])
            values = {f"{self.prefix}/{CLEAN}/loss{suffix}": ratio(sums[0], sums[1])}
            for k, name in enumerate(self.variants):
                at = 2 + 4 * k
                values[f"{self.prefix}/{name}/loss{suffix}"] = ratio(sums[at], sums[at + 1])
                values[f"{self.prefix}/{name}/kl{suffix}"] = ratio(sums[at + 2], sums[at + 3])
            for name, baseline in self.recovered.items():
                base = values[f"{self.prefix}/{baseline}/loss{suffix}"]
                spliced = values[f"{self.prefix}/{name}/loss{suffix}"]
                clean = values[f"{self.prefix}/{CLEAN}/loss{suffix}"]
                values[f"{self.prefix}/{name}/loss_recovered{suffix}"] = ratio(
                    base - spliced, base - clean
                )
            for key, value in values.items():
                self.last_values[key] = value
                logged = torch.tensor(value, dtype=torch.float64, device=pl_module.device)
                # the same on every process (gathered rows): synced, not reduced again
                pl_module.log(
                    key, logged, add_dataloader_idx=False, sync_dist=True, rank_zero_only=True
                )
        self._rows = []


def in_sample_order(rows: torch.Tensor) -> torch.Tensor:
    """Samples' rows ``[dataloader, rank, index, ...]`` sorted by those three, each sample
    of known index (rank -1) once; rows of unknown index (rank >= 0) are all kept.

    Examples:
        >>> rows = torch.tensor([[0, -1, 5, 1.0], [0, 1, 0, 2.0], [0, -1, 2, 3.0],
        ...                      [0, -1, 5, 1.0], [0, 0, 0, 4.0], [0, 0, 0, 5.0]])
        >>> in_sample_order(rows)[:, 1:].tolist()
        [[-1.0, 2.0, 3.0], [-1.0, 5.0, 1.0], [0.0, 0.0, 4.0], [0.0, 0.0, 5.0], [1.0, 0.0, 2.0]]
    """
    for column in (2, 1, 0):  # sorted by (dataloader, rank, index), stably
        rows = rows[torch.argsort(rows[:, column], stable=True)]
    again = torch.zeros(len(rows), dtype=torch.bool)
    again[1:] = (rows[1:, :_KEYS] == rows[:-1, :_KEYS]).all(1) & (rows[1:, 1] < 0)
    return rows[~again]


def _gathered(trainer: pl.Trainer, rows: torch.Tensor) -> torch.Tensor:
    """Every process's rows (each process gets all), through Lightning's strategy."""
    if trainer.world_size == 1:
        return rows
    strategy = trainer.strategy
    sizes = _gather_tensors(torch.tensor([len(rows)], device=strategy.root_device))
    most = int(sizes.max())
    padded = torch.zeros(most, rows.shape[1], dtype=torch.float64)
    padded[: len(rows)] = rows
    every = _gather_tensors(padded.to(strategy.root_device)).cpu()
    return torch.cat([every[r, : int(n)] for r, n in enumerate(sizes.reshape(-1).tolist())])


def _sum_in_order(rows: torch.Tensor) -> list[float]:
    """Column sums added row by row in the rows' order (the order decides the last bits)."""
    if not len(rows):
        return [float("nan")] * rows.shape[1]
    return torch.cumsum(rows, 0)[-1].tolist()  # sequential: row 0, then row 1, ...
