"""ProbeSink: the Lightning side of the probes; feeds them each batch and logs them.

The metrics themselves live in :mod:`lightning_iocatch.probes` (pure torchmetrics).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torchmetrics import Metric

from lightning_iocatch.capture.keys import flatten_captures, flatten_value
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout
from lightning_iocatch.lightning.sinks import BatchCaptures, CaptureSink
from lightning_iocatch.probes.base import (
    _gather_objects,
    _most_common_rows,
    _samples,
    masked_by,
    usable,
)
from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.probes.units import UnitActivations
from lightning_iocatch.store.tokens import TokenRows
from lightning_iocatch.token_mask import checked_mask, real_tokens, token_coordinates

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ProbeSink", "ProbeTokens"]

ProbeTokens = Literal["attention_mask", "all"] | TokenRows | Callable[[Any], torch.Tensor]
"""Which tokens probes count: see :class:`ProbeSink`'s ``tokens``."""

_OPTION = "`probe_tokens`"


class ProbeSink(CaptureSink):
    """Feeds probes from each validation or test batch and logs them at epoch end.

    Logged names: ``iocatch/{key}/{stat}`` for per-tensor probes (``key`` as in
    :mod:`lightning_iocatch.capture.keys`), ``iocatch/cka/{a}~{b}`` for :class:`LayerCKA`, with
    ``/dataloader_idx_{i}`` appended when the loop has several dataloaders.

    Each batch, the probes get the captured tensors they can use (see
    :func:`lightning_iocatch.probes.usable`: floating, first dimension equal to the batch's
    number of samples) and the batch's padding flags; a batch of padding only is skipped.

    ``tokens`` says which tokens of a sequence batch the probes count (the callback's
    ``probe_tokens``): ``"attention_mask"`` (the default) the positions where the batch's
    ``attention_mask`` is non-zero, where the batch is a mapping holding one (the rule of
    :class:`~lightning_iocatch.TokenRows`), else every position; ``"all"`` every
    position; a :class:`~lightning_iocatch.TokenRows` the tokens it keeps (``drop_first``,
    ``drop_token_ids``, ``mask=``: the rows a dump stores); a function ``tokens(batch)``
    giving a ``(batch, seq)`` mask. The mask is computed once per batch and applies to
    every captured tensor of at least three dimensions whose first two are its shape
    (:func:`~lightning_iocatch.probes.base.masked_by`); other tensors are counted whole. A
    sample without a real token is left out of every probe.
    A key whose floating tensor lacked the batch dimension in any batch of any process
    is not probed at all that epoch.

    At the end of the epoch, under DDP, the processes first exchange the set of metric
    slots each one created (``(dataloader, key, probe)``) and the keys without a batch
    dimension; every process creates the slots it lacks, and computes every slot in the
    same sorted order, so every collective pairs the same metric on every process and a
    process that saw no batch, or other keys, still takes part.
    """

    STAGES = ("validate", "test")

    def __init__(self, probes: Sequence[Metric], tokens: ProbeTokens = "attention_mask") -> None:
        for probe in probes:
            if not isinstance(probe, Metric) or not hasattr(probe, "per_tensor"):
                raise TypeError(
                    "`probes` takes lightning_iocatch.probes metrics (ActivationStats, "
                    f"LinearProbe, LayerCKA, UnitActivations), got {type(probe).__name__}"
                )
        named = [p.name for p in probes if isinstance(p, UnitActivations)]
        if len(set(named)) < len(named):
            raise ValueError(
                f"two UnitActivations probes share a name ({sorted(named)}): give each its "
                "own `name=`, which names its logged values and summaries"
            )
        self.probes = list(probes)
        self._wants_coordinates = any(getattr(p, "wants_coordinates", False) for p in probes)
        self.tokens = tokens
        self._real_tokens = _token_rule(tokens)
        self._metrics: dict[tuple[int, str, int], Metric] = {}
        self._unbatched: set[tuple[int, str]] = set()  # (dataloader_idx, key)
        self.last_values: dict[str, float] = {}
        self.summaries: dict[str, UnitSummary] = {}  # of UnitActivations, by key
        self.history: dict[str, list[tuple[int, float]]] = {}  # name -> (epoch, value)
        self._device = torch.device("cpu")  # the LightningModule's, from each loop start
        self._counts = True  # this process counts its samples (one per tensor-parallel group)

    def _metric(self, slot: tuple[int, str, int]) -> Metric:
        if slot not in self._metrics:
            self._metrics[slot] = self.probes[slot[2]].clone().to(self._device)
        return self._metrics[slot]

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._metrics = {}
        self._unbatched = set()
        self._device = pl_module.device
        self._counts = DataParallelLayout.of(trainer).counts

    def on_batch(self, batch: BatchCaptures) -> None:
        if batch.stage not in self.STAGES:
            return
        flat = flatten_captures(batch.captures)
        samples = _sample_count(batch, flat)
        repeated = batch.repeated if batch.repeated and len(batch.repeated) == samples else None
        if repeated is not None and all(repeated):
            return  # padding only: these samples are counted where they are not padding
        indices = batch.indices
        tokens = self._tokens(batch.batch, samples)
        coordinates = self._coordinates(batch.batch, tokens)
        features: dict[str, torch.Tensor] = {}
        for key, tensor in flat.items():
            if usable(tensor, samples):
                features[key] = tensor.to(self._device)
            elif tensor.is_floating_point():
                self._unbatched.add((batch.dataloader_idx, key))
        if not self._counts:  # checked as on the process that counts, which is another
            return  # process of this one's tensor-parallel group
        for position, probe in enumerate(self.probes):
            if probe.per_tensor:
                for key, tensor in features.items():
                    metric = self._metric((batch.dataloader_idx, key, position))
                    extra = {}
                    if getattr(probe, "wants_coordinates", False) and masked_by(tensor, tokens):
                        extra = coordinates
                    metric.update(
                        tensor,
                        batch=batch.batch,
                        indices=indices,
                        repeated=repeated,
                        tokens=tokens,
                        **extra,
                    )
            else:
                metric = self._metric((batch.dataloader_idx, "", position))
                metric.update(
                    features, batch=batch.batch, indices=indices, repeated=repeated, tokens=tokens
                )

    def _tokens(self, batch: Any, samples: int | None) -> torch.Tensor | None:
        """The batch's mask of real tokens on the probes' device, ``None`` for every token."""
        mask = self._real_tokens(batch)
        if mask is None:
            return None
        if samples is not None and mask.shape[0] != samples:
            raise ValueError(
                f"{_OPTION}: the batch's mask of real tokens has shape {tuple(mask.shape)} "
                f"for a batch of {samples} samples; pass `probe_tokens=` a function of the "
                "batch giving its (batch, seq) mask, or 'all' to count every position"
            )
        return mask.to(self._device)

    def _coordinates(self, batch: Any, tokens: torch.Tensor | None) -> dict[str, Any]:
        """The masked tokens' positions and ids, for probes that name examples (computed
        once per batch where one does; as a dump with the same ``TokenRows`` records them)."""
        if not self._wants_coordinates or tokens is None:
            return {}  # such a probe finds them in the batch itself
        rule = self.tokens if isinstance(self.tokens, TokenRows) else TokenRows()
        positions, ids = token_coordinates(
            batch, tokens, padding=rule.padding, token_ids=rule.token_ids
        )
        return {"positions": positions, "token_ids": ids}

    def on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in self.STAGES:
            return
        slots, unbatched = self._agreed_slots()
        several = len({dataloader_idx for dataloader_idx, _, _ in slots}) > 1
        for slot in slots:
            dataloader_idx, key, _ = slot
            metric = self._metric(slot)
            if key and (dataloader_idx, key) in unbatched:
                metric.reset()  # the same decision on every process: no collective
                continue
            with warnings.catch_warnings():  # a slot created here was never updated
                warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric")
                values = metric.compute()  # syncs across processes
            suffix = f"/dataloader_idx_{dataloader_idx}" if several else ""
            if isinstance(values, UnitSummary):
                label = getattr(metric, "name", "units")
                self.summaries[f"{key}/{label}{suffix}"] = values.with_key(key)
                values = {f"{label}/{stat}": value for stat, value in values.scalars().items()}
            for stat, value in values.items():
                name = f"iocatch/{key}/{stat}" if key else f"iocatch/{stat}"
                name += suffix
                number = float(value)
                self.last_values[name] = number
                self.history.setdefault(name, []).append((trainer.current_epoch, number))
                # the same on every process (synced above): `sync_dist=True` tells Lightning
                # so (no PossibleUserWarning) and `rank_zero_only=True` stops it reducing the
                # value again (no collective); every process logs it, for callbacks to monitor
                pl_module.log(
                    name, number, add_dataloader_idx=False, sync_dist=True, rank_zero_only=True
                )
            metric.reset()
        if trainer.is_global_zero:
            self._send_figures(trainer)

    def _agreed_slots(self) -> tuple[list[tuple[int, str, int]], set[tuple[int, str]]]:
        """Every process's metric slots, sorted, and keys without a batch dimension."""
        local = (sorted(self._metrics), sorted(self._unbatched))
        if not _distributed():
            return local[0], set(local[1])
        gathered = _gather_objects(local)
        slots = sorted({slot for part, _ in gathered for slot in part})
        return slots, {key for _, part in gathered for key in part}

    def _send_figures(self, trainer: pl.Trainer) -> None:
        """Draw the probe figures into every TensorBoardLogger (needs matplotlib)."""
        from lightning.pytorch.loggers import TensorBoardLogger

        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not boards:
            return
        from lightning_iocatch.plots import cka_heatmap, close_figure, probe_by_layer

        for tag, draw in (("iocatch/probe_by_layer", probe_by_layer), ("iocatch/cka", cka_heatmap)):
            try:
                figure = draw(self.history)
            except (ImportError, ValueError):  # no matplotlib, or nothing of that kind logged
                continue
            for board in boards:
                board.experiment.add_figure(tag, figure, trainer.global_step, close=False)
            close_figure(figure)


def _attention_mask(batch: Any) -> torch.Tensor | None:
    """The default rule, with the fix in its error."""
    try:
        return real_tokens(batch, who=f"{_OPTION}='attention_mask'")
    except ValueError as error:
        raise ValueError(
            f"{error}; pass `probe_tokens=` a function of the batch giving its (batch, seq) "
            "mask of real tokens, or 'all' to count every position"
        ) from None


def _token_rule(tokens: Any) -> Callable[[Any], torch.Tensor | None]:
    """``tokens`` (see :class:`ProbeSink`) as a function of the batch: its bool mask of
    real tokens, ``None`` for every position."""
    if isinstance(tokens, TokenRows):
        return tokens.keep
    if isinstance(tokens, str) and tokens == "all":
        return lambda batch: None
    if isinstance(tokens, str) and tokens == "attention_mask":
        return _attention_mask
    if callable(tokens):
        return lambda batch: checked_mask(tokens(batch), "`probe_tokens(batch)`", _OPTION)
    raise TypeError(
        f"{_OPTION} must be 'attention_mask', 'all', a TokenRows or a function of the batch "
        f"giving its (batch, seq) mask of real tokens, got {tokens!r:.80}"
    )


def _distributed() -> bool:
    """Whether Lightning's processes form a group of more than one (the default group)."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _sample_count(batch: BatchCaptures, flat: dict[str, torch.Tensor]) -> int | None:
    """The batch's number of samples: from its indices or padding flags where known, else
    the first dimension of its first tensor, else the most common first dimension of the
    captured floating tensors; ``None`` when nothing tells."""
    known = _samples(batch.indices, batch.repeated)
    if known is not None:
        return known
    for _, tensor in flatten_value(batch.batch, ""):
        if tensor.dim() > 0:
            return tensor.shape[0]
    return _most_common_rows(flat)
