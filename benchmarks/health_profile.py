"""Where a watched step's time goes (``benchmarks/health.py --profile``).

First the monitor's parts, timed by wrapping them (benchmark only: private methods),
in milliseconds of CPU time a watched step (``every_n_steps=1``), the mean over the
steps of a ``fit``, against the same steps without the monitor:

- in the hooks: everything the capture hooks do in the forward (and, with gradients, the
  gradient sites as the gradients arrive), of which the statistics of tensors reduced
  alone (more than 65,536 values) and the copies of small ones into their blocks;
- the batched statistics of the small tensors (one call a shape, at the batch's end);
- the callback: at the batch's start (the session opened) and at its end (the session
  closed, the statistics read, the figures logged), the batched statistics left out.

The fixed cost of a watched module is the time in its hooks beyond its statistics (the
copy into its block counted as fixed cost), over the modules hooked. Then cProfile of the
same watched steps: the top entries by own time, and the library's functions by
cumulative time (each with its calls and time a call).

Runs against whatever ``lightning_iocatch`` Python imports: put another checkout first on
``PYTHONPATH`` to profile it the same way (parts it lacks read 0).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from health_models import Bench
from torch.utils.data import DataLoader

import lightning_iocatch.capture.session as session_module
import lightning_iocatch.lightning.health_transform as health_transform
from lightning_iocatch.lightning.health_monitor import ActivationMonitor

MODULES = 12  # the blocks every spec watches


class _Timer(pl.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.process_time())

    def on_train_end(self, *args: Any) -> None:
        self.marks.append(time.process_time())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks[1:-1], self.marks[2:], strict=True)]


def _fit(bench: Bench, lm: pl.LightningModule, callbacks: list[pl.Callback], steps: int) -> float:
    """Mean CPU seconds of steps 1 to ``steps - 1``."""
    timer = _Timer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer, *callbacks])  # fmt: skip
    trainer.fit(lm, DataLoader(bench.data(steps), batch_size=None))
    return statistics.fmean(timer.steps())


def parts(bench: Bench, lm: pl.LightningModule, spec: str, steps: int) -> dict[str, float]:
    """Milliseconds a watched step spends in each part (see the module's docstring)."""
    spent: dict[str, float] = {}

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - start

        return wrapper

    patched = [
        (session_module.CaptureSession, "_capture", "hooks"),
        (session_module.CaptureSession, "_attach", "hooks"),
        (health_transform, "health_statistics", "alone"),
        (health_transform, "_unscaled_statistics", "alone"),
        (health_transform._Statistics, "_defer", "copy"),
        (health_transform, "batch_statistics", "batched"),
    ]
    kept = []
    for owner, name, key in patched:
        if hasattr(owner, name):
            kept.append((owner, name, getattr(owner, name)))
            setattr(owner, name, timed(getattr(owner, name), key))
    monitor = ActivationMonitor(spec, every_n_steps=1)
    for hook in ("on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step"):
        setattr(monitor, hook, timed(getattr(monitor, hook), hook))
    try:
        _fit(bench, lm, [ActivationMonitor(spec, every_n_steps=1)], 4)  # warm
        spent.clear()
        step = _fit(bench, lm, [monitor], steps + 1)
    finally:
        for owner, name, original in kept:
            setattr(owner, name, original)
    ms = {key: value / steps * 1000 for key, value in spent.items()}  # steps 1..steps
    start = ms.get("on_train_batch_start", 0.0)
    end = ms.get("on_before_optimizer_step", 0.0) + ms.get("on_train_batch_end", 0.0)
    fixed = ms.get("hooks", 0.0) - ms.get("alone", 0.0)  # the copies counted as fixed
    return {
        "step": step * 1000,
        "hooks": ms.get("hooks", 0.0),
        "alone": ms.get("alone", 0.0),
        "copy": ms.get("copy", 0.0),
        "batched": ms.get("batched", 0.0),
        "start": start,
        "end": end - ms.get("batched", 0.0),
        "per_module": fixed / MODULES,
    }


def profile(bench: Bench, lm: pl.LightningModule, steps: int) -> None:
    off = _fit(bench, lm, [], steps + 1) * 1000
    print(f"\n## A watched step's parts, ms of CPU time (mean of {steps} steps; {bench.name})\n")
    print(f"A step without the monitor: {off:.2f} ms.\n")
    print("| spec | step | in the hooks | of which statistics alone | of which copies into "
          "blocks | batched statistics | callback at batch start | callback at batch end "
          "| fixed cost a watched module (hooks beyond statistics) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, spec in (("outputs", bench.spec), ("with gradients", bench.grad_spec)):
        p = parts(bench, lm, spec, steps)
        print(f"| {name} | {p['step']:.2f} | {p['hooks']:.3f} | {p['alone']:.3f} | "
              f"{p['copy']:.3f} | {p['batched']:.3f} | {p['start']:.3f} | {p['end']:.3f} | "
              f"{p['per_module']:.3f} |")  # fmt: skip
    profiler = cProfile.Profile()
    profiler.enable()
    _fit(bench, lm, [ActivationMonitor(bench.spec, every_n_steps=1)], steps + 1)
    profiler.disable()
    for title, order, restriction in (
        ("top entries by own time", "tottime", 15),
        ("the library's functions by cumulative time", "cumulative", "iocatch"),
    ):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats(order)
        restrictions: tuple[Any, ...] = (restriction,) if restriction == 15 else (restriction, 20)
        stats.print_stats(*restrictions)
        print(f"\n## cProfile, outputs, {steps + 1} watched steps: {title}\n")
        print(out.getvalue().split("\n\n", 1)[-1].strip())
