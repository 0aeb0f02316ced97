"""ActivationMonitor over a fit that changes under it: a layer swapped mid-fit (LoRA or
quantization injected by a callback) is watched where it now stands, and batches whose
real-token counts change at every step keep no more float64 blocks than the last one used."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from tests.lightning_models import trainer


class Tokens(Dataset):
    """Samples of 6 tokens of width 4, the last ``i % 5`` of sample ``i`` padding."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        mask = torch.ones(6, dtype=torch.long)
        mask[6 - i % 5 :] = 0
        return {"x": torch.randn(6, 4, generator=generator), "attention_mask": mask}


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch["x"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Swap(pl.Callback):
    """Replaces ``model.1`` before step 2 (before the monitor's hook: it comes first);
    records what the new layer put out on the steps after."""

    def __init__(self) -> None:
        self.outputs: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == 2:
            torch.manual_seed(1)
            module.model[1] = nn.Linear(4, 4)
            module.model[1].register_forward_hook(self.record)

    def record(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.outputs[len(self.outputs)] = output.detach().clone()


def test_a_layer_swapped_mid_fit_is_watched_where_it_now_stands() -> None:
    swap = Swap()
    monitor = ActivationMonitor("outputs[model.1]", every_n_steps=1, tokens=None)
    loader = DataLoader(Tokens(), batch_size=4)
    trainer([swap, monitor], max_steps=4).fit(Net(), loader)
    history = dict(monitor.history)
    assert sorted(history) == [0, 1, 2, 3]
    for step, output in zip((2, 3), swap.outputs.values(), strict=True):
        values = output.double().numpy()
        found = history[step]
        mean = next(v for k, v in found.items() if k.endswith("/mean"))
        assert mean == float(values.mean()) or abs(mean - values.mean()) < 1e-12


class Held(pl.Callback):
    """After the monitor's batch end: the shapes of float64 blocks it holds, a step."""

    def __init__(self, monitor: ActivationMonitor) -> None:
        self.monitor, self.held = monitor, [-1]

    def on_train_batch_end(self, *args: Any) -> None:
        self.held.append(len(self.monitor._blocks._blocks))


def test_blocks_of_changing_real_token_counts_do_not_pile_up() -> None:
    monitor = ActivationMonitor("outputs[model.*]", every_n_steps=1)  # real tokens only
    held = Held(monitor)
    loader = DataLoader(Tokens(), batch_size=1)  # 6, 5, 4, 3, 2 real tokens in turn
    trainer([monitor, held], max_steps=12).fit(Net(), loader)
    assert len(monitor.history) == 12
    assert max(held.held) == 1  # this step's shape, not one for each count seen
