"""Activation health during training: ReLU units dying after a learning-rate spike, and
the first NaN traced to the block that made it.

    .venv/bin/python examples/health.py [--out runs/health] [--quick]

1. A 4-block MLP (each block ``Linear(64, 64)`` then ``ReLU``, a ``Linear(64, 10)`` head)
   learns a random teacher's 10 classes with SGD at lr ``LR``, except for ``SPIKE_STEPS``
   steps at ``SPIKE_LR`` from step ``spike(steps)``: a spike large enough that many ReLU
   units are pushed below zero for every input and never come back (dead).
2. ``ActivationMonitor`` watches every block's output and its gradient every ``EVERY``
   steps (and on step 0), keeping the figures in ``monitor.history``.
3. On the last step (a watched one), block 2 writes a NaN into the row of dataset sample
   ``poison_index(steps)``: the NaN reaches block 3 and the loss, and the monitor names
   the first place it appeared, ``model.blocks.2/outputs``, with the batch's dataset
   indices (``indices=``). ``on_nonfinite="warn"`` lets the run finish.
4. A plot of the logged figures over the steps: the dead fraction, max ``|x|`` and
   kurtosis of each block's output, and the RMS of its gradient: ``OUT/health.png``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_iocatch.lightning.health_monitor import ActivationMonitor

BLOCKS, WIDTH, CLASSES, BATCH = 4, 64, 10, 64
LR, SPIKE_LR, SPIKE_STEPS = 0.05, 10.0, 3
EVERY = 5  # watched steps: 0, 5, 10, ...
POISONED = 2  # the block that makes the NaN
SPEC = "outputs[model.blocks.*]|grad_outputs[model.blocks.*]"
STEPS = {"full": 301, "quick": 61}  # the last step (a multiple of EVERY) is watched


def spike(steps: int) -> int:
    """The first step of the learning-rate spike (a third of the way)."""
    return steps // 3


def lr_at(step: int, steps: int) -> float:
    return SPIKE_LR if spike(steps) <= step < spike(steps) + SPIKE_STEPS else LR


def poison_index(steps: int) -> int:
    """The dataset sample whose row block 2 turns to NaN: the 6th of the last batch."""
    return (steps - 1) * BATCH + 5


class Teacher(Dataset):
    """``(x, class, index)``: Gaussian inputs, the class a fixed random linear map's argmax."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(count, WIDTH, generator=generator)
        teacher = torch.randn(WIDTH, CLASSES, generator=generator)
        self.y = (self.x @ teacher).argmax(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Poison(nn.Module):
    """Identity, except that the rows in ``rows`` (a bool mask, when set) become NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None or not self.rows.any():
            return x
        return torch.where(self.rows[:, None], torch.nan, x)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), *([Poison()] * (i == POISONED)))
            for i in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def poison(self, rows: torch.Tensor | None) -> None:
        self.blocks[POISONED][-1].rows = rows


class Classifier(pl.LightningModule):
    """The MLP as ``self.model``; SGD at ``lr_at(global_step)``; poisons the last step."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.model = MLP()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = lr_at(self.global_step, self.steps)
        self.model.poison(index == poison_index(self.steps))
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def loader(steps: int) -> DataLoader:
    return DataLoader(Teacher(steps * BATCH), batch_size=BATCH)


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    """Train, watch, plot; returns the monitor, the model and the step count."""
    steps = STEPS["quick" if quick else "full"]
    pl.seed_everything(0, verbose=False)
    lm = Classifier(steps)
    monitor = ActivationMonitor(
        SPEC, every_n_steps=EVERY, on_nonfinite="warn", indices=lambda batch: batch[2].tolist()
    )
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[monitor])  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers")
        warnings.filterwarnings("ignore", "ActivationMonitor: at step", UserWarning)
        trainer.fit(lm, loader(steps))
    out.mkdir(parents=True, exist_ok=True)
    plot(monitor.history, monitor.nonfinite, steps, out / "health.png")
    return {"monitor": monitor, "lm": lm, "steps": steps}


def series(history: list[tuple[int, dict[str, float]]], key: str) -> tuple[list[int], list[float]]:
    """One logged figure over the watched steps, e.g. ``model.blocks.0/outputs/dead_frac``."""
    return [step for step, _ in history], [figures[f"health/{key}"] for _, figures in history]


def plot(
    history: list[tuple[int, dict[str, float]]],
    nonfinite: list[dict[str, Any]],
    steps: int,
    path: Path,
) -> None:
    """Four panels over the watched steps, one line a block; the last step (its NaN)
    named in the title, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("outputs/dead_frac", "dead fraction (units zero on every row)"),
              ("outputs/absmax", "max |x| of the output"),
              ("outputs/kurtosis", "kurtosis of the output"),
              ("grad_outputs/rms", "RMS of the output's gradient")]  # fmt: skip
    clean = [(step, figures) for step, figures in history if step != steps - 1]
    figure, axes = plt.subplots(2, 2, figsize=(9, 5.5), sharex=True, dpi=80)
    for ax, (figure_name, title) in zip(axes.flat, panels, strict=True):
        for block in range(BLOCKS):
            ax.plot(*series(clean, f"model.blocks.{block}/{figure_name}"), label=f"block {block}")
        ax.axvspan(spike(steps), spike(steps) + SPIKE_STEPS, color="tab:red", alpha=0.2)
        ax.set_title(title, fontsize=10)
        if figure_name.endswith(("absmax", "rms")):
            ax.set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("optimizer step (watched every 5; red: lr spike)")
    axes[0, 0].legend(fontsize=8)
    for found in nonfinite:
        figure.suptitle(f"step {found['step']}: first NaN/inf in {found['key']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/health"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    result = run(args.out, quick=args.quick)
    monitor, steps = result["monitor"], result["steps"]
    print(f"{steps} steps, lr {LR} with a spike to {SPIKE_LR} at steps "
          f"{spike(steps)}-{spike(steps) + SPIKE_STEPS - 1}; watched every {EVERY}")  # fmt: skip
    for step, figures in monitor.history[:: max(1, len(monitor.history) // 8)]:
        dead = [figures[f"health/model.blocks.{b}/outputs/dead_frac"] for b in range(BLOCKS)]
        print(f"step {step:4d}: dead fraction per block {[round(d, 2) for d in dead]}")
    for found in monitor.nonfinite:
        print(f"first non-finite value: step {found['step']}, {found['key']} (samples "
              f"{found['indices']}; the poisoned one: {poison_index(steps)})")  # fmt: skip
    print(f"plot: {args.out / 'health.png'}")


if __name__ == "__main__":
    main()
