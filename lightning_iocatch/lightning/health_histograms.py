"""The monitor's histograms of ``|x|``, to the loggers that take histograms.

A statistics vector with a histogram holds the counts of the finite ``|x|`` between
:data:`~lightning_iocatch.probes.health.EDGES` (``len(EDGES) + 1`` counts: below the first
edge, between each pair, from the last edge up). Two loggers take them:

- a logger whose ``experiment`` has TensorBoard's ``add_histogram_raw`` (Lightning's
  ``TensorBoardLogger``): bucket limits are the upper edges of the counts, ``sum`` is the
  sum of ``|x|`` and ``sum_squares`` that of ``x^2``, ``max`` the largest ``|x|``; the
  smallest ``|x|`` is not kept, so ``min`` is the lower edge of the first non-empty count
  (a bound: the smallest ``|x|`` is at least that, and below the next edge);
- Lightning's ``WandbLogger`` (only if Lightning and wandb are installed; nothing is
  imported otherwise): ``wandb.Histogram(np_histogram=(counts, edges))``, the form of
  NumPy's ``np.histogram`` (``len(counts) + 1`` edges, from 0), logged with
  ``trainer/global_step`` as the monitor's scalars are (``WandbLogger.log_metrics`` does
  the same rather than pass ``step=``, which W&B drops when it is behind its own step).

Examples:
    >>> histogram_edges(2.0)[:2], histogram_edges(2.0)[-1]
    ([0.0, 1e-06], 10000.0)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_iocatch.probes.health import EDGES, HealthFigures

__all__ = ["histogram_edges", "log_histograms"]


def histogram_edges(absmax: float) -> list[float]:
    """The ``len(EDGES) + 2`` edges of a histogram's counts: 0, :data:`EDGES`, and above
    the largest ``|x|`` (``absmax``) or the last edge, ten times the larger."""
    return [0.0, *EDGES, max(absmax, EDGES[-1]) * 10]


def log_histograms(
    trainer: pl.Trainer,
    prefix: str,
    figures: dict[str, HealthFigures],
    step: int,
) -> None:
    """Each key's histogram of ``|x|`` as ``{prefix}/{key}/abs`` to every logger that takes
    histograms (process 0 only)."""
    if not trainer.is_global_zero:
        return
    found = {key: one for key, one in figures.items() if one.count}
    wandb_logger = _wandb_logger_class()
    for logger in trainer.loggers:
        if wandb_logger is not None and isinstance(logger, wandb_logger):
            _to_wandb(logger, prefix, found, step)
            continue
        add = getattr(getattr(logger, "experiment", None), "add_histogram_raw", None)
        if callable(add):
            for key, one in found.items():
                edges = histogram_edges(one.absmax)
                first = next(i for i, count in enumerate(one.histogram) if count)
                add(
                    tag=f"{prefix}/{key}/abs", min=edges[first], max=one.absmax,
                    num=one.count, sum=one.abs_sum, sum_squares=one.sums[1],
                    bucket_limits=edges[1:],
                    bucket_counts=list(one.histogram), global_step=step,
                )  # fmt: skip


def _wandb_logger_class() -> type | None:
    """Lightning's ``WandbLogger`` where wandb is installed, else None."""
    try:
        import wandb  # noqa: F401
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:
        return None
    return WandbLogger


def _to_wandb(logger: Any, prefix: str, figures: dict[str, HealthFigures], step: int) -> None:
    import numpy as np
    import wandb

    logged: dict[str, Any] = {
        f"{prefix}/{key}/abs": wandb.Histogram(
            np_histogram=(np.asarray(one.histogram), np.asarray(histogram_edges(one.absmax)))
        )
        for key, one in figures.items()
    }
    logger.experiment.log({**logged, "trainer/global_step": step})
