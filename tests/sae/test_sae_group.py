"""SAEGroup: several SAEs trained from the same batches end with the weights, counts and
thresholds each would have trained alone (the same batches, its own optimizer, schedule and
normalisation), log under their names, and refuse what a group cannot run."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.sae import SAEGroup, SAEModule
from tests.lightning_models import tiny_llama


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")


def _members() -> dict[str, SAEModule]:
    return {
        "topk": SAEModule(
            16, 64, "topk", k=4, key="a", lr=3e-3, normalize_batches=1, dead_after_tokens=64
        ),
        "batchtopk": SAEModule(
            16,
            48,
            "batchtopk",
            k=3.5,
            key="a",
            lr=1e-3,
            seed=1,
            lr_warmup_steps=3,
            lr_decay_steps=3,
            total_steps=15,
        ),
        "relu": SAEModule(
            8, 32, "relu", key="b", lr=3e-3, sparsity_coefficient=0.01, sparsity_warmup_steps=4
        ),
    }


def _data() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(7)
    a = torch.randn(512, 16, generator=generator) @ torch.randn(16, 16, generator=generator)
    b = torch.randn(512, 8, generator=generator).relu()
    rows = [{"a": a[i : i + 64], "b": b[i : i + 64]} for i in range(0, 512, 64)]
    return DataLoader(rows * 2, batch_size=None), DataLoader(rows[:2], batch_size=None)


def _fit(module: pl.LightningModule) -> pl.Trainer:
    train, val = _data()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=4,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train, val)
    return trainer


def _state(module: SAEModule) -> dict[str, Any]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def test_a_group_trains_each_member_as_it_would_train_alone() -> None:
    group = SAEGroup(_members())
    trainer = _fit(group)
    for name, alone in _members().items():
        _fit(alone)
        together = group.members[name]
        mine, theirs = _state(together), _state(alone)  # type: ignore[arg-type]
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (name, key)
    assert int(group.members["topk"].steps) == 15 and int(group.members["relu"].steps) == 16
    logged = trainer.callback_metrics
    assert {"topk/train/mse", "batchtopk/val/l0", "relu/train/l1_loss"} <= set(logged)


def test_a_group_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        SAEGroup({})
    with pytest.raises(TypeError, match="not an SAEModule"):
        SAEGroup({"a": torch.nn.Linear(2, 2)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="plain words"):
        SAEGroup({"a/b": SAEModule(4, 8, "topk", k=2)})
    evaluated = SAEModule(32, 64, "topk", k=4, language_model=tiny_llama(), layer="model.layers.1")
    with pytest.raises(ValueError, match="train it alone for that"):
        SAEGroup({"a": evaluated})
