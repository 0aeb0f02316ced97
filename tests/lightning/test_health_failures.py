"""ActivationMonitor when a step fails, and where it cannot give true gradient figures."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision

from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from tests.lightning.health_truth import SPEC, Regression, loader, trainer


class Boom(Regression):
    """Fails after the forward of step 2 (watched), before its backward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 2:
            raise RuntimeError("boom")
        return loss


def test_an_exception_mid_step_is_the_only_news() -> None:
    """The gradient sites of the failed step are dropped without the "no backward reached
    the gradients" warning (the backward never ran because of the exception), every hook
    is removed, and nothing of the step is left for a later fit."""
    model, monitor = Boom(), ActivationMonitor(SPEC, every_n_steps=2, tokens=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom"):
            trainer([monitor], max_steps=5).fit(model, loader(16, 2))
    assert not [w for w in caught if "no backward reached" in str(w.message)]
    assert [step for step, _ in monitor.history] == [0]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hooks == 0 and monitor._session is None and monitor._vectors == {}


class _DeepSpeedTrainer:
    """What the monitor reads of a Trainer under DeepSpeed (which needs CUDA to run)."""

    def __init__(self, precision: str) -> None:
        self.precision_plugin = DeepSpeedPrecision(precision)  # type: ignore[arg-type]
        self.global_rank, self.world_size = 0, 1


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_gradients_under_deepspeed_float16_are_refused(precision: str) -> None:
    """DeepSpeed scales float16 losses in its engine, without a GradScaler: the gradients
    seen would be those of the scaled loss, so watching them is refused at fit start;
    outputs alone, or bf16, are watched."""
    monitor = ActivationMonitor(SPEC, tokens=None)
    with pytest.raises(ValueError, match=r"DeepSpeed.*scaled loss.*outputs or inputs only"):
        monitor.on_fit_start(_DeepSpeedTrainer(precision), Regression())  # type: ignore[arg-type]
    outputs = ActivationMonitor("outputs[model.layers.*]")
    outputs.on_fit_start(_DeepSpeedTrainer(precision), Regression())  # type: ignore[arg-type]
    monitor.on_fit_start(_DeepSpeedTrainer("bf16-mixed"), Regression())  # type: ignore[arg-type]
