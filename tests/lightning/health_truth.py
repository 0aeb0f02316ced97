"""Ground truth for the ActivationMonitor's training tests: the same training run with
plain hooks instead of the monitor, and the figures of what they recorded in NumPy float64.

``Recorder`` registers a forward hook on each watched block for the whole of ``fit``; the
hook copies the block's output and registers a tensor hook on it for its gradient, both
filed under the optimizer step (``trainer.global_step`` when the batch began). ``figures``
computes mean, RMS, max |x|, kurtosis, dead fraction and non-finite count of a step's
arrays from their definitions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 8
BLOCKS = [f"model.layers.{i}" for i in range(3)]
SPEC = "outputs[model.layers.*]|grad_outputs[model.layers.*]"
INNER = BLOCKS + [f"{block}.fc" for block in BLOCKS]  # modules a checkpoint recomputes
INNER_SPEC = (
    "outputs[model.layers.*|model.layers.*.fc]|grad_outputs[model.layers.*|model.layers.*.fc]"
)
DEAD = 3  # units of block 1 whose bias makes them zero on every row
FIGURES = ("mean", "rms", "absmax", "kurtosis", "dead_frac", "nonfinite")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    """Three ReLU blocks and a head; optionally each block under non-reentrant checkpointing."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        blocks = [Block() for _ in range(3)]
        with torch.no_grad():
            blocks[1].fc.bias[:DEAD] = -100.0  # dead units: dead_frac at least 3/8
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpointed and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(x).squeeze(-1)


class Regression(pl.LightningModule):
    """A summed squared error (so per-sample gradients do not depend on the batch size)."""

    def __init__(self, lr: float = 0.01, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net(checkpointed)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.model(x) - y) ** 2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dataset(n: int, order: list[int] | None = None) -> TensorDataset:
    """``n`` samples (seeded); ``order`` repeats or reorders them."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, WIDTH, generator=generator)
    y = torch.randn(n, generator=generator)
    if order is not None:
        x, y = x[order], y[order]
    return TensorDataset(x, y)


def loader(n: int, batch_size: int, order: list[int] | None = None) -> DataLoader:
    return DataLoader(dataset(n, order), batch_size=batch_size, shuffle=False)


class Recorder(pl.Callback):
    """Plain hooks for the whole run: step -> flat key -> the arrays of every micro-batch."""

    def __init__(self, blocks: list[str] = BLOCKS) -> None:
        self.blocks = blocks
        self.step = -1
        self.seen: dict[int, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = dict(pl_module.named_modules())
        for name in self.blocks:
            modules[name].register_forward_hook(self._hook(name))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.step = trainer.global_step

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            step = self.step
            self.seen[step][f"{name}/outputs"].append(output.detach().double().numpy().copy())

            def grad(g: torch.Tensor) -> None:
                self.seen[step][f"{name}/grad_outputs"].append(g.detach().double().numpy().copy())

            if output.requires_grad:
                output.register_hook(grad)

        return hook


class Calls(Logger):
    """Every ``log_metrics`` call: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "calls"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def figures(arrays: list[np.ndarray]) -> dict[str, float]:
    """The monitor's figures of ``arrays`` (rows of units in the last dimension), in float64."""
    x = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays]).astype(np.float64)
    finite = np.isfinite(x)
    v = x[finite]
    mean = v.mean()
    centred = v - mean
    var = (centred**2).mean()
    return {
        "mean": float(mean),
        "rms": math.sqrt(float((v**2).mean())),
        "absmax": float(np.abs(v).max()),
        "kurtosis": float((centred**4).mean() / var**2),
        "dead_frac": float((~((x != 0) & finite).any(axis=0)).mean()),  # NaN: not activity
        "nonfinite": float((~finite).sum()),
    }


def expected(recorder: Recorder, steps: list[int], prefix: str = "health") -> dict[int, dict]:
    """step -> logged name -> the NumPy figure, for the watched ``steps``."""
    return {
        step: {
            f"{prefix}/{key}/{name}": value
            for key, arrays in recorder.seen[step].items()
            for name, value in figures(arrays).items()
        }
        for step in steps
    }


def trainer(callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, max_epochs=1,
        log_every_n_steps=1,
    )  # fmt: skip
    settings.update(options)
    return pl.Trainer(callbacks=callbacks, **settings)
