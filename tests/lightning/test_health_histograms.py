"""The monitor's W&B histograms, without wandb (not a test dependency).

What can be checked honestly without wandb: that the monitor hands Lightning's
``WandbLogger`` a ``wandb.Histogram(np_histogram=(counts, edges))`` whose pair is NumPy's
``np.histogram`` of the watched ``|x|`` (recorded by plain hooks in the same run) over
those edges, at the watched step. A stand-in ``wandb`` module records what the monitor
builds; whether wandb draws it is wandb's business and not tested here.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from lightning.pytorch.loggers import Logger, WandbLogger

from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from tests.lightning.health_truth import Recorder, Regression, loader, trainer


class Histogram:
    """Stands in for ``wandb.Histogram``: keeps what it was given."""

    def __init__(self, *, np_histogram: tuple[np.ndarray, np.ndarray]) -> None:
        self.counts, self.edges = np_histogram


class Run:
    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []

    def log(self, data: dict[str, Any]) -> None:
        self.logged.append(data)


class Wandb(WandbLogger):
    """Lightning's WandbLogger with a recording run instead of wandb's."""

    def __init__(self) -> None:
        Logger.__init__(self)  # WandbLogger's own refuses without wandb
        self._prefix, self._wandb_init, self._log_model, self._experiment = "", {}, False, None
        self.run = Run()

    @property
    def experiment(self) -> Any:
        return self.run

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return "0"

    @property
    def save_dir(self) -> None:
        return None

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_histograms_reach_wandb_as_numpy_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Histogram=Histogram))
    monitor = ActivationMonitor(
        "outputs[model.layers.*]", every_n_steps=2, tokens=None, histograms=True
    )
    logger, recorder = Wandb(), Recorder()
    trainer([recorder, monitor], logger=logger, max_steps=3).fit(Regression(), loader(8, 2))
    histograms = [data for data in logger.run.logged if any(k.endswith("/abs") for k in data)]
    assert [data["trainer/global_step"] for data in histograms] == [0, 2]
    for data in histograms:
        step = data["trainer/global_step"]
        assert len(data) == 3 + 1  # 3 blocks' histograms and the step
        for key in (f"model.layers.{i}/outputs" for i in range(3)):
            found = data[f"health/{key}/abs"]
            values = np.abs(np.concatenate(recorder.seen[step][key])).ravel()
            counts, _ = np.histogram(values, bins=found.edges)
            assert found.counts.tolist() == counts.tolist(), (step, key)
            assert len(found.edges) == len(found.counts) + 1 and found.edges[0] == 0
            assert found.edges[-1] > values.max()
            assert int(found.counts.sum()) == values.size
