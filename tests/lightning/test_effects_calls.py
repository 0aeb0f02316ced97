"""InterventionEffects calls the model as the validation loop does: a model that writes in
place into its input or into a buffer it makes at its first forward validates with the
callback as it does alone (Lightning's batches are inference tensors), and a default call
that does not fit the model's ``forward`` says how to give ``forward=``.

The truth: a fresh model run by hand on each batch as the loader gives it, with
hand-written hooks for the edits, and NumPy (float64) for the cross-entropies and KL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch.capture import Steer, Zero
from lightning_iocatch.lightning.effects import InterventionEffects
from tests.lightning.test_effects import log_softmax

STEER = torch.linspace(-1, 1, 8)


class Table(nn.Module):
    """Adds a table it makes at its first forward and refreshes in place at every one."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.zeros(x.shape[-1])
        self.table.copy_(torch.linspace(0, 1, x.shape[-1]))
        return x + self.table


class Net(pl.LightningModule):
    """``(x, y)`` batches; ``case`` "input": the forward halves its input in place;
    "buffer": a :class:`Table` first."""

    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.table = Table()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.case == "input":
            x.mul_(0.5)  # into the batch: not idempotent, so a second forward would differ
        else:
            x = self.table(x)
        return self.head(torch.relu(self.b(torch.tanh(self.a(x)))))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, generator=generator), torch.tensor(i % 5)) for i in range(7)]


def variants() -> dict[str, list[Any]]:
    return {"zero": [Zero("b")], "steer": [Steer("b", STEER, alpha=2.0, kind="inputs")]}


def truth(case: str) -> dict[str, float]:
    """Each forward by hand on its own copy of each batch, hooks for the edits."""
    net = Net(case).eval()
    hooks: dict[str, Callable[[], list[Any]]] = {
        "clean": lambda: [],
        "zero": lambda: [net.b.register_forward_hook(lambda m, a, out: torch.zeros_like(out))],
        "steer": lambda: [net.b.register_forward_pre_hook(lambda m, a: (a[0] + 2.0 * STEER,))],
    }
    logits: dict[str, list[np.ndarray]] = {name: [] for name in hooks}
    labels = []
    for x, y in DataLoader(data(), batch_size=3):
        labels.append(y.numpy())
        for name, register in hooks.items():
            handles = register()
            with torch.no_grad():
                logits[name].append(net(x.clone()).double().numpy())
            for handle in handles:
                handle.remove()
    y = np.concatenate(labels)
    p = {name: log_softmax(np.concatenate(rows)) for name, rows in logits.items()}
    expected = {"effects/clean/loss": float(-p["clean"][np.arange(len(y)), y].mean())}
    for name in ("zero", "steer"):
        expected[f"effects/{name}/loss"] = float(-p[name][np.arange(len(y)), y].mean())
        kl = (np.exp(p["clean"]) * (p["clean"] - p[name])).sum(-1)
        expected[f"effects/{name}/kl"] = float(kl.mean())
    return expected


def trainer(callback: pl.Callback) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback])  # fmt: skip


@pytest.mark.parametrize("case", ["input", "buffer"])
def test_a_model_writing_in_place_validates_with_the_callback_as_alone(case: str):
    loader = DataLoader(data(), batch_size=3)
    trainer(pl.Callback()).validate(Net(case), loader, verbose=False)  # alone: it validates
    effects = InterventionEffects(variants())
    trainer(effects).validate(Net(case), loader, verbose=False)
    expected = truth(case)
    assert effects.last_values.keys() == expected.keys()
    for name, value in expected.items():
        assert effects.last_values[name] == pytest.approx(value, rel=1e-12), name
    assert effects.last_values["effects/zero/kl"] > 1e-3
    assert effects._runner is not None and effects._runner.fallbacks == []  # still shared


class TakesTheBatch(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 5)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.layer(batch["x"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch)


def test_a_forward_that_takes_the_batch_is_named_with_the_fix():
    loader = DataLoader([{"x": x, "y": y} for x, y in data()], batch_size=3)
    effects = InterventionEffects({"zero": [Zero("layer", kind="inputs")]})
    with pytest.raises(TypeError, match=r"pl_module\(\*\*batch\).*`forward=`.*`output=`") as error:
        trainer(effects).validate(TakesTheBatch(), loader, verbose=False)
    assert "unexpected keyword argument 'x'" in str(error.value.__cause__)
    fixed = InterventionEffects(
        {"zero": [Zero("layer", kind="inputs")]},
        forward=lambda module, batch: module(batch),
        loss=lambda logits, batch: torch.nn.functional.cross_entropy(
            logits.double(), batch["y"], reduction="none"
        ),
    )
    trainer(fixed).validate(TakesTheBatch(), loader, verbose=False)
    assert fixed.last_values["effects/zero/kl"] > 0
