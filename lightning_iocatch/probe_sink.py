"""ProbeSink: the Lightning side of the probes; feeds them each batch and logs them.

The metrics themselves live in :mod:`lightning_iocatch.probes` (pure torchmetrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torchmetrics import Metric

from lightning_iocatch.keys import flatten_captures
from lightning_iocatch.sinks import BatchCaptures, CaptureSink

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ProbeSink"]


class ProbeSink(CaptureSink):
    """Feeds probes from each validation or test batch and logs them at epoch end.

    Logged names: ``iocatch/{key}/{stat}`` for per-tensor probes (``key`` as in
    :mod:`lightning_iocatch.keys`), ``iocatch/cka/{a}~{b}`` for :class:`LayerCKA`, with
    ``/dataloader_idx_{i}`` appended when the loop has several dataloaders.
    """

    STAGES = ("validate", "test")

    def __init__(self, probes: Sequence[Metric]) -> None:
        for probe in probes:
            if not isinstance(probe, Metric) or not hasattr(probe, "per_tensor"):
                raise TypeError(
                    "`probes` takes lightning_iocatch.probes metrics (ActivationStats, "
                    f"LinearProbe, LayerCKA), got {type(probe).__name__}"
                )
        self.probes = list(probes)
        self._metrics: dict[tuple[int, str, int], Metric] = {}
        self.last_values: dict[str, float] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}  # name -> (epoch, value)
        self._device = torch.device("cpu")  # the LightningModule's, from each loop start

    def _metric(self, dataloader_idx: int, key: str, position: int, device: torch.device) -> Metric:
        slot = (dataloader_idx, key, position)
        if slot not in self._metrics:
            self._metrics[slot] = self.probes[position].clone().to(device)
        return self._metrics[slot]

    def on_loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._metrics = {}
        self._device = pl_module.device

    def on_batch(self, batch: BatchCaptures) -> None:
        if batch.stage not in self.STAGES:
            return
        flat = {key: t.to(self._device) for key, t in flatten_captures(batch.captures).items()}
        for position, probe in enumerate(self.probes):
            if probe.per_tensor:
                for key, tensor in flat.items():
                    metric = self._metric(batch.dataloader_idx, key, position, self._device)
                    metric.update(tensor, batch=batch.batch, indices=batch.indices)
            else:
                metric = self._metric(batch.dataloader_idx, "", position, self._device)
                metric.update(flat, batch=batch.batch, indices=batch.indices)

    def on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in self.STAGES:
            return
        several = len({dataloader_idx for dataloader_idx, _, _ in self._metrics}) > 1
        for (dataloader_idx, key, _), metric in sorted(self._metrics.items(), key=lambda i: i[0]):
            for stat, value in metric.compute().items():  # syncs across processes
                name = f"iocatch/{key}/{stat}" if key else f"iocatch/{stat}"
                if several:
                    name += f"/dataloader_idx_{dataloader_idx}"
                number = float(value)
                self.last_values[name] = number
                self.history.setdefault(name, []).append((trainer.current_epoch, number))
                pl_module.log(name, number, add_dataloader_idx=False, sync_dist=False)
            metric.reset()
        if trainer.is_global_zero:
            self._send_figures(trainer)

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
