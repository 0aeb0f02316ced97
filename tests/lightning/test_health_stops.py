"""ActivationMonitor stops before the damage: a raise leaves the model as it was before the
step, the records name the samples that went non-finite, and the watched batches are those
whose optimizer steps contain a multiple of ``every_n_steps``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch.lightning.health_monitor import ActivationMonitor, NonFiniteError
from lightning_iocatch.probes.health import HealthFigures, health_statistics
from tests.lightning.health_truth import (
    BLOCKS,
    SPEC,
    WIDTH,
    Recorder,
    Regression,
    dataset,
    figures,
    loader,
    trainer,
)


class NanAt(Regression):
    """Block 1 turns the rows ``rows`` of the batch starting at optimizer step ``step`` into
    NaN (in its forward, so the loss, the gradients and an applied update are NaN too)."""

    def __init__(self, step: int, rows: list[int] | None = None, micro: int = 0) -> None:
        super().__init__(lr=0.1)
        self.step, self.rows, self.micro = step, rows, micro
        self.model.layers[1].register_forward_hook(self._poison)
        self.batches_of_step = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batches_of_step = batch_idx % max(self.trainer.accumulate_grad_batches, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[:2], batch_idx)  # (x, y[, index])

    def _poison(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step != self.step or self.batches_of_step != self.micro:
            return output
        poisoned = output.clone()
        poisoned[self.rows if self.rows is not None else slice(None)] = float("nan")
        return poisoned


class Snapshot(pl.Callback):
    """The parameters when each batch starts (before the monitor's hooks run)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.at.setdefault(
            trainer.global_step,
            {name: p.detach().clone() for name, p in module.named_parameters()},
        )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_raise_leaves_the_model_as_it_was_before_the_step(accumulate: int) -> None:
    """The NaN of step 2 (of its first micro-batch under accumulation) is raised before the
    optimizer applies the step: every parameter is finite and equal to its value when the
    step began, and the step is not counted."""
    model = NanAt(step=2)
    snapshot = Snapshot()
    monitor = ActivationMonitor(SPEC, every_n_steps=1, on_nonfinite="raise", tokens=None)
    fit = trainer([snapshot, monitor], max_steps=5, accumulate_grad_batches=accumulate)
    with pytest.raises(NonFiniteError, match=r"step 2.*'model.layers.1/outputs'"):
        fit.fit(model, loader(40, 4))
    assert fit.global_step == 2
    for name, value in model.named_parameters():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value.detach(), snapshot.at[2][name]), name
    assert not torch.equal(snapshot.at[2]["model.head.weight"], snapshot.at[0]["model.head.weight"])
    assert [step for step, _ in monitor.history] == [0, 1, 2]
    assert monitor.history[2][1]["health/model.layers.1/outputs/nonfinite"] == 4 * WIDTH
    assert fit.callback_metrics["health/model.layers.1/outputs/nonfinite"] == 4 * WIDTH
    assert monitor._session is None and monitor._vectors == {}


@pytest.mark.parametrize(
    ("rows", "micro", "expected"),
    [
        ([1], 0, [9]),  # batch 2 of 4 samples: samples 8..11
        ([0, 3], 0, [8, 11]),
        ([2], 1, [14]),  # under accumulation of 2: the second micro-batch's samples 12..15
    ],
)
def test_the_record_keeps_the_samples_that_went_nonfinite(
    rows: list[int], micro: int, expected: list[int]
) -> None:
    model = NanAt(step=1 if micro else 2, rows=rows, micro=micro)
    monitor = ActivationMonitor(
        SPEC, every_n_steps=1, tokens=None, indices=lambda batch: batch[2].tolist()
    )
    x, y = dataset(40).tensors
    data = DataLoader(TensorDataset(x, y, torch.arange(40)), batch_size=4)
    with pytest.warns(UserWarning, match=r"'model.layers.1/outputs'"):
        trainer([monitor], max_steps=3, accumulate_grad_batches=2 if micro else 1).fit(model, data)
    assert monitor.nonfinite[0]["indices"] == expected


class Unbatched(NanAt):
    """Runs the batch as one sequence (a leading dimension of 1): rows are not samples."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        return ((self.model(x[None]).squeeze(0) - y) ** 2).sum()


def test_the_whole_batch_is_kept_when_rows_cannot_be_told() -> None:
    """A value whose first dimension is not the batch's samples: every index is kept."""
    monitor = ActivationMonitor(
        "outputs[model.layers.*]", every_n_steps=1, tokens=None, indices=lambda b: b[2].tolist()
    )
    x, y = dataset(12).tensors
    data = DataLoader(TensorDataset(x, y, torch.arange(12)), batch_size=4)
    with pytest.warns(UserWarning, match=r"'model.layers.1/outputs'"):
        trainer([monitor], max_steps=2).fit(Unbatched(step=1, rows=[0]), data)
    assert monitor.nonfinite[0]["indices"] == [4, 5, 6, 7]


def test_dead_frac_of_a_key_without_a_finite_value_is_one() -> None:
    """Every value NaN or inf: every unit is zero (or not finite) on every row."""
    x = torch.full((5, 4), float("nan"))
    x[0, 1] = float("inf")
    found = HealthFigures.of(health_statistics(x))
    by_hand = sum(all(not torch.isfinite(v) or v == 0 for v in x[:, u]) for u in range(4)) / 4
    assert by_hand == 1.0
    assert found.dead_fraction == by_hand
    assert found.count == 0 and found.nan == 19 and found.inf == 1
    assert HealthFigures.of(health_statistics(torch.zeros(0, 4))).dead_fraction != 1.0  # empty


def test_dead_frac_of_an_all_nan_step_is_one_in_training() -> None:
    model = NanAt(step=1)
    monitor = ActivationMonitor("outputs[model.layers.1]", every_n_steps=1, tokens=None)
    with pytest.warns(UserWarning, match="step 1"):
        trainer([monitor], max_steps=2).fit(model, loader(8, 4))
    logged = monitor.history[1][1]
    assert logged["health/model.layers.1/outputs/dead_frac"] == 1.0
    assert logged["health/model.layers.1/outputs/nonfinite"] == 4 * WIDTH


class TwoSteps(Regression):
    """Manual optimization: two optimizer steps per batch (on its halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        for half in (slice(0, 2), slice(2, 4)):
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(((self.model(x[half]) - y[half]) ** 2).sum())
            optimizer.step()  # type: ignore[union-attr]


def test_two_optimizer_steps_a_batch_watch_the_multiples_of_n() -> None:
    """Batches start at steps 0, 2, 4, ...; with N = 3 those holding steps 0, 3, 6, 9 (the
    batches from 0, 2, 6, 8) are watched and logged at those steps, with their figures
    (NumPy of plain hooks' records, filed under the step each batch began at)."""
    monitor = ActivationMonitor("outputs[model.layers.*]", every_n_steps=3, tokens=None)
    trainer([monitor], max_steps=12).fit(TwoSteps(), loader(40, 4))
    recorder = Recorder()
    trainer([recorder], max_steps=12).fit(TwoSteps(), loader(40, 4))
    assert [step for step, _ in monitor.history] == [0, 3, 6, 9]
    for (step, logged), start in zip(monitor.history, [0, 2, 6, 8], strict=True):
        for block in BLOCKS:  # the second half's forward is the blocks' second call
            halves = recorder.seen[start][f"{block}/outputs"]
            for key, arrays in (
                (f"{block}/outputs", halves[:1]),
                (f"{block}/outputs@1", halves[1:]),
            ):
                for name, value in figures(arrays).items():
                    got = logged[f"health/{key}/{name}"]
                    assert got == pytest.approx(value, rel=1e-9, nan_ok=True), (step, key, name)


@pytest.mark.parametrize("value", [True, False])
def test_every_n_steps_refuses_a_bool(value: bool) -> None:
    with pytest.raises(ValueError, match=rf"`every_n_steps` must be a positive integer.*{value}"):
        ActivationMonitor(SPEC, every_n_steps=value)


class OneOrTwoSteps(Regression):
    """Manual optimization whose batches take 1, 2, 1, 2, ... optimizer steps (a second
    optimizer steps on every other batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.model.layers.parameters(), lr=0.01),
            torch.optim.SGD(self.model.head.parameters(), lr=0.01),
        ]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        x, y = batch
        self.manual_backward(((self.model(x) - y) ** 2).sum())
        first.step()
        first.zero_grad()
        if batch_idx % 2 == 1:
            second.step()
            second.zero_grad()


def test_batches_of_varying_steps_log_each_step_once_and_in_order() -> None:
    """Batches start at steps 0, 1, 3, 4, 6, 7, 9, 10 (1, 2, 1, 2 steps); with N = 2 every
    logged step is logged once, in order, none before the step it stands for (the batch
    from 1 holds step 2 but the last batch foretold one step: the next batch, from 3, is
    watched and logged at 3)."""
    monitor = ActivationMonitor(SPEC, every_n_steps=2, tokens=None)
    trainer([monitor], max_epochs=1, limit_train_batches=8).fit(OneOrTwoSteps(), loader(64, 4))
    steps = [step for step, _ in monitor.history]
    assert steps == sorted(set(steps)) == [0, 3, 4, 6, 9, 10]
