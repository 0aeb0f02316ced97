"""plots.py: figures drawn without pyplot, so the process's matplotlib backend never changes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure
from matplotlib.image import imread

from lightning_iocatch.plots import (
    cka_heatmap,
    close_figure,
    probe_by_layer,
    save_probe_figures,
)

ROOT = Path(__file__).resolve().parents[1]
HISTORY = {
    "iocatch/layers.0/outputs/probe_acc": [(0, 0.5), (1, 0.6)],
    "iocatch/layers.1/outputs/probe_acc": [(0, 0.7), (1, 0.9)],
    "iocatch/cka/layers.0/outputs~layers.1/outputs": [(0, 0.4), (1, 0.3)],
}

# Run in a fresh interpreter: the backend is process state that other tests may have set.
DRAW_UNDER_BACKEND = """
import json, sys
import matplotlib
matplotlib.use(sys.argv[1])
from lightning_iocatch.plots import cka_heatmap, close_figure, probe_by_layer, save_probe_figures
history = json.loads(sys.argv[2])
before = matplotlib.get_backend()
for draw in (probe_by_layer, cka_heatmap):
    figure = draw(history)
    figure.savefig(sys.argv[3] + "/" + draw.__name__ + ".png")
    close_figure(figure)
written = [str(p) for p in save_probe_figures(history, sys.argv[3] + "/saved")]
print(json.dumps({
    "before": before,
    "after": matplotlib.get_backend(),
    "pyplot_imported": "matplotlib.pyplot" in sys.modules,
    "written": written,
}))
"""


def assert_png_with_content(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.05, f"{path} is blank"


@pytest.mark.parametrize("backend", ["svg", "pdf"])
def test_drawing_and_saving_leave_the_backend_as_it_was(backend: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", DRAW_UNDER_BACKEND, backend, json.dumps(HISTORY), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["before"] == report["after"] == backend
    assert not report["pyplot_imported"]
    for name in ("probe_by_layer.png", "cka_heatmap.png"):
        assert_png_with_content(tmp_path / name)
    saved = tmp_path / "saved"
    assert sorted(report["written"]) == [str(saved / "cka.png"), str(saved / "probe_by_layer.png")]
    for name in ("probe_by_layer.png", "cka.png"):
        assert_png_with_content(saved / name)


def test_figures_are_plain_figures_that_pyplot_does_not_manage() -> None:
    for figure in (probe_by_layer(HISTORY), cka_heatmap(HISTORY, epoch=0)):
        assert type(figure) is Figure
        assert figure.canvas.manager is None  # no pyplot figure manager holds it
        close_figure(figure)  # a documented no-op; the figure stays usable
        assert figure.axes


def test_tensorboard_renders_a_figure_that_pyplot_never_saw(tmp_path: Path) -> None:
    tensorboardx = pytest.importorskip("tensorboardX")
    figure = probe_by_layer(HISTORY)
    image = tensorboardx.utils.figure_to_image(figure, close=False)
    width, height = figure.get_size_inches() * figure.dpi
    assert image.shape == (3, round(height), round(width)) and image.std() > 5
    writer = tensorboardx.SummaryWriter(str(tmp_path))
    writer.add_figure("iocatch/probe_by_layer", figure, 0, close=False)  # as probe_sink.py does
    close_figure(figure)
    writer.close()
    assert any(path.stat().st_size > 1000 for path in tmp_path.glob("events.out.tfevents.*"))


def test_nothing_to_draw_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no probe_acc or probe_r2"):
        probe_by_layer({"iocatch/cka/a~b": [(0, 0.5)]})
    with pytest.raises(ValueError, match="no iocatch/cka/"):
        cka_heatmap({"iocatch/a/outputs/probe_acc": [(0, 0.5)]})
    with pytest.raises(ValueError, match="nothing to plot"):
        save_probe_figures({}, tmp_path)
