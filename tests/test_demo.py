"""The demo on a reduced budget, and the probe figures sent to TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.demo import PENULTIMATE, run, summary
from lightning_iocatch import FeatureStore, IOCaptureCallback
from lightning_iocatch.probes import LayerCKA, LinearProbe
from tests.lightning_models import TinyModule, loader, trainer
from tests.tensorboard_events import events

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_trains_probes_dumps_and_draws(tmp_path: Path) -> None:
    result = run(epochs=8, out=tmp_path)
    assert result.probe_acc["net.layers.3"] > 0.9  # the last hidden layer, held out
    assert result.feature_classifier_acc > 0.9
    for figure in (tmp_path / "probe_by_layer.png", tmp_path / "cka.png"):
        data = figure.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
    store = FeatureStore(tmp_path / "features")
    assert len(store) == result.dataset_size == 1797
    assert store.duplicated_indices() == [] and store.missing_indices(1797) == []
    assert store.keys() == [f"{PENULTIMATE}/outputs"]
    text = summary(result)
    assert "net.layers.3" in text and "1797 of 1797 rows" in text


def tensorboard_tags(directory: Path) -> set[str]:
    """Tags of image summaries in TensorBoard event files, read without TensorBoard."""
    return {
        value.tag
        for event in events(directory)
        for value in event.summary.value
        if value.HasField("image")
    }


def test_probe_figures_go_to_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger

    probes = [LinearProbe(lambda batch: (batch[1] > 0).long(), num_classes=2), LayerCKA()]
    callback = IOCaptureCallback("outputs[model.layers.*]", probes=probes)
    run_ = trainer([callback], max_epochs=2, logger=TensorBoardLogger(tmp_path))
    run_.fit(TinyModule(), loader(16, 8), loader(40, 8, seed=2))
    assert tensorboard_tags(tmp_path) == {"iocatch/probe_by_layer", "iocatch/cka"}
    assert torch.isfinite(run_.callback_metrics["iocatch/model.layers.0/outputs/probe_acc"])
