"""ActivationMonitor under ``16-mixed`` (a GradScaler, on the CPU) and across a resume.

The truth of the float16 tests: plain hooks in the same run (:class:`Recorder`) record the
gradients the backward sees (those of the scaled loss) and a callback reads the scale of
each backward with the scaler's public ``get_scale()``; NumPy divides the recorded
gradients by that scale in float64. The scaler grows its scale after every step
(``growth_interval=1``), so a scale read after the scaler's update would be off by 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from lightning_iocatch.probes.health import EDGES
from tests.lightning.health_truth import (
    SPEC,
    Calls,
    Recorder,
    Regression,
    figures,
    loader,
    trainer,
)


class Scales(pl.Callback):
    """The scale of each step's backward, and after its batch (after the scaler's update),
    read with the scaler's public (syncing) API."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.after: dict[int, float] = {}

    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: torch.Tensor) -> None:
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        self.at[trainer.global_step] = scaler.get_scale()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *rest: Any) -> None:
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        self.after[trainer.global_step - 1] = scaler.get_scale()

    def skipped(self, step: int) -> bool:
        """The scaler skips a step with a non-finite gradient and lowers its scale."""
        return self.after[step] < self.at[step]


def fp16(init_scale: float) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def true_figures(recorder: Recorder, scales: Scales, step: int) -> dict[str, float]:
    """NumPy float64 figures of a step: outputs as recorded, gradients divided by the scale."""
    found = {}
    for key, arrays in recorder.seen[step].items():
        divisor = scales.at[step] if "/grad_" in key else 1.0
        for name, value in figures([a / divisor for a in arrays]).items():
            found[f"health/{key}/{name}"] = value
    return found


def assert_close(logged: dict[str, float], truth: dict[str, float]) -> None:
    assert set(truth) <= set(logged)
    for name, value in truth.items():
        if math.isnan(value):
            assert math.isnan(logged[name]), name
        else:
            assert logged[name] == pytest.approx(value, rel=1e-9, abs=1e-15), name


class Histograms(Calls):
    """A logger whose experiment takes raw histograms (as TensorBoard's does): tag, step ->
    the bucket counts."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, int], list[float]] = {}
        self.rest: dict[tuple[str, int], dict[str, Any]] = {}  # min, max, num, sum, ...

    @property
    def experiment(self) -> Any:
        return self

    def add_histogram_raw(self, *, tag: str, bucket_counts: list[float], global_step: int,
                          **rest: Any) -> None:  # fmt: skip
        self.found[(tag, global_step)] = list(bucket_counts)
        self.rest[(tag, global_step)] = rest


def test_gradients_under_a_grad_scaler_are_the_true_gradients() -> None:
    monitor = ActivationMonitor(SPEC, every_n_steps=2, tokens=None, on_nonfinite="raise")
    binned = ActivationMonitor(SPEC, every_n_steps=2, tokens=None, histograms=True, prefix="h")
    recorder, scales, logger = Recorder(), Scales(), Histograms()
    run = trainer(
        [recorder, scales, monitor, binned], plugins=[fp16(256.0)], max_epochs=2, logger=logger
    )
    run.fit(Regression(), loader(8, 2))  # 8 steps, 0, 2, 4, 6 watched
    assert [step for step, _ in binned.history] == [0, 2, 4, 6]
    for step, logged in binned.history:  # with histograms: the values divided, then binned
        truth = true_figures(recorder, scales, step)
        assert_close({k.replace("h/", "health/", 1): v for k, v in logged.items()}, truth)
        for key, arrays in recorder.seen[step].items():
            values = np.abs(np.concatenate(arrays) / (scales.at[step] if "grad" in key else 1))
            places = np.searchsorted(EDGES, values.ravel(), side="right")
            expected = np.bincount(places, minlength=len(EDGES) + 1).tolist()
            assert logger.found[(f"h/{key}/abs", step)] == expected, (step, key)
            rest = logger.rest[(f"h/{key}/abs", step)]  # TensorBoard's figures of |x|
            assert rest["sum"] == pytest.approx(values.sum(), rel=1e-12)
            assert rest["sum_squares"] == pytest.approx((values**2).sum(), rel=1e-9)
            assert (rest["max"], rest["num"]) == (pytest.approx(values.max()), values.size)
            edges = [0.0, *EDGES]  # the lower edge of the first non-empty count: a bound
            first = edges.index(rest["min"])
            assert expected[first] and not any(expected[:first])
            assert edges[first] <= values.min() < [*EDGES, math.inf][first]
    assert [scales.at[s] for s in (0, 1, 2)] == [256.0, 512.0, 1024.0]  # grows every step
    assert recorder.seen[0]["model.layers.0/outputs"][0].dtype == np.float64  # (recorded)
    assert [step for step, _ in monitor.history] == [0, 2, 4, 6]
    for step, logged in monitor.history:
        assert_close(logged, true_figures(recorder, scales, step))
        assert logged["health/grad_overflow"] == 0.0
    # the scaled gradients' figures would differ by the scale: the division was needed
    scaled = figures(recorder.seen[2]["model.layers.0/grad_outputs"])
    assert monitor.history[1][1]["health/model.layers.0/grad_outputs/rms"] == pytest.approx(
        scaled["rms"] / 1024.0, rel=1e-9
    )


def test_an_overflow_the_scaler_skips_is_logged_not_raised() -> None:
    """A scale of 2**16 makes some float16 gradients infinite on step 0: the scaler skips
    it and halves its scale. The monitor logs the infinite counts (as NumPy counts them in
    what the backward saw) and raises nothing, though ``on_nonfinite="raise"``. On step 1
    only a weight's gradient overflows (no watched one): the scaler skips it too, and
    ``grad_overflow`` says so (it is read from the scaler, not from the watched values)."""
    monitor = ActivationMonitor(SPEC, every_n_steps=1, tokens=None, on_nonfinite="raise")
    recorder, scales = Recorder(), Scales()
    trainer([recorder, scales, monitor], plugins=[fp16(2.0**16)], max_steps=3).fit(
        Regression(), loader(8, 2)
    )
    # step 0 skipped (its watched gradients overflowed), step 1 too (a weight's gradient did)
    assert [scales.at[s] for s in (0, 1, 2)] == [2.0**16, 2.0**15, 2.0**14]
    assert monitor.nonfinite == []
    overflowed, watched_bad = [], []
    for step, logged in monitor.history:
        truth = true_figures(recorder, scales, step)
        assert_close(logged, truth)
        assert all(value == 0 for k, value in truth.items() if k.endswith("/outputs/nonfinite"))
        bad = sum(value for k, value in truth.items() if k.endswith("grad_outputs/nonfinite"))
        watched_bad.append(bad > 0)
        overflowed.append(logged["health/grad_overflow"])
        assert overflowed[-1] == float(scales.skipped(step)), step
    assert watched_bad == [True, False, False]  # step 1: only a weight's gradient overflowed
    assert overflowed == [1.0, 1.0, 0.0]


class Probed(Regression):
    """Regression with a parameterless probe outside the loss that turns NaN on step 1."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = nn.Identity()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        self.probe(x * float("nan") if self.trainer.global_step == 1 else x)
        return super().training_step(batch, batch_idx)


def test_a_resumed_fit_watches_its_first_step_and_continues_the_history(tmp_path: Path) -> None:
    spec = "outputs[model.layers.*|probe]"
    first = ActivationMonitor(spec, every_n_steps=1, tokens=None)  # the same state key
    run = trainer([first], max_steps=3, max_epochs=3)
    with pytest.warns(UserWarning, match=r"step 1.*'probe/outputs'"):
        run.fit(Probed(), loader(8, 2))
    run.save_checkpoint(tmp_path / "mid.ckpt")  # at step 3, mid-epoch (4 batches an epoch)
    assert [step for step, _ in first.history] == [0, 1, 2]

    resumed = ActivationMonitor(spec, every_n_steps=5, tokens=None, history_size=4)
    recorder = Recorder([*[f"model.layers.{i}" for i in range(3)], "probe"])
    trainer([resumed, recorder], max_steps=7, max_epochs=3).fit(
        Probed(), loader(8, 2), ckpt_path=tmp_path / "mid.ckpt"
    )
    # steps 3 (the resumed fit's first) and 5 watched; the cap keeps the last 4 of 0..5
    assert [step for step, _ in resumed.history] == [1, 2, 3, 5]
    assert repr(resumed.history[:2]) == repr(first.history[1:])  # (NaN != NaN)
    for step, logged in resumed.history[2:]:
        truth = {
            f"health/{key}/{name}": value
            for key, arrays in recorder.seen[step].items()
            if "/grad_" not in key
            for name, value in figures(arrays).items()
        }
        assert_close(logged, truth)
        assert set(logged) == set(truth)
    assert resumed.nonfinite == first.nonfinite
    assert resumed.nonfinite[0]["step"] == 1 and resumed.nonfinite[0]["key"] == "probe/outputs"


class TwoSteps(Regression):
    """Manual optimization: two backwards, each followed by an optimizer step, per batch
    (the first row, then the second): the GradScaler's scale changes between them."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        for half in (slice(0, 1), slice(1, 2)):
            loss = ((self.model(x[half]) - y[half]) ** 2).sum()
            self.manual_backward(loss)
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]


class EveryScale(pl.Callback):
    """The scale of every backward of a batch, in order (public, syncing API), under the
    optimizer step the batch began at."""

    def __init__(self) -> None:
        self.at: dict[int, list[float]] = {}
        self.step = -1

    def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
        self.step = trainer.global_step

    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: torch.Tensor) -> None:
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        self.at.setdefault(self.step, []).append(scaler.get_scale())


def test_each_backward_of_a_step_is_divided_by_its_own_scale() -> None:
    """Each call's gradient is reduced with the scale of its own backward: the first
    backward's (256 on step 0) and the second's (512, after the first step's update)."""
    monitor = ActivationMonitor(SPEC, every_n_steps=2, tokens=None)
    recorder, scales = Recorder(), EveryScale()
    trainer([recorder, scales, monitor], plugins=[fp16(256.0)], max_steps=6).fit(
        TwoSteps(), loader(8, 2)
    )  # 3 batches of 2 optimizer steps; global steps 0, 2, 4 begin a batch: all watched
    assert scales.at[0] == [256.0, 512.0] and scales.at[2] == [1024.0, 2048.0]
    assert [step for step, _ in monitor.history] == [0, 2, 4]
    for step, logged in monitor.history:
        for key, arrays in recorder.seen[step].items():
            assert len(arrays) == 2  # one a backward (or a forward) of a half batch
            for call, array in enumerate(arrays):
                divisor = scales.at[step][call] if "/grad_" in key else 1.0
                name = key if call == 0 else f"{key}@{call}"
                for figure, value in figures([array / divisor]).items():
                    got = logged[f"health/{name}/{figure}"]
                    if math.isnan(value):
                        assert math.isnan(got), (step, name, figure)
                    else:
                        assert got == pytest.approx(value, rel=1e-9, abs=1e-15), (step, name)
