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
summed as they come and a sampler's repeats are counted: a warning says so.

The forwards run apart from other sessions open on the model (an ``IOCaptureCallback``'s):
they neither capture nor edit them. Edits that need the batch's dataset indices (a
:class:`~lightning_iocatch.capture.store_patch.StorePatch`) get them.

Examples:
    >>> from lightning_iocatch.capture import Zero
    >>> effects = InterventionEffects({"zero": [Zero("model.transformer.h.6")]})
    >>> sorted(effects.names())
    ['effects/clean/loss', 'effects/zero/kl', 'effects/zero/loss']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.store_patch import refuse_left_padding
from lightning_iocatch.capture.variants import CLEAN, Variants
from lightning_iocatch.lightning.batch_indices import BatchIndexer, missing_indices_reason

__all__ = ["InterventionEffects", "kl_per_sample", "next_token_loss"]

_CHUNK = 256  # positions turned into float64 [positions, vocab] at once
_KEYS = 3  # the key columns of a sample's row: dataloader, rank (-1: index known), index
LossFn = Callable[[torch.Tensor, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def next_token_loss(logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum of next-token cross-entropies (float64) and their number.

    A batch with ``labels`` (a mapping): as Hugging Face's causal LM loss, position ``t``
    predicts ``labels[t + 1]``, where it is not -100. Else ``batch["input_ids"]`` (or a batch
    that is a ``[batch, seq]`` tensor of token ids): position ``t`` predicts token ``t + 1``,
    counted where ``batch["attention_mask"]`` (if any) is 1 at both. For a batch ``(x, y)``
    with ``logits`` of ``[batch, classes]``: the cross-entropy of ``y``, one term per sample.
    Logits of other positions than the tokens' (a prefix of soft prompts) are refused.
    """
    tokens = isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point()
    if (tokens or (isinstance(batch, Mapping) and "input_ids" in batch)) and logits.dim() == 3:
        ids = batch if tokens else batch["input_ids"]
        mask = None if tokens else batch.get("attention_mask")
        labels = None if tokens else batch.get("labels")
        if labels is not None:
            ids, mask = labels, None
        if logits.shape[:2] != ids.shape[:2]:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for tokens of shape "
                f"{tuple(ids.shape)}: the default loss needs one position per token; give "
                "`output=` returning the tokens' logits, or `loss=` your own"
            )
        keep = torch.ones_like(ids[:, 1:], dtype=torch.bool)
        if labels is not None:
            keep = ids[:, 1:] != -100
        elif mask is not None:
            keep = keep & mask[:, 1:].bool() & mask[:, :-1].bool()
        sums = torch.zeros(len(ids), dtype=torch.float64, device=logits.device)
        for row in range(len(ids)):  # one sample at a time, [positions, vocab] in float64
            for start in range(0, ids.shape[1] - 1, _CHUNK):
                end = min(start + _CHUNK, ids.shape[1] - 1)
                terms = torch.nn.functional.cross_entropy(
                    logits[row, start:end].double(),
                    ids[row, start + 1 : end + 1],
                    reduction="none",
                    ignore_index=-100,
                )
                sums[row] += terms[keep[row, start:end]].sum()
        return sums, keep.sum(1).double()
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and logits.dim() == 2:
        terms = torch.nn.functional.cross_entropy(logits.double(), batch[1], reduction="none")
        return terms, torch.ones_like(terms)
    raise ValueError(
        f"no default loss for outputs of shape {tuple(logits.shape)} and a batch of type "
        f"{type(batch).__name__}: the default is next-token cross-entropy for a batch with "
        "`input_ids` (a mapping) or cross-entropy for a batch `(x, y)`; give "
        "`loss=lambda logits, batch: ...` returning per-sample losses (or per-sample sums "
        "and counts)"
    )


def kl_per_sample(
    clean: torch.Tensor, variant: torch.Tensor, batch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum over positions of KL(clean || variant) of the softmax over the
    last dimension (float64; a class the clean logits rule out, -inf, adds nothing), and the
    number of positions (``attention_mask``'s ones)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is not None and clean.dim() == 3 and clean.shape[:2] != mask.shape[:2]:
        raise ValueError(
            f"logits of shape {tuple(clean.shape)} for an attention_mask of shape "
            f"{tuple(mask.shape)}: KL is taken at the mask's positions; give `output=` "
            "returning one position per token"
        )
    if mask is not None and clean.dim() != 3:
        mask = None  # one distribution per sample: no positions to mask
    sums = torch.zeros(len(clean), dtype=torch.float64, device=clean.device)
    for row in range(len(clean)):
        p_row, q_row = (
            clean[row].reshape(-1, clean.shape[-1]),
            variant[row].reshape(-1, clean.shape[-1]),
        )
        keep = mask[row].bool() if mask is not None else torch.ones(len(p_row), dtype=torch.bool)
        for start in range(0, len(p_row), _CHUNK):  # [positions, vocab] in float64, in parts
            p = torch.log_softmax(p_row[start : start + _CHUNK].double(), -1)
            q = torch.log_softmax(q_row[start : start + _CHUNK].double(), -1)
            kl = torch.where(torch.isneginf(p), 0.0, p.exp() * (p - q)).sum(-1)  # 0 log 0 = 0
            sums[row] += kl[keep[start : start + _CHUNK].to(kl.device)].sum()
    if mask is not None:
        return sums, mask.sum(1).double()
    return sums, torch.full_like(sums, float(clean[0].numel() // clean.shape[-1]))


def default_forward(module: pl.LightningModule, batch: Any) -> Any:
    """``module(**batch)`` for a mapping, ``module(batch[0])`` for ``(x, y)``, else
    ``module(batch)``."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    return module(batch)


def default_output(output: Any) -> torch.Tensor:
    """An output's ``logits`` attribute, the output itself if a tensor, or its first value."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the forward returned a {type(output).__name__}: give `output=`")
    return output


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
        self.share, self.prefix = share, prefix
        self.last_values: dict[str, float] = {}
        self._runner: Variants | None = None
        self._indexer: BatchIndexer | None = None
        self._rows: list[torch.Tensor] = []
        self._counter = 0
        self._stage = "validate"

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
        self._log(trainer, pl_module)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            self._indexer = None
            return
        if self._runner is None or self._runner.catcher.model is not pl_module:
            catcher = ModelIOCatcher(pl_module, None)
            self._runner = Variants(catcher, self.variants, share=self.share)
        self._indexer = BatchIndexer(stage)
        self._stage = stage
        self._rows, self._counter = [], 0
        reason = missing_indices_reason(trainer, stage)
        if reason is not None and trainer.world_size > 1:
            rank_zero_warn(
                f"InterventionEffects: {reason}; its samples are summed as they come, and any "
                "sample the sampler repeats across processes is counted again"
            )

    def _batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int,
    ) -> None:  # fmt: skip
        if self._indexer is None or self._runner is None:
            return  # the sanity check: nothing is logged for it
        indices = self._indexer(trainer, batch_idx, dataloader_idx)
        repeated = self._indexer.repeated(batch_idx, dataloader_idx)
        refuse_left_padding([e for edits in self.variants.values() for e in edits], batch)
        precision = trainer.strategy.precision_plugin  # autocast, as around the step itself
        context = (
            precision.val_step_context if self._stage == "validate" else precision.test_step_context
        )
        with context():
            outputs = self._runner(lambda: self.forward(pl_module, batch), indices)
        logits = {name: self.output(value) for name, value in outputs.items()}
        columns = [*self._terms(logits[CLEAN], batch)]
        for name in self.variants:
            columns += [*self._terms(logits[name], batch)]
            columns += [*kl_per_sample(logits[CLEAN], logits[name], batch)]
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
        self._rows.append(rows)

    def _terms(self, logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        value = self.loss(logits, batch)
        if isinstance(value, tuple):
            return value[0].double(), value[1].double()
        return value.double(), torch.ones_like(value, dtype=torch.float64)

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
            values = {f"{self.prefix}/{CLEAN}/loss{suffix}": _ratio(sums[0], sums[1])}
            for k, name in enumerate(self.variants):
                at = 2 + 4 * k
                values[f"{self.prefix}/{name}/loss{suffix}"] = _ratio(sums[at], sums[at + 1])
                values[f"{self.prefix}/{name}/kl{suffix}"] = _ratio(sums[at + 2], sums[at + 3])
            for name, baseline in self.recovered.items():
                base = values[f"{self.prefix}/{baseline}/loss{suffix}"]
                spliced = values[f"{self.prefix}/{name}/loss{suffix}"]
                clean = values[f"{self.prefix}/{CLEAN}/loss{suffix}"]
                values[f"{self.prefix}/{name}/loss_recovered{suffix}"] = _ratio(
                    base - spliced, base - clean
                )
            for key, value in values.items():
                self.last_values[key] = value
                logged = torch.tensor(value, dtype=torch.float64, device=pl_module.device)
                pl_module.log(key, logged, add_dataloader_idx=False, sync_dist=False)
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


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN where the denominator is 0 (no terms, or a baseline
    whose loss is the clean loss)."""
    return numerator / denominator if denominator else math.nan


def _gathered(trainer: pl.Trainer, rows: torch.Tensor) -> torch.Tensor:
    """Every process's rows (each process gets all), through Lightning's strategy."""
    if trainer.world_size == 1:
        return rows
    strategy = trainer.strategy
    sizes = strategy.all_gather(torch.tensor([len(rows)], device=strategy.root_device))
    most = int(sizes.max())
    padded = torch.zeros(most, rows.shape[1], dtype=torch.float64)
    padded[: len(rows)] = rows
    every = strategy.all_gather(padded.to(strategy.root_device)).cpu()
    return torch.cat([every[r, : int(n)] for r, n in enumerate(sizes.reshape(-1).tolist())])


def _sum_in_order(rows: torch.Tensor) -> list[float]:
    """Column sums added row by row in the rows' order (the order decides the last bits)."""
    if not len(rows):
        return [float("nan")] * rows.shape[1]
    return torch.cumsum(rows, 0)[-1].tolist()  # sequential: row 0, then row 1, ...
