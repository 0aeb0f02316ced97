"""AttributionPatching: which component causes a behaviour, over a whole validation set.

On every batch of ``trainer.validate``, ``trainer.test`` and the validation loop of ``fit``,
the callback splits the batch into a clean and a corrupted batch (``pair``; default: a
mapping batch whose ``corrupted_*`` fields replace the fields they name), runs
:func:`~lightning_iocatch.capture.attribution.attribution_patching` on them (one forward of
each, one backward of each run a convention needs) and adds every component's scores,
per position (and head), into float64 sums. The metric is the loss (default: next-token
cross entropy, :func:`~lightning_iocatch.lightning.effect_terms.next_token_loss`; or
``loss=``), and each estimate is of the change of the dataset's mean loss per term
(token): the sum over samples of the per-sample estimates, divided by the number of
terms of the run that is patched. At the end of the epoch it logs, for each convention
``c`` and component key ``k`` (``"{module}/{outputs|inputs}"``):

- ``{prefix}/{c}/{k}``: the estimate summed over positions (and heads);
- ``{prefix}/exact/{c}/{k}`` for each ``k`` of ``exact=``: the exact patching effect of
  the whole component (one more forward per batch each), to judge the estimate by;
- ``{prefix}/clean/loss`` and ``{prefix}/corrupted/loss``.

:attr:`AttributionPatching.scores` ``[c][k]`` holds the estimate per position (and head),
float64 ``[positions, ...]``, of the first dataloader, position ``t`` being the sequence's
``t``-th place (right padding keeps it the ``t``-th token; left padding is said once). Only the gradients of the batch in flight are held;
the state is ``components x positions x heads`` floats. Samples that Lightning's
``DistributedSampler`` repeats to even out the processes are left out, and the sums of
all processes are added at the end of the epoch, so a run on several processes gives the
1-process figures (to float64 rounding). The forwards run in the loop's precision, on
copies of the batch as the loader gave it, apart from other sessions open on the model.

Examples:
    >>> atp = AttributionPatching("outputs[model.transformer.h.*]", exact=["model.transformer.h.0/outputs"])
    >>> atp.conventions
    ('denoising', 'noising')
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_iocatch.capture.attribution import (
    CONVENTIONS,
    RUNS,
    Component,
    attribution_patching,
    components,
    patched_metric,
)
from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.snapshots import map_tensors
from lightning_iocatch.capture.spec import CaptureSpec
from lightning_iocatch.lightning.batch_indices import BatchIndexer
from lightning_iocatch.lightning.effect_terms import (
    LossFn,
    call_forward,
    default_forward,
    default_output,
    loss_terms,
    next_token_loss,
    ratio,
)
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout
from lightning_iocatch.probes.base import _gather_tensors

__all__ = ["AttributionPatching", "corrupted_fields"]

_WHICH = ("clean", "corrupted")


def corrupted_fields(batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The default pairing: ``(clean, corrupted)`` of a mapping batch whose
    ``corrupted_{name}`` fields replace ``{name}`` in the corrupted batch.

    Examples:
        >>> clean, corrupted = corrupted_fields(
        ...     {"input_ids": [1, 2], "attention_mask": [1, 1], "corrupted_input_ids": [1, 3]})
        >>> clean, corrupted
        ({'input_ids': [1, 2], 'attention_mask': [1, 1]}, {'input_ids': [1, 3], 'attention_mask': [1, 1]})
    """  # noqa: E501
    if not isinstance(batch, Mapping) or not any(str(k).startswith("corrupted_") for k in batch):
        raise ValueError(
            "AttributionPatching pairs a clean and a corrupted batch: by default a mapping "
            "batch with `corrupted_*` fields (e.g. `corrupted_input_ids`); got a "
            f"{type(batch).__name__} without them. Add them in the dataset, or give "
            "`pair=lambda batch: (clean, corrupted)`"
        )
    clean = {k: v for k, v in batch.items() if not str(k).startswith("corrupted_")}
    corrupted = {k: batch.get(f"corrupted_{k}", v) for k, v in clean.items()}
    unknown = [k for k in batch if str(k).startswith("corrupted_") and k[10:] not in clean]
    if unknown:
        raise ValueError(f"{unknown} name no field of the batch (fields: {sorted(clean)})")
    return clean, corrupted


class AttributionPatching(pl.Callback):
    """Logs the attribution patching estimate of every component, over the validation set.

    Args:
        components: the values to patch, as a capture spec of ``outputs[...]`` and
            ``inputs[...]`` (names as seen from the LightningModule, globs allowed).
        conventions: ``"denoising"`` and/or ``"noising"`` (see
            :mod:`~lightning_iocatch.capture.attribution` for the question each answers).
        pair: ``pair(batch) -> (clean, corrupted)``; default :func:`corrupted_fields`.
        loss: ``loss(logits, batch)`` -> per-sample losses, or per-sample ``(sums,
            counts)``; default :func:`~lightning_iocatch.lightning.effect_terms.next_token_loss`.
        forward: ``forward(pl_module, batch)`` runs the model; as ``InterventionEffects``'.
        output: the logits of what ``forward`` returns; as ``InterventionEffects``'.
        heads: module name or glob -> number of heads its value's last dimension holds.
        exact: component keys (``"{module}/outputs"``) whose exact patching effect is also
            computed and logged.
        prefix: of the logged names.
    """

    def __init__(
        self,
        components: str,
        *,
        conventions: str | Sequence[str] = CONVENTIONS,
        pair: Callable[[Any], tuple[Any, Any]] | None = None,
        loss: LossFn | None = None,
        forward: Callable[[pl.LightningModule, Any], Any] | None = None,
        output: Callable[[Any], torch.Tensor] | None = None,
        heads: Mapping[str, int] | None = None,
        exact: Sequence[str] = (),
        prefix: str = "atp",
    ) -> None:
        self.spec = CaptureSpec.parse(components)
        wanted = [conventions] if isinstance(conventions, str) else list(conventions)
        if not wanted or any(c not in CONVENTIONS for c in wanted):
            raise ValueError(f"`conventions` must be among {CONVENTIONS}, got {conventions!r}")
        self.conventions = tuple(dict.fromkeys(wanted))
        self.pair = pair or corrupted_fields
        self.loss = loss or next_token_loss
        self.forward = forward or default_forward
        self.output = output or default_output
        self.heads = dict(heads or {})
        self.exact = list(exact)
        self.prefix = prefix
        self.scores: dict[str, dict[str, torch.Tensor]] = {}
        self.last_values: dict[str, float] = {}
        self._components: list[Component] = []
        self._indexer: BatchIndexer | None = None
        self._stage = "validate"
        self._given: Any = None
        self._sums: dict[int, dict[str, torch.Tensor]] = {}  # dataloader -> name -> sums
        self._counts = True  # this process counts its samples (see parallel_layout)
        self._left_said = False

    def names(self) -> list[str]:
        """The scalar names logged each epoch (once the components are resolved)."""
        found = [f"{self.prefix}/clean/loss", f"{self.prefix}/corrupted/loss"]
        for convention in self.conventions:
            found += [f"{self.prefix}/{convention}/{c.key}" for c in self._components]
            found += [f"{self.prefix}/exact/{convention}/{key}" for key in self.exact]
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
        self._given = map_tensors(batch, torch.clone) if self._indexer else None

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._given = map_tensors(batch, torch.clone) if self._indexer else None

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
        self._components = components(pl_module, self.spec, self.heads)
        known = {c.key: c for c in self._components}
        unknown = [key for key in self.exact if key not in known]
        if unknown:
            raise ValueError(f"`exact` names {unknown}, not among the components {sorted(known)}")
        self._indexer, self._stage, self._sums = BatchIndexer(stage), stage, {}
        self._counts = DataParallelLayout.of(trainer).counts  # one per tensor-parallel group

    def _batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int,
    ) -> None:  # fmt: skip
        if self._indexer is None:
            return  # the sanity check: nothing is computed for it
        batch, self._given = (batch if self._given is None else self._given), None
        self._indexer(trainer, batch_idx, dataloader_idx)
        repeated = self._indexer.repeated(batch_idx, dataloader_idx)
        clean, corrupted = self.pair(batch)
        counts: dict[int, torch.Tensor] = {}

        precision = trainer.strategy.precision_plugin
        context = (
            precision.val_step_context if self._stage == "validate" else precision.test_step_context
        )

        def run(one: Any) -> torch.Tensor:
            own = map_tensors(one, torch.clone)  # made outside inference mode: saveable
            with context():  # the forward as the step runs it; the loss outside, in float64
                out = call_forward(
                    self.forward, pl_module, map_tensors(own, torch.clone), "AttributionPatching"
                )
                logits = self.output(out)
            sums, terms = loss_terms(self.loss(logits, own))
            counts[id(one)] = terms.detach().double()
            return sums

        found = attribution_patching(
            pl_module, self._components, run, clean, corrupted, self.conventions
        )
        exact = self._exact(pl_module, run, clean, corrupted, found.values, found.metric)
        size = len(found.metric["clean"])
        for scores in found.scores.values():
            for key, score in scores.items():
                if score.dim() == 0 or score.shape[0] != size:
                    raise ValueError(
                        f"{key} has a value of shape {tuple(found.values['clean'][key].shape)} "
                        f"for a batch of {size} samples: AtP scores a value whose first "
                        "dimension is the batch's ([batch, seq, d]); name another component"
                    )
        self._say_left_padding(clean)
        keep = _kept(repeated, size)
        sums = self._sums.setdefault(dataloader_idx, {})
        runs = {"clean": clean, "corrupted": corrupted}
        for which in runs:
            _add(sums, f"loss/{which}", found.metric[which].double()[keep].sum())
            _add(sums, f"terms/{which}", counts[id(runs[which])][keep].sum())
        for convention, scores in found.scores.items():
            for key, score in scores.items():
                _add(sums, f"{convention}/{key}", score.double()[keep].sum(0))
        for name, change in exact.items():
            _add(sums, name, change.double()[keep].sum())

    def _say_left_padding(self, batch: Any) -> None:
        """Once: with left padding, position ``t`` of the maps is not the ``t``-th token."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if self._left_said or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return
        if bool(((mask[:, 0] == 0) & mask.bool().any(1)).any()):
            self._left_said = True
            rank_zero_warn(
                "AttributionPatching: this batch is padded on the left, so position t of "
                "`scores` is the sequence's t-th place, not its t-th token (the totals are "
                "unchanged); pad on the right (tokenizer.padding_side = 'right') for maps "
                "by token"
            )

    def _exact(
        self,
        pl_module: pl.LightningModule,
        run: Callable[[Any], torch.Tensor],
        clean: Any,
        corrupted: Any,
        values: dict[str, dict[str, torch.Tensor]],
        metric: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Each exact component's patching effect per sample, for each convention."""
        if not self.exact:
            return {}
        catcher = ModelIOCatcher(pl_module, None)
        runs = {"clean": clean, "corrupted": corrupted}
        known = {c.key: c for c in self._components}
        changes = {}
        with catcher.coordinator.apart(catcher.root):
            for convention in self.conventions:
                base, source = RUNS[convention]
                for key in self.exact:
                    value = values[source][key]
                    patched = patched_metric(catcher, known[key], run, runs[base], value)
                    changes[f"exact/{convention}/{key}"] = patched - metric[base]
        return changes

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._indexer is None:
            return
        counts = trainer.num_val_batches if self._stage == "validate" else trainer.num_test_batches
        several = len(counts) > 1
        self.scores = {}
        for loader in range(len(counts)):
            mine = self._sums.get(loader, {})
            if not self._counts:  # another process of its tensor-parallel group counts them
                mine = {name: torch.zeros_like(value) for name, value in mine.items()}
            sums = _synced(trainer, mine, self._names())
            if sums is None:
                continue
            suffix = f"/dataloader_idx_{loader}" if several else ""
            self._log_loader(pl_module, sums, suffix, keep_scores=loader == 0)
        self._sums = {}

    def _names(self) -> list[str]:
        names = [f"{kind}/{which}" for kind in ("loss", "terms") for which in _WHICH]
        for convention in self.conventions:
            names += [f"{convention}/{c.key}" for c in self._components]
            names += [f"exact/{convention}/{key}" for key in self.exact]
        return names

    def _log_loader(
        self, pl_module: pl.LightningModule, sums: dict[str, torch.Tensor], suffix: str,
        keep_scores: bool,
    ) -> None:  # fmt: skip
        terms = {which: float(sums[f"terms/{which}"]) for which in _WHICH}
        values = {
            f"{self.prefix}/{w}/loss{suffix}": ratio(float(sums[f"loss/{w}"]), terms[w])
            for w in _WHICH
        }
        for convention in self.conventions:
            base_terms = terms[RUNS[convention][0]]
            if keep_scores:
                self.scores[convention] = {
                    c.key: sums[f"{convention}/{c.key}"] / base_terms for c in self._components
                }
            for c in self._components:
                total = float(sums[f"{convention}/{c.key}"].sum())
                values[f"{self.prefix}/{convention}/{c.key}{suffix}"] = ratio(total, base_terms)
            for key in self.exact:
                name = f"{self.prefix}/exact/{convention}/{key}{suffix}"
                values[name] = ratio(float(sums[f"exact/{convention}/{key}"]), base_terms)
        for name, value in values.items():
            self.last_values[name] = value
            logged = torch.tensor(value, dtype=torch.float64, device=pl_module.device)
            # the same on every process (synced sums): synced, not reduced again
            pl_module.log(
                name, logged, add_dataloader_idx=False, sync_dist=True, rank_zero_only=True
            )


def _kept(repeated: Sequence[bool] | None, size: int) -> torch.Tensor:
    """The samples to count: all but those the sampler repeated to even out processes."""
    if repeated is None or len(repeated) != size:
        return torch.ones(size, dtype=torch.bool)
    return ~torch.tensor(repeated, dtype=torch.bool)


def _add(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    """Add ``value`` (float64, on the CPU) into ``sums[name]``, growing its first
    dimension (positions) as longer sequences come."""
    value = value.detach().to("cpu", torch.float64)
    held = sums.get(name)
    if held is None:
        sums[name] = value.clone()
        return
    if value.dim() and value.shape[0] > held.shape[0]:
        held = torch.cat([held, held.new_zeros(value.shape[0] - held.shape[0], *held.shape[1:])])
    if value.dim():
        held[: value.shape[0]] += value
    else:
        held += value
    sums[name] = held


def _synced(
    trainer: pl.Trainer, sums: dict[str, torch.Tensor], names: Sequence[str]
) -> dict[str, torch.Tensor] | None:
    """Every process's sums added (positions padded to the longest); ``None`` when no
    process saw a batch of this dataloader."""
    if trainer.world_size == 1:
        return sums if sums else None
    strategy = trainer.strategy
    mine = torch.tensor(float(bool(sums)), device=strategy.root_device)
    seen = strategy.reduce(mine, reduce_op="sum")
    if not float(seen):
        return None
    if not sums:
        raise RuntimeError(
            "AttributionPatching: a process saw no batch of a dataloader that others did; "
            "use a sampler that gives every process batches (Lightning's DistributedSampler)"
        )
    synced = {}
    for name in names:
        value = sums[name].to(strategy.root_device)
        if value.dim():
            lengths = _gather_tensors(torch.tensor([value.shape[0]], device=value.device))
            most = int(lengths.max())
            pad = value.new_zeros(most - value.shape[0], *value.shape[1:])
            value = torch.cat([value, pad])
        synced[name] = strategy.reduce(value, reduce_op="sum").cpu()
    return synced
