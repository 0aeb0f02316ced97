"""ActivationMonitor against NumPy, through real training runs.

The truth: the same training (same seeds, so the same dropout masks) without the
monitor, where a callback of plain hooks records, on the watched steps, every block's
output at the batch's real tokens and the gradient of one block's output (a tensor hook),
and NumPy computes the statistics in float64.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.health_monitor import ActivationMonitor, NonFiniteError
from lightning_iocatch.probes.health import HealthFigures, health_statistics
from tests.lightning.health_truth import figures
from tests.lightning.test_effects import LM, samples
from tests.tensorboard_events import events

BLOCKS = [f"model.transformer.h.{i}" for i in range(4)]
GRAD = "model.transformer.h.1"
SPEC = f"outputs[model.transformer.h.*]|grad_outputs[{GRAD}]"


class Trained(LM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)  # steps change the activations


class Recorder(pl.Callback):
    """Plain hooks on the watched steps: block outputs at real tokens, one gradient."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.values: dict[int, dict[str, list[np.ndarray]]] = {}
        self._handles: list[Any] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        mask = batch["attention_mask"].bool()
        found = self.values.setdefault(step, {})
        for name in BLOCKS:

            def hook(m: nn.Module, a: Any, out: Any, name: str = name) -> None:
                out = out if isinstance(out, torch.Tensor) else out[0]
                found.setdefault(f"{name}/outputs", []).append(out[mask].detach().double().numpy())
                if name == GRAD:
                    out.register_hook(
                        lambda g: found.setdefault(f"{GRAD}/grad_outputs", []).append(
                            g[mask].double().numpy()
                        )
                    )

            self._handles.append(dict(module.named_modules())[name].register_forward_hook(hook))

    def on_train_batch_end(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def fit(callbacks: list[Any], precision: str = "32-true", steps: int = 4) -> None:
    torch.manual_seed(11)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
        precision=precision, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Trained(), DataLoader(samples(8), batch_size=2))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_logged_figures_equal_numpy_over_the_watched_steps(precision: str) -> None:
    monitor = ActivationMonitor(SPEC, every_n_steps=2)
    fit([monitor], precision)
    recorder = Recorder(2)
    fit([recorder], precision)
    assert [step for step, _ in monitor.history] == [0, 2] == sorted(recorder.values)
    for step, logged in monitor.history:
        for key, parts in recorder.values[step].items():
            expected = figures(parts)
            for name, value in expected.items():
                got = logged[f"health/{key}/{name}"]
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (step, key, name)
        assert len(logged) == 6 * 5  # 4 blocks and one gradient, 6 figures each
    assert monitor.nonfinite == []


def test_two_monitors_at_once_each_log_what_it_logs_alone() -> None:
    alone = ActivationMonitor(SPEC, every_n_steps=2)
    fit([alone])
    first = ActivationMonitor(SPEC, every_n_steps=2)
    other = ActivationMonitor(
        f"outputs[{GRAD}]|grad_outputs[{GRAD}]", every_n_steps=1, prefix="other"
    )
    fit([first, other])  # both watch block 1 and its gradient on steps 0 and 2
    assert first.history == alone.history
    assert [step for step, _ in other.history] == [0, 1, 2, 3]
    assert len(other.history[0][1]) == 2 * 6  # block 1's output and gradient
    for step, logged in other.history:  # every step, under its own prefix
        mine = dict(first.history).get(step)
        for name, value in logged.items():
            assert name.startswith("other/")
            if mine is not None:
                assert value == pytest.approx(mine["health/" + name.removeprefix("other/")])


def test_statistics_count_real_rows_units_and_nonfinite_values_as_numpy() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.relu(torch.randn(3, 5, 6, generator=generator) - 0.5)
    x[..., 2] = 0.0  # a dead unit
    x[0, 1, 4] = float("nan")
    x[2, 0, 1] = float("inf")
    rows = torch.rand(3, 5, generator=generator) > 0.3
    got = HealthFigures.of(health_statistics(x, rows)).scalars()
    expected = figures([x[rows].double().numpy()])
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    assert got["dead_frac"] >= 1 / 6


class Exploding(nn.Module):
    """Gives NaN from a chosen step on (counted by the trainer's steps)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.calls > self.at else x


class Net(pl.LightningModule):
    def __init__(self, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.bad, self.last = nn.Linear(3, 4), Exploding(at), nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.last(self.bad(self.first(batch[0]))).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_the_first_nonfinite_value_is_traced_to_its_module_and_step() -> None:
    data = [(torch.randn(3), torch.tensor(i)) for i in range(12)]
    monitor = ActivationMonitor(
        "outputs[first|bad|last]|grad_outputs[first|last]",
        every_n_steps=1,
        indices=lambda batch: batch[1].tolist(),
    )
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[monitor])  # fmt: skip
    with pytest.warns(UserWarning, match=r"step 2.*'bad/outputs'"):
        trainer.fit(Net(at=2), DataLoader(data, batch_size=3))
    assert monitor.nonfinite[0] == {
        "step": 2,
        "key": "bad/outputs",
        "ranks": [0],
        "indices": [6, 7, 8],
    }
    assert monitor.history[1][1]["health/bad/outputs/nonfinite"] == 0
    assert monitor.history[2][1]["health/last/outputs/nonfinite"] == 3  # after it: NaN too
    raising = ActivationMonitor("outputs[first|bad|last]", every_n_steps=1, on_nonfinite="raise")
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[raising])  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"step 1.*'bad/outputs'"):
        trainer.fit(Net(at=1), DataLoader(data, batch_size=3))


def test_nothing_is_registered_between_watched_steps() -> None:
    added: list[int] = []

    def hooks(module: nn.Module) -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())

    class Counting(pl.Callback):  # before the monitor: it counts before the monitor arms
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            self.before = hooks(module)

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            added.append(hooks(module) - self.before)  # inside the step: its forward ran

    monitor = ActivationMonitor("outputs[model.transformer.h.*]", every_n_steps=3)
    fit([Counting(), monitor], steps=6)
    assert added == [4, 0, 0, 4, 0, 0]  # the 4 blocks' hooks on steps 0 and 3 only


def _histograms(directory: Any) -> dict[tuple[str, int], list[float]]:
    """The raw histograms of the event files under ``directory``, by tag and step."""
    return {
        (value.tag, event.step): list(value.histo.bucket)
        for event in events(directory)
        for value in event.summary.value
        if value.HasField("histo")
    }


def test_histograms_of_abs_values_reach_tensorboard(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_iocatch.probes.health import EDGES

    monitor = ActivationMonitor("outputs[model.transformer.h.0]", every_n_steps=2, histograms=True)
    recorder = Recorder(2)
    for callbacks, logger in (([monitor], TensorBoardLogger(tmp_path)), ([recorder], False)):
        torch.manual_seed(11)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=3, logger=logger, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
            num_sanity_val_steps=0, log_every_n_steps=1,
        )  # fmt: skip
        trainer.fit(Trained(), DataLoader(samples(8), batch_size=2))
    logged = _histograms(tmp_path)
    for step in (0, 2):
        rows = np.abs(np.concatenate(recorder.values[step]["model.transformer.h.0/outputs"]))
        expected = np.bincount(np.searchsorted(EDGES, rows.ravel(), side="right"), minlength=38)
        assert logged[("health/model.transformer.h.0/outputs/abs", step)] == expected.tolist()


class NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanBackward.apply(x)


class Chain(Net):
    def __init__(self) -> None:
        super().__init__(at=10**6)
        self.mid, self.bad = nn.Linear(4, 4), BadBackward()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.last(self.bad(self.mid(self.first(batch[0])))).pow(2).mean()


def test_a_nan_made_in_a_backward_is_traced_in_the_backward_order() -> None:
    """The gradient of ``bad``'s output is finite (it comes from after it); the first
    non-finite gradient the backward meets is that of ``mid``'s output."""
    data = [(torch.randn(3), torch.tensor(i)) for i in range(6)]
    monitor = ActivationMonitor(
        "outputs[first|mid|bad|last]|grad_outputs[first|mid|bad|last]", every_n_steps=1
    )
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[monitor])  # fmt: skip
    with pytest.warns(UserWarning, match=r"'mid/grad_outputs'"):
        trainer.fit(Chain(), DataLoader(data, batch_size=3))
    logged = monitor.history[0][1]
    assert logged["health/bad/grad_outputs/nonfinite"] == 0
    assert logged["health/last/grad_outputs/nonfinite"] == 0
    assert logged["health/first/grad_outputs/nonfinite"] == 12  # upstream of mid too
    assert all(logged[f"health/{m}/outputs/nonfinite"] == 0 for m in ("first", "mid", "bad"))


def test_moments_merge_exactly_with_a_large_mean() -> None:
    """Centred sums, combined pairwise: a mean of 1e4 against a spread of 1 costs no digits
    (raw power sums would cancel to nothing in the kurtosis)."""
    from lightning_iocatch.probes.health import merge_statistics

    generator = torch.Generator().manual_seed(5)
    parts = [
        1e4 + torch.randn(40 + 9 * i, 6, generator=generator, dtype=torch.float64) for i in range(4)
    ]
    vectors = torch.stack([health_statistics(part) for part in parts])
    got = HealthFigures.of(merge_statistics(vectors)).scalars()
    expected = figures([part.numpy() for part in parts])
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-9), name
