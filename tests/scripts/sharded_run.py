"""Run by tests/lightning/test_sharded.py: a sharded tiny Llama through every consumer.

    python tests/scripts/sharded_run.py OUT_DIR CASE [CASE ...]

Each CASE is ``PLAN:DP:TP:SAMPLES:STEP``, run in order in the same processes (DP x TP of
them, under Lightning's ``ModelParallelStrategy``), PLAN one of
``tests.lightning.sharded_models.PLANS``:

- STEP ``all``: one run of each consumer, in order: a dump with memory captures and a
  dump of token rows (predict), probes, ``UnitActivations``, edits,
  ``InterventionEffects`` and ``AttributionPatching`` (validate), and
  ``ActivationMonitor`` over two training steps whose learning rate is 0 (fit); rank 0
  saves every figure to OUT_DIR/PLAN-DPxTP/results.pt, the stores beside it.
- STEP ``kill``: a dump to OUT_DIR/resumed, one shard per batch, rank 0 SIGKILLed in its
  third batch (the other processes fail at their next collective).
- STEP ``resume``: that dump resumed (``mode="resume"``); rank 0 writes the indices of
  the predict batches it computed to OUT_DIR/resumed.json.

With ``PLAN=none`` (one process, unsharded) :func:`run` gives the truth in the caller.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows
from lightning_iocatch.capture import Replace, Steer, Zero
from lightning_iocatch.lightning.attribution import AttributionPatching
from lightning_iocatch.lightning.effects import InterventionEffects
from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from lightning_iocatch.probes import ActivationStats, UnitActivations
from tests.lightning.sharded_models import SPEC, WIDTH, ShardedLlama, forward, loader, samples

LAYER0 = "model.model.layers.0"
STEER = torch.linspace(-1, 1, 64)  # full width of gate_proj's output (column-split)


def variants() -> dict[str, list[Any]]:
    return {
        "zero": [Zero(f"{LAYER0}.mlp.act_fn")],
        "steer": [Steer(f"{LAYER0}.mlp.gate_proj", STEER, alpha=2.0)],
        "replace": [Replace("model.model.layers.1.mlp.act_fn", lambda h: torch.tanh(h))],
    }


def trainer(plan: str, dp: int, tp: int, callbacks: list[pl.Callback], **more: Any) -> pl.Trainer:
    options: dict[str, Any] = {"devices": 1, **more}
    if plan != "none":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
        options = {"devices": dp * tp, "strategy": strategy, **more}
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
        **options,
    )  # fmt: skip


def training_loader(plan: str, dp: int) -> DataLoader:
    """Lightning's sampler shuffles training data; the truth (one process) takes the same
    order of the same seed, a step's batch being the union of the DP ranks' batches."""
    if plan != "none":
        return loader(8, 2)
    data = samples(8)
    order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]
    return DataLoader(data, batch_size=2 * dp, sampler=order)


def run(plan: str, dp: int, tp: int, out: Path, n: int = 13) -> dict[str, Any]:
    """Every consumer over the same data; returns (and on rank 0 saves) what they gave."""
    pl.seed_everything(0)
    module = ShardedLlama(plan)
    dump = IOCaptureCallback(SPEC, writer=FeatureWriter(out / "store"), keep_in_memory=True)
    rows = FeatureWriter(out / "tokens", tokens=TokenRows())  # real tokens, one row each
    tokens = IOCaptureCallback(f"outputs[{LAYER0}.mlp.act_fn|{LAYER0}]", writer=rows)
    run_predict = trainer(plan, dp, tp, [dump, tokens])
    run_predict.predict(module, loader(n), return_predictions=False)

    stats, units = ActivationStats(), UnitActivations(k=3, window=2)
    probes = IOCaptureCallback(SPEC, probes=[stats, units], stages=["validate"])
    edited = IOCaptureCallback(
        f"outputs[{LAYER0}.mlp.gate_proj]", edits=variants()["steer"], stages=["validate"]
    )
    effects = InterventionEffects(variants(), forward=forward)
    atp = AttributionPatching(
        f"outputs[{LAYER0}.mlp.act_fn|{LAYER0}]", forward=forward, exact=[f"{LAYER0}/outputs"]
    )
    check = trainer(plan, dp, tp, [probes, edited, effects, atp])
    check.validate(module, loader(n), verbose=False)

    monitor = ActivationMonitor(
        f"outputs[{LAYER0}.mlp.act_fn]|grad_outputs[{LAYER0}]", every_n_steps=1
    )
    fit = trainer(plan, dp, tp, [monitor], max_steps=2, limit_val_batches=0)
    fit.fit(module, training_loader(plan, dp))

    captures = dump.captures["predict"][0]
    results = {
        "indices": [i for batch in dump.batch_indices["predict"][0] if batch for i in batch],
        "captures": {name: dict(captures[name]) for name in captures},
        "edited": edited.captures["validate"][0][f"{LAYER0}.mlp.gate_proj"]["outputs"],
        "probes": {k: float(v) for k, v in check.callback_metrics.items()},
        "summaries": {
            key: {"active": s.active, "top_values": s.top_values, "top_index": s.top_index}
            for key, s in probes.probes.summaries.items()
        },
        "effects": dict(effects.last_values),
        "atp": {c: {k: v.clone() for k, v in s.items()} for c, s in atp.scores.items()},
        "health": [dict(values) for _, values in monitor.history],
        "width": WIDTH,
    }
    if run_predict.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(results, out / "results.pt")
    return results


class KillAtBatch(pl.Callback):
    """SIGKILLs global rank 0 as batch ``batch`` starts (its writer had time to commit)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if args[2] == self.batch and trainer.global_rank == 0:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)


def dump(plan: str, dp: int, tp: int, out: Path, n: int, step: str) -> None:
    """The ``kill`` or ``resume`` step of the module docstring."""
    pl.seed_everything(0)
    mode = "resume" if step == "resume" else "create"
    writer = FeatureWriter(out / "resumed", mode=mode, max_shard_bytes=1)
    callback = IOCaptureCallback(SPEC, writer=writer)
    extra = [KillAtBatch(2)] if step == "kill" else []
    runner = trainer(plan, dp, tp, [callback, *extra])
    module = ShardedLlama(plan)
    runner.predict(module, loader(n), return_predictions=False)
    if runner.global_rank == 0:
        (out / "resumed.json").write_text(json.dumps(module.computed))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        plan, dp, tp, n, step = case.split(":")
        if step == "all":
            run(plan, int(dp), int(tp), out / f"{plan}-{dp}x{tp}", int(n))
        else:
            dump(plan, int(dp), int(tp), out, int(n), step)
