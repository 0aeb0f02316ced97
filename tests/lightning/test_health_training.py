"""ActivationMonitor where training runs (issue 31, requirement 4), each against NumPy.

The truth of every test: the same training run (same seeds, same data) with plain hooks
instead of the monitor (:mod:`tests.lightning.health_truth`), its watched steps' outputs
and output gradients reduced in NumPy float64. Gradient accumulation, ``torch.compile``
(and the ``fullgraph=True`` refusal), non-reentrant activation checkpointing, 2 DDP
processes with an uneven last batch (``main``, in the shared 2-process launch of
tests/ddp_scenarios.py), and FSDP-wrapped module names (this file as a script, one
process: ``python tests/lightning/test_health_training.py OUT_DIR``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.data import DataLoader, DistributedSampler

from lightning_iocatch.errors import CaptureError
from lightning_iocatch.lightning import health_monitor
from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from tests.conftest import run_script
from tests.ddp_scenarios import ranks_of
from tests.lightning.health_truth import (
    INNER,
    INNER_SPEC,
    SPEC,
    Block,
    Calls,
    Recorder,
    Regression,
    dataset,
    expected,
    figures,
    loader,
    trainer,
)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of values behind every figure the monitor reads, in its order (sorted
    keys per logged step): the one figure a double count would change."""
    seen: list[int] = []
    real = health_monitor.HealthFigures.of_head  # every reading goes through it

    def of_head(values: list[float], dead: int, units: int, histogram: bool = False) -> Any:
        found = real(values, dead, units, histogram)
        seen.append(found.count)
        return found

    monkeypatch.setattr(health_monitor.HealthFigures, "of_head", staticmethod(of_head))
    return seen


def truth_counts(recorder: Recorder, steps: list[int]) -> list[int]:
    return [
        sum(array.size for array in recorder.seen[step][key])
        for step in steps
        for key in sorted(recorder.seen[step])
    ]


def assert_figures(
    history: list[tuple[int, dict[str, float]]], truth: dict[int, dict], rel: float = 1e-9
) -> None:
    """The monitor's figures equal NumPy's: step by step, name by name."""
    assert [step for step, _ in history] == sorted(truth)
    for step, logged in history:
        assert set(logged) == set(truth[step]), step
        for name, value in truth[step].items():
            if name.endswith(("/dead_frac", "/nonfinite")):
                assert logged[name] == value, (step, name)
            else:
                assert logged[name] == pytest.approx(value, rel=rel, abs=1e-12), (step, name)


def recorded(steps: list[int], **options: Any) -> tuple[Recorder, dict[int, dict]]:
    """The plain-hook run: its recorder and the NumPy figures of ``steps``."""
    module_options = {k: options.pop(k) for k in ("lr", "checkpointed") if k in options}
    data = options.pop("data")
    recorder = Recorder()
    trainer([recorder], **options).fit(Regression(**module_options), data)
    return recorder, expected(recorder, steps)


def test_gradient_accumulation_covers_both_micro_batches(counts: list[int]) -> None:
    # 2 epochs of 7 micro-batches of 2, accumulated by 2: optimizer steps 0..7, the epoch's
    # last step (3, 7) has one micro-batch; steps 0, 3 and 6 watched
    options: dict[str, Any] = dict(accumulate_grad_batches=2, max_epochs=2)
    monitor = ActivationMonitor(SPEC, every_n_steps=3, tokens=None)
    logger = Calls()
    trainer([monitor], logger=logger, **options).fit(Regression(), loader(14, 2))
    recorder, truth = recorded([0, 3, 6], data=loader(14, 2), **options)
    micro = {step: len(recorder.seen[step]["model.layers.0/outputs"]) for step in (0, 3, 6)}
    assert micro == {0: 2, 3: 1, 6: 2}
    assert_figures(monitor.history, truth)
    assert counts == truth_counts(recorder, [0, 3, 6])
    assert counts[:6] == [32] * 6  # step 0: 2 micro-batches x 2 rows x 8 units, each key
    # the watched steps reach the logger (Lightning logs in float32) at their own step
    by_step = {step: metrics for step, metrics in logger.calls}
    for step in (0, 3, 6):
        for name, value in truth[step].items():
            assert by_step[step][name] == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_figures_reach_the_logger_only_on_watched_steps() -> None:
    """Not ``pl_module.log(on_step=True)`` from a callback, which stays in Lightning's
    results until the epoch ends: a watched step's figures were logged again at each
    later unwatched step."""
    monitor = ActivationMonitor(SPEC, every_n_steps=3, tokens=None)
    logger = Calls()
    trainer([monitor], logger=logger, accumulate_grad_batches=2, max_epochs=2).fit(
        Regression(), loader(14, 2)
    )
    health = [
        step for step, metrics in logger.calls if any(k.startswith("health/") for k in metrics)
    ]
    assert health == [0, 3, 6]  # was [0, 1, 2, 3, 6, 7], 1 and 2 repeating 0, 7 repeating 6


def compile_block(module: Regression) -> Regression:
    module.model.layers[1] = torch.compile(module.model.layers[1], backend="aot_eager")  # type: ignore[assignment]
    return module


def compile_model(module: Regression) -> Regression:
    module.model = torch.compile(module.model, backend="aot_eager")  # type: ignore[assignment]
    return module


def compile_block_fullgraph(module: Regression) -> Regression:
    """The watched blocks' hooks run outside the fullgraph code: allowed."""
    module.model.layers[1] = torch.compile(
        module.model.layers[1], backend="aot_eager", fullgraph=True
    )  # type: ignore[assignment]
    return module


@pytest.mark.parametrize("compile_", [compile_block, compile_model, compile_block_fullgraph])
def test_torch_compile_figures_equal_eager(compile_: Any, counts: list[int]) -> None:
    torch._dynamo.reset()
    dynamo_counters.clear()
    monitor = ActivationMonitor(SPEC, every_n_steps=2, tokens=None)
    trainer([monitor]).fit(compile_(Regression()), loader(8, 2))  # steps 0..3, 0 and 2 watched
    assert dynamo_counters["stats"]["unique_graphs"] >= 1  # compiled code did run
    recorder, truth = recorded([0, 2], data=loader(8, 2))
    assert_figures(monitor.history, truth, rel=1e-6)
    assert counts == truth_counts(recorder, [0, 2])


def hook_count(module: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in module.modules()
    )


# (how it was compiled, the spec: hooks that would run inside the fullgraph code, the fix)
FULLGRAPH = [
    ("model", SPEC, r"`model` is `torch\.compile\(module, fullgraph=True\)`"),
    ("block", "outputs[model.layers.1.fc]", r"`model\.layers\.1` is `torch\.compile"),
]


@pytest.mark.parametrize(("where", "spec", "fix"), FULLGRAPH)
def test_torch_compile_fullgraph_is_refused_clearly(where: str, spec: str, fix: str) -> None:
    torch._dynamo.reset()
    module = Regression()
    if where == "model":
        module.model = torch.compile(module.model, backend="eager", fullgraph=True)  # type: ignore[assignment]
    else:
        module.model.layers[1] = torch.compile(
            module.model.layers[1], backend="eager", fullgraph=True
        )  # type: ignore[assignment]
    monitor = ActivationMonitor(spec, every_n_steps=2, tokens=None)
    with pytest.raises(CaptureError, match=r"fullgraph=True.*graph break") as info:
        trainer([monitor], max_steps=2).fit(module, loader(4, 2))
    assert re.search(fix, str(info.value)), str(info.value)
    assert "without `fullgraph=True`" in str(info.value)
    assert hook_count(module) == 0 and monitor.history == []


@pytest.mark.parametrize("early_stop", [True, False])
def test_activation_checkpointing_counts_each_value_once(
    early_stop: bool, counts: list[int]
) -> None:
    """Recomputation runs the blocks' Linear layers again (and, without early stop, the
    blocks): plain hooks see those outputs twice, the monitor must count them once."""
    monitor = ActivationMonitor(INNER_SPEC, every_n_steps=2, tokens=None)
    with set_checkpoint_early_stop(early_stop):
        trainer([monitor]).fit(Regression(checkpointed=True), loader(8, 2))
        twice = Recorder(INNER)  # plain hooks on the checkpointed run count twice
        trainer([twice]).fit(Regression(checkpointed=True), loader(8, 2))
    assert len(twice.seen[0]["model.layers.1.fc/outputs"]) == 2
    recorder = Recorder(INNER)  # the truth: the run without checkpointing
    trainer([recorder]).fit(Regression(), loader(8, 2))
    assert counts == truth_counts(recorder, [0, 2])
    assert_figures(monitor.history, expected(recorder, [0, 2]))


# DDP: 7 samples, batch 3 on each of 2 processes. Lightning would give a training loader a
# shuffling sampler; the script's own DistributedSampler(shuffle=False) gives rank 0
# samples 0, 2, 4, 6 and rank 1 samples 1, 3, 5 and 0 again (its padding): step 0 sees
# 0..5 and step 1 (uneven: one sample a rank) sees 6 and 0. One process over [0..6, 0] in
# batches of 6 sees the same samples each step; with a summed loss its gradients are the
# sum of the ranks' and DDP's their mean, so half the learning rate trains the same
# weights.
DDP_ORDER = [0, 1, 2, 3, 4, 5, 6, 0]


@pytest.mark.slow
def test_two_processes_with_an_uneven_last_batch_log_the_one_process_figures(
    ddp_scenarios: Path,
) -> None:
    out = ranks_of(ddp_scenarios, "health_training")
    history = [(s, v) for s, v in json.loads((out / "ddp0.json").read_text())]
    assert json.loads((out / "ddp1.json").read_text()) == [list(h) for h in history]
    recorder, truth = recorded([0, 1], lr=0.005, data=loader(7, 6, DDP_ORDER))
    assert_figures(history, truth, rel=1e-6)  # step 1 is after a gradient mean: rounding
    # the merge across ranks matters: rank 0 alone (samples 0, 2, 4; then 6) has other
    # figures (a larger max |x| on rank 1, a unit zero on rank 0's rows only)
    differ = set()
    for step, rows in ((0, [0, 2, 4]), (1, [0])):
        for key, arrays in recorder.seen[step].items():
            for name, value in figures([arrays[0][rows]]).items():
                if value != history[step][1][f"health/{key}/{name}"]:
                    differ.add(name)
    assert {"absmax", "dead_frac"} <= differ, differ


def fsdp_run(out: Path) -> None:
    """1 process, a gloo group, each block its own FSDP unit inside the LightningModule
    (Lightning's FSDPStrategy refuses the CPU): names as FSDP writes them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    try:
        module = Regression()
        module.model = FullyShardedDataParallel(  # type: ignore[assignment]
            module.model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
        names = [name for name, _ in module.named_modules()]
        monitor = ActivationMonitor(SPEC, every_n_steps=2, tokens=None)
        trainer([monitor]).fit(module, loader(8, 2))
        (out / "fsdp.json").write_text(json.dumps({"names": names, "history": monitor.history}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_wrapped_blocks_are_watched_by_their_plain_names(tmp_path: Path) -> None:
    run_script(__file__, str(tmp_path), timeout=240)
    found = json.loads((tmp_path / "fsdp.json").read_text())
    assert "model._fsdp_wrapped_module.layers.1._fsdp_wrapped_module" in found["names"]
    _, truth = recorded([0, 2], data=loader(8, 2))
    assert_figures([(s, v) for s, v in found["history"]], truth, rel=1e-6)


class DDPData(pl.LightningDataModule):
    """7 samples in batches of 3 a process, not shuffled (made once the group exists)."""

    def train_dataloader(self) -> DataLoader:
        data = dataset(7)
        return DataLoader(data, batch_size=3, sampler=DistributedSampler(data, shuffle=False))


def main(out: Path) -> None:
    """One process of the 2-process run (in the shared launch of tests/ddp_scenarios.py)."""
    monitor = ActivationMonitor(SPEC, every_n_steps=1, tokens=None)
    trainer([monitor], devices=2, strategy="ddp", use_distributed_sampler=False).fit(
        Regression(lr=0.01), train_dataloaders=DDPData()
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"ddp{rank}.json").write_text(json.dumps(monitor.history))


if __name__ == "__main__":
    fsdp_run(Path(sys.argv[1]))
