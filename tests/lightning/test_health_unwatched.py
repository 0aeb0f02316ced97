"""ActivationMonitor does nothing on the steps it does not watch: no hook is registered on
the watched modules (so none fires), no statistics are taken; on a watched step every
watched module's hook fires once and its statistics are taken once. Its session is made
once a fit (the names resolved once) and opened on each watched step only."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_iocatch.lightning.health_transform as health_transform
from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.lightning.health_monitor import ActivationMonitor

NAMES = [f"model.{i}" for i in range(3)]


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(4, 4) for _ in NAMES])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Hooked(pl.Callback):
    """After the monitor's hooks: how many forward hooks the watched modules hold, a step."""

    def __init__(self) -> None:
        self.hooks: dict[int, int] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        watched = [module.get_submodule(name) for name in NAMES]
        self.hooks[trainer.global_step] = sum(len(m._forward_hooks) for m in watched)


def test_unwatched_steps_register_nothing_and_compute_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured: dict[int, list[str]] = {}
    real = health_transform._Statistics.capture
    trainer_ref: list[pl.Trainer] = []

    def capture(self: Any, tensor: torch.Tensor, site: Any) -> torch.Tensor:
        captured.setdefault(trainer_ref[0].global_step, []).append(site.module)
        return real(self, tensor, site)

    monkeypatch.setattr(health_transform._Statistics, "capture", capture)
    sessions: list[Any] = []
    made = ModelIOCatcher.from_spec

    def from_spec(self: ModelIOCatcher, *args: Any, **kwargs: Any) -> Any:
        sessions.append(made(self, *args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(ModelIOCatcher, "from_spec", from_spec)
    monitor, hooked = ActivationMonitor("outputs[model.*]", every_n_steps=3), Hooked()
    trainer = pl.Trainer(max_steps=7, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[monitor, hooked])  # fmt: skip
    trainer_ref.append(trainer)
    data = DataLoader(TensorDataset(torch.randn(7 * 2, 4)), batch_size=2)
    net = Net()
    trainer.fit(net, data)
    assert hooked.hooks == {0: 3, 1: 0, 2: 0, 3: 3, 4: 0, 5: 0, 6: 3}
    assert {step: sorted(names) for step, names in captured.items()} == {
        step: NAMES for step in (0, 3, 6)
    }
    assert [step for step, _ in monitor.history] == [0, 3, 6]
    assert len(sessions) == 1  # made once a fit: the names resolved once
    assert all(not m._forward_hooks for m in net.modules())  # nothing left behind
