"""examples/health.py, quick: the monitor's history against the same training run by hand
(plain PyTorch, forward hooks and tensor hooks on the blocks, the figures in NumPy float64),
and what the example claims: units die after the learning-rate spike, and the NaN is traced
to block 2 on the last step, with the poisoned sample's index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from examples.health import (
    BATCH,
    BLOCKS,
    EVERY,
    LR,
    MLP,
    POISONED,
    SPIKE_STEPS,
    Teacher,
    lr_at,
    poison_index,
    run,
    spike,
)
from tests.lightning.health_truth import figures


def keep(i: int, outputs: dict[int, torch.Tensor], grads: dict[int, torch.Tensor]) -> Any:
    """A forward hook that keeps block ``i``'s output and, through a tensor hook, its
    gradient."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        outputs[i] = output.detach().clone()
        output.register_hook(lambda g: grads.__setitem__(i, g.detach().clone()))

    return hook


def by_hand(steps: int) -> dict[int, dict[str, dict[str, float]]]:
    """The example's training in a plain loop: ``{step: {flat key: figures}}`` on the
    watched steps, each block's output and its gradient."""
    torch.manual_seed(0)  # as pl.seed_everything(0) before the model is made
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = Teacher(steps * BATCH)
    truth: dict[int, dict[str, dict[str, float]]] = {}
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        x, y, index = data.x[rows], data.y[rows], torch.arange(rows.start, rows.stop)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        model.poison(index == poison_index(steps))
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        handles = [
            b.register_forward_hook(keep(i, outputs, grads)) for i, b in enumerate(model.blocks)
        ]
        try:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        finally:
            for handle in handles:
                handle.remove()
        if step % EVERY == 0:
            truth[step] = {}
            for i in range(BLOCKS):
                truth[step][f"model.blocks.{i}/outputs"] = figures([outputs[i].numpy()])
                truth[step][f"model.blocks.{i}/grad_outputs"] = figures([grads[i].numpy()])
    return truth


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_health_example_logs_what_a_hand_loop_computes(tmp_path: Path) -> None:
    result = run(tmp_path, quick=True)
    monitor, steps = result["monitor"], result["steps"]
    truth = by_hand(steps)
    assert [step for step, _ in monitor.history] == sorted(truth)  # every watched step, once
    last = steps - 1
    for step, logged in monitor.history:
        for key, expected in truth[step].items():
            for name, value in expected.items():
                found = logged[f"health/{key}/{name}"]
                if step == last and "grad" in key:
                    continue  # a NaN loss: every gradient is NaN, nothing finite to compare
                tolerance = 1e-3 if name == "kurtosis" else 1e-5  # float32 training
                assert found == pytest.approx(value, rel=tolerance, abs=1e-7), (step, key, name)

    # the claim: the spike kills units; before it a few are dead, after it many
    dead = {
        step: np.mean([logged[f"health/model.blocks.{b}/outputs/dead_frac"] for b in (2, 3)])
        for step, logged in monitor.history
        if step != last
    }
    before = [d for step, d in dead.items() if step < spike(steps)]
    after = [d for step, d in dead.items() if step >= spike(steps) + SPIKE_STEPS]
    assert max(before) < 0.2 and min(after) > 0.5, dead  # 0.11-0.14 and 0.62-0.66 measured

    # the NaN: made by block 2 on the last step, reaching block 3 (its whole row: 64 values)
    nan_row = truth[last][f"model.blocks.{POISONED}/outputs"]["nonfinite"]
    assert nan_row == 64 and truth[last]["model.blocks.3/outputs"]["nonfinite"] == 64
    assert truth[last]["model.blocks.1/outputs"]["nonfinite"] == 0
    assert len(monitor.nonfinite) == 1
    found = monitor.nonfinite[0]
    assert found["step"] == last and found["key"] == f"model.blocks.{POISONED}/outputs"
    assert found["indices"] == [poison_index(steps)]  # the sample that went non-finite

    image = tmp_path / "health.png"
    assert image.stat().st_size > 10_000 and image.read_bytes()[:4] == b"\x89PNG"
