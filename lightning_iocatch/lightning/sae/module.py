"""SAEModule: a sparse autoencoder trained with ``Trainer.fit``, on any strategy.

Each step follows SAELens 6's trainer: the losses of the (normalised) batch, the
latents that fired counted, then backward, gradients clipped at ``clip_grad_norm``, an
Adam step and the learning-rate schedule's step. Under several processes everything
that SAELens counts in its one process is counted over the whole batch: the rows, the
latents that fired on any process (a latent is dead after ``dead_after_tokens`` rows of
the global stream without firing), the input norms of the normalisation, BatchTopK's
selection and its threshold, and the means of the losses; so two processes end with the
weights of one process that saw both their rows. All of it lives in the module's
buffers, so a checkpoint resumes it exactly.

Examples:
    >>> module = SAEModule(16, 64, "topk", k=4, key="h")
    >>> module.sae
    SparseAutoencoder(16 -> 64, topk, k=4)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_iocatch.lightning.batch_indices import (
    BatchIndexer,
    item_repeated,
    lightning_logs_now,
)
from lightning_iocatch.lightning.sae.counting import count_fired, estimate_scale, update_threshold
from lightning_iocatch.lightning.sae.evaluation import (
    LanguageModelHooks,
    checked_layer,
    layer_rows,
    log_density,
)
from lightning_iocatch.lightning.sae.schedule import Schedule, lr_factor, sparsity_factor
from lightning_iocatch.lightning.sae.statistics import (
    batch_rows,
    reconstruction_figures,
    reconstruction_sums,
)
from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.probes.units import UnitActivations
from lightning_iocatch.sae.activations import Across
from lightning_iocatch.sae.losses import TrainingObjective, TrainingStep
from lightning_iocatch.sae.model import Architecture, SparseAutoencoder

__all__ = ["SAEModule"]


class SAEModule(LanguageModelHooks):
    """Trains a :class:`~lightning_iocatch.sae.SparseAutoencoder` on batches of rows.

    A batch is a ``(rows, d_in)`` tensor, a dict holding one under ``key`` (what
    :class:`~lightning_iocatch.StoreDataModule` yields), or a tuple whose first item is
    one. Uses manual optimization (the step order above); give no ``gradient_clip_val``
    to the Trainer, ``clip_grad_norm`` here instead. Logs ``train/mse``,
    ``train/normalized_mse``, ``train/explained_variance``, ``train/l0``,
    ``train/dead_fraction``, each loss and the learning rate every
    ``Trainer(log_every_n_steps=...)`` steps, and in validation the same figures over
    the whole validation set (``val/...``).

    Args:
        d_in: the rows' width.
        d_sae: number of latents.
        architecture: ``"topk"``, ``"batchtopk"``, ``"jumprelu"`` or ``"relu"`` (L1).
        k: latents per row (``topk``; the average for ``batchtopk``).
        key: the batch's key holding the rows (a dict batch of one tensor needs none).
        sae: start from this SAE (e.g. :func:`~lightning_iocatch.sae.load_saelens`'s)
            instead of a new one; ``d_in``, ``d_sae``, ``architecture`` and ``k`` are
            then taken from it.
        lr: Adam's learning rate (SAELens: 3e-4).
        betas: Adam's betas (SAELens: (0.9, 0.999)).
        lr_warmup_steps: steps of linear warmup (see
            :mod:`~lightning_iocatch.lightning.sae.schedule`).
        lr_decay_steps: last steps of linear decay to 0.
        lr_end: the cosine's end and the decay's start (default ``lr / 10``).
        lr_schedule: ``"constant"`` or ``"cosine"`` between warmup and decay.
        total_steps: the schedule's length (default: the Trainer's ``max_steps``).
        clip_grad_norm: the gradients' norm is clipped to this (``None``: not clipped).
        sparsity_coefficient: the L1 (``relu``) or L0 (``jumprelu``) coefficient.
        sparsity_warmup_steps: steps over which it rises from 0.
        aux_k_coefficient: the auxiliary-k loss's coefficient (``topk``, ``batchtopk``).
        dead_after_tokens: a latent that fired on none of this many rows (of the whole
            stream, every process's) is dead (SAELens: 1000 steps of 4096 tokens).
        normalize_batches: estimate the input normalisation (``sqrt(d_in)`` over the
            mean row norm) from this many first batches, which train nothing (as
            SAELens); 0: no normalisation. It is folded into the weights on export.
        topk_threshold_lr: the weight of each batch in BatchTopK's running threshold.
        decoder_init_norm: the SAE's (:class:`~lightning_iocatch.sae.SparseAutoencoder`).
        jumprelu_init_threshold: the SAE's.
        bandwidth: the SAE's.
        scale_by_decoder_norm: the SAE's.
        saelens_arithmetic: train with SAELens' own products, bit for bit; by default
            the same step with fewer operations (TopK's and BatchTopK's decodes from
            their non-zero latents, ``b_dec``'s gradient as a vector product), equal to
            float rounding (:func:`~lightning_iocatch.sae.training_losses`).
        seed: the seed of the initial weights.
        language_model: the model the activations came from: validation batches are then
            its text (a tokenizer's dict), the rows its real tokens' outputs at ``layer``,
            and an :class:`~lightning_iocatch.InterventionEffects` logs the SAE spliced in
            against zero ablation (``sae/sae/loss_recovered``, ``sae/sae/kl``...). It is
            frozen, runs only in validation, and is left out of checkpoints.
        layer: the module of ``language_model`` whose output the rows are
            (``"model.layers.6"``).

    Validation also logs ``val/dead_fraction`` and ``val/density_median`` of the latents
    over the validation set, their density histogram to loggers that take histograms,
    and keeps the epoch's :class:`~lightning_iocatch.probes.UnitSummary` as
    ``unit_summary``.
    """

    tokens_since_fired: Tensor
    norm_sum: Tensor
    norm_rows: Tensor
    norm_batches: Tensor
    steps: Tensor

    def __init__(
        self,
        d_in: int | None = None,
        d_sae: int | None = None,
        architecture: Architecture = "topk",
        k: float | None = None,
        *,
        key: str | None = None,
        sae: SparseAutoencoder | None = None,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_warmup_steps: int = 0,
        lr_decay_steps: int = 0,
        lr_end: float | None = None,
        lr_schedule: Schedule = "constant",
        total_steps: int | None = None,
        clip_grad_norm: float | None = 1.0,
        sparsity_coefficient: float = 1.0,
        sparsity_warmup_steps: int = 0,
        aux_k_coefficient: float = 1.0,
        dead_after_tokens: int = 1000 * 4096,
        normalize_batches: int = 0,
        topk_threshold_lr: float = 0.01,
        decoder_init_norm: float | None = 0.1,
        jumprelu_init_threshold: float = 0.01,
        bandwidth: float = 0.05,
        scale_by_decoder_norm: bool | None = None,
        saelens_arithmetic: bool = False,
        seed: int = 0,
        language_model: nn.Module | None = None,
        layer: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["sae", "language_model"])
        self.automatic_optimization = False
        if sae is None:
            if d_in is None or d_sae is None:
                raise ValueError("SAEModule needs `d_in` and `d_sae`, or an `sae` to train")
            sae = SparseAutoencoder(
                d_in,
                d_sae,
                architecture,
                k,
                scale_by_decoder_norm=scale_by_decoder_norm,
                decoder_init_norm=decoder_init_norm,
                jumprelu_init_threshold=jumprelu_init_threshold,
                bandwidth=bandwidth,
                generator=torch.Generator().manual_seed(seed),
            )
        elif not isinstance(sae, SparseAutoencoder):
            raise TypeError(f"`sae` must be a SparseAutoencoder, got {type(sae).__name__}")
        else:  # the SAE's own shape, so that load_from_checkpoint builds one like it
            self.hparams.update(d_in=sae.d_in, d_sae=sae.d_sae, architecture=sae.architecture,
                                k=sae.k, scale_by_decoder_norm=sae.scale_by_decoder_norm,
                                bandwidth=sae.bandwidth)  # fmt: skip
            if normalize_batches and float(sae.input_scale) != 1.0:
                raise ValueError(
                    f"SAEModule: this SAE already scales its inputs by {float(sae.input_scale):.6g}"
                    " (an imported one, folded into its weights): a new estimate would change "
                    "what it computes; give normalize_batches=0"
                )
        for name, value in (("normalize_batches", normalize_batches), ("lr_warmup_steps",
                            lr_warmup_steps), ("lr_decay_steps", lr_decay_steps),
                            ("sparsity_warmup_steps", sparsity_warmup_steps),
                            ("dead_after_tokens", dead_after_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"`lr_schedule` must be 'constant' or 'cosine', got {lr_schedule!r}")
        self.objective = TrainingObjective(sae, saelens_arithmetic)
        self.key = key
        self.lr, self.total_steps = float(lr), total_steps
        self.betas = (float(betas[0]), float(betas[1]))
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_end, self.lr_schedule = lr_end, lr_schedule
        self.clip_grad_norm = clip_grad_norm
        self.sparsity_coefficient, self.sparsity_warmup_steps = (
            sparsity_coefficient,
            sparsity_warmup_steps,
        )
        self.aux_k_coefficient, self.dead_after_tokens = aux_k_coefficient, dead_after_tokens
        self.normalize_batches, self.topk_threshold_lr = normalize_batches, topk_threshold_lr
        self.register_buffer("tokens_since_fired", torch.zeros(sae.d_sae, dtype=torch.int64))
        self.register_buffer("norm_sum", torch.zeros((), dtype=torch.float64))
        self.register_buffer("norm_rows", torch.zeros((), dtype=torch.int64))
        self.register_buffer("norm_batches", torch.zeros((), dtype=torch.int64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # optimizer steps
        self._steps = 0  # the same, read without a device sync
        self._norm_batches = 0  # norm_batches, the same way
        # in an SAEGroup: who logs, under which prefix, and this SAE's optimizer and schedule
        self._owner: pl.LightningModule | None = None
        self._prefix = ""
        self._assigned: tuple[Any, Any] | None = None
        self._val_sums: Tensor | None = None
        self._val_indexer = BatchIndexer("validate")
        self.latent_density = UnitActivations(k=0, name="latents")
        self.unit_summary: UnitSummary | None = None
        self.layer = checked_layer(language_model, layer)
        if language_model is not None:
            self.language_model = language_model.requires_grad_(False)

    @property
    def sae(self) -> SparseAutoencoder:
        """The SAE being trained."""
        return self.objective.sae

    # -- Lightning hooks ---------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        # Lightning leaves modules in the mode they are in: an SAE put in eval mode before
        # fit would train as in inference (a BatchTopK as a JumpReLU)
        self.objective.train()
        self._steps = int(self.steps)  # a resumed run's counts
        self._norm_batches = int(self.norm_batches)
        total = self._total_steps()
        planned = self.trainer.estimated_stepping_batches  # inf or -1 where unknown
        known = 0 < planned < float("inf")
        if (
            total is not None
            and self.lr_decay_steps
            and known
            and planned > total + self.normalize_batches
        ):
            rank_zero_warn(
                f"SAEModule: the learning rate decays to 0 at step {total} (`total_steps`), "
                f"and this fit runs about {planned} steps: the steps after it learn nothing"
            )

    @override
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._clip(optimizer)

    def _clip(self, optimizer: Any) -> None:
        """Gradients clipped to ``clip_grad_norm`` (called after AMP unscales them)."""
        if self.clip_grad_norm is not None:
            owner = self if self._owner is None else self._owner
            owner.clip_gradients(optimizer, gradient_clip_val=self.clip_grad_norm,
                                 gradient_clip_algorithm="norm")  # fmt: skip

    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is not None:  # ModelParallelStrategy: FSDP2 over its data-parallel ranks
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.objective, mesh=mesh["data_parallel"])

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.objective.parameters(), lr=self.lr, betas=self.betas)
        total = self._total_steps()
        end = self.lr / 10 if self.lr_end is None else self.lr_end
        ratio = 1.0 if self.lr_schedule == "constant" else end / self.lr  # SAELens' choice
        factor = lr_factor(warmup=self.lr_warmup_steps, decay=self.lr_decay_steps, total=total,
                           schedule=self.lr_schedule, end_ratio=ratio)  # fmt: skip
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _total_steps(self) -> int | None:
        if self.total_steps is None and self._trainer is not None and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return self.total_steps

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        x = self._rows(batch)
        world = self.trainer.world_size
        rows = x.shape[0] if world == 1 else int(self._whole(x.new_tensor(x.shape[0]).long()))
        if self._norm_batches < self.normalize_batches:
            estimate_scale(self, x)
            return None
        sae = self.sae
        if sae.architecture == "jumprelu":
            with torch.no_grad():
                sae.threshold.clamp_(min=0.0)
        dead = self.tokens_since_fired > self.dead_after_tokens
        step = self.objective(
            x,
            dead=dead,
            sparsity=self.sparsity_coefficient
            * sparsity_factor(self._steps, warmup=self.sparsity_warmup_steps),
            aux_k_coefficient=self.aux_k_coefficient,
            across=self._across(rows),
        )
        with torch.no_grad():
            count_fired(self, step.latents, rows)
            if sae.architecture == "batchtopk":
                update_threshold(self, step.latents)
        optimizer = self._optimizer()
        self.manual_backward(step.loss)
        optimizer.step()  # clips first (on_before_optimizer_step: after AMP's unscale)
        optimizer.zero_grad()
        self._schedule().step()
        self._steps += 1
        self.steps.fill_(self._steps)
        if lightning_logs_now(self.trainer):
            self._log_step(x, step, dead)
        return step.loss.detach()

    @override
    def on_validation_epoch_start(self) -> None:
        self._val_sums = None
        self.latent_density.reset()
        self._val_indexer = BatchIndexer("validate")

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        # the samples a DistributedSampler repeats to even out the processes count once
        if item_repeated(self.trainer, "validate", batch_idx, dataloader_idx):
            return  # a loader of whole batches: this one is another process's
        self._val_indexer(self.trainer, batch_idx, dataloader_idx)
        repeated = self._val_indexer.repeated(batch_idx, dataloader_idx)
        kept = None if repeated is None or not any(repeated) else [not r for r in repeated]
        if self.layer is None:
            x = batch_rows(batch, self.key, self.sae.d_in, kept)
        else:
            x = layer_rows(self, self.layer, batch, kept)
        step = self.objective(x)
        sums = reconstruction_sums(self.sae.scaled(x), step.reconstruction, step.latents)
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums
        self.latent_density.update(step.latents)

    @override
    def on_validation_epoch_end(self) -> None:
        sums = self._val_sums
        width = 4 + self.sae.d_in
        sums = torch.zeros(width, dtype=torch.float64, device=self.device) if sums is None else sums
        figures = reconstruction_figures(self._whole(sums))
        summary = self.latent_density.compute()
        self.unit_summary = summary
        scalars = summary.scalars()
        figures |= {
            "dead_fraction": scalars["dead_frac"],
            "density_median": scalars["density_median"],
        }
        self._log({f"val/{name}": value for name, value in figures.items()})
        log_density(self.trainer, f"{self._prefix}val/latent_density", summary, self._steps)

    # -- the step's parts --------------------------------------------------------------

    def _rows(self, batch: Any) -> Tensor:
        """The batch's rows, ``(rows, d_in)``."""
        return batch_rows(batch, self.key, self.sae.d_in)

    def _optimizer(self) -> Any:
        """This SAE's optimizer (Lightning's wrapper of the Adam of ``configure_optimizers``)."""
        return self.optimizers() if self._assigned is None else self._assigned[0]

    def _schedule(self) -> Any:
        return self.lr_schedulers() if self._assigned is None else self._assigned[1]

    def _log(self, values: dict[str, float]) -> None:
        owner = self if self._owner is None else self._owner
        owner.log_dict({f"{self._prefix}{name}": value for name, value in values.items()})

    def _whole(self, local: Tensor) -> Tensor:
        """``local`` summed over the processes (the strategy's own reduce)."""
        if self.trainer.world_size == 1:
            return local
        return self.trainer.strategy.reduce(local, reduce_op="sum")

    def _across(self, rows: int) -> Across | None:
        if self.trainer.world_size == 1:
            return None
        return Across(rows, self.global_rank, self.trainer.world_size, self._gather)

    def _gather(self, values: Tensor) -> Tensor:
        return self.trainer.strategy.all_gather(values)

    def _log_step(self, x: Tensor, step: TrainingStep, dead: Tensor) -> None:
        with torch.no_grad():
            sums = reconstruction_sums(self.sae.scaled(x), step.reconstruction, step.latents)
            figures = reconstruction_figures(self._whole(sums))
        figures["dead_fraction"] = float(dead.double().mean())
        losses = {name: float(self._whole(value.detach()) / self.trainer.world_size)
                  for name, value in step.losses.items()}  # fmt: skip
        lr = self._optimizer().param_groups[0]["lr"]
        logged = {f"train/{name}": value for name, value in {**figures, **losses}.items()}
        self._log({**logged, "train/lr": lr})
