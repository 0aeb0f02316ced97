"""Figures of the probes: held-out probe accuracy by layer across epochs, and a CKA heatmap.

They read a table of logged values, ``{name: [(epoch, value), ...]}``, as written by
Lightning's ``CSVLogger`` (:func:`read_metrics_csv`) or kept by the probes themselves.
matplotlib is an optional dependency: ``pip install 'lightning-iocatch[plot]'``.

Figures are drawn with matplotlib's object API (``matplotlib.figure.Figure``), never
through pyplot: drawing or saving them leaves the process's backend (a notebook's
inline backend, say) as it was, and they need no closing.
"""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

__all__ = [
    "cka_heatmap",
    "close_figure",
    "probe_by_layer",
    "read_metrics_csv",
    "save_probe_figures",
]

History = dict[str, list[tuple[int, float]]]
_PROBE = re.compile(r"^iocatch/(?!cka/)(.+)/(\w+)_(acc|r2)$")
_CKA = re.compile(r"^iocatch/cka/(.+)~(.+)$")


def _new_figure(width: float, height: float) -> Figure:
    """A figure of the ``Figure`` API: no pyplot, so the process's backend is never touched."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "plotting needs matplotlib: pip install 'lightning-iocatch[plot]'"
        ) from error
    return Figure(figsize=(width, height))


def _colormap(name: str) -> Colormap:
    import matplotlib

    return matplotlib.colormaps[name]


def _natural(text: str) -> list[Any]:
    """Sort key that puts ``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def read_metrics_csv(path: str | os.PathLike[str]) -> History:
    """``{name: [(epoch, value), ...]}`` of every ``iocatch/`` column of a CSVLogger file.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> _ = path.write_text("epoch,step,iocatch/a/outputs/probe_acc\\n0,9,0.5\\n1,19,0.75\\n")
        >>> read_metrics_csv(path)
        {'iocatch/a/outputs/probe_acc': [(0, 0.5), (1, 0.75)]}
    """
    history: History = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            epoch = row.get("epoch") or "0"
            for name, value in row.items():
                if name and name.startswith("iocatch/") and value not in ("", None):
                    history.setdefault(name, []).append((int(float(epoch)), float(value)))
    if not history:
        raise ValueError(f"{path} holds no iocatch/ metrics; was the CSVLogger used with probes?")
    return history


def _probe_table(history: History) -> tuple[list[str], list[int], dict[tuple[str, int], float]]:
    table: dict[tuple[str, int], float] = {}
    for name, points in history.items():
        match = _PROBE.match(name)
        if match:
            for epoch, value in points:
                table[(match.group(1), epoch)] = value
    layers = sorted({layer for layer, _ in table}, key=_natural)
    epochs = sorted({epoch for _, epoch in table})
    return layers, epochs, table


def probe_by_layer(history: History) -> Figure:
    """Held-out probe score of every captured tensor (x) for every epoch (one line each)."""
    layers, epochs, table = _probe_table(history)
    if not layers:
        raise ValueError("no probe_acc or probe_r2 values to plot (no LinearProbe was logged)")
    figure = _new_figure(max(5.0, 0.9 * len(layers) + 2), 4)
    axes = figure.add_subplot()
    colours = _colormap("viridis")
    for number, epoch in enumerate(epochs):
        values = [table.get((layer, epoch), math.nan) for layer in layers]
        colour = colours(number / max(1, len(epochs) - 1))
        axes.plot(range(len(layers)), values, marker="o", color=colour, label=f"epoch {epoch}")
    axes.set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    axes.set_ylabel("held-out probe score")
    axes.set_title("Linear probe by layer")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2 if len(epochs) > 6 else 1)
    figure.tight_layout()
    return figure


def cka_heatmap(history: History, epoch: int | None = None) -> Figure:
    """Linear CKA between every pair of captured tensors, at ``epoch`` (default: the last)."""
    pairs: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for name, points in history.items():
        match = _CKA.match(name)
        if match:
            pairs[(match.group(1), match.group(2))] = points
    if not pairs:
        raise ValueError("no iocatch/cka/ values to plot (no LayerCKA was logged)")
    last = max(e for points in pairs.values() for e, _ in points) if epoch is None else epoch
    names = sorted({n for pair in pairs for n in pair}, key=_natural)
    grid = [[1.0 if a == b else math.nan for b in names] for a in names]
    for (a, b), points in pairs.items():
        value = dict(points).get(last, math.nan)
        grid[names.index(a)][names.index(b)] = grid[names.index(b)][names.index(a)] = value
    figure = _new_figure(0.6 * len(names) + 3, 0.6 * len(names) + 2)
    axes = figure.add_subplot()
    image = axes.imshow(grid, vmin=0, vmax=1, cmap=_colormap("magma"))
    axes.set_xticks(range(len(names)), names, rotation=45, ha="right")
    axes.set_yticks(range(len(names)), names)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not math.isnan(value):
                colour = "black" if value > 0.6 else "white"
                axes.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    figure.colorbar(image, ax=axes, label="linear CKA")
    axes.set_title(f"Layer similarity (CKA), epoch {last}")
    figure.tight_layout()
    return figure


def close_figure(figure: Figure) -> None:
    """Release a figure drawn here: nothing to do, kept for callers that pair draw and close.

    The figures are plain ``matplotlib.figure.Figure`` objects that pyplot never saw, so
    no figure manager holds them; they are freed like any object once unreferenced.
    """


def save_probe_figures(history: History, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``probe_by_layer.png`` and ``cka.png`` (those the history has data for)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("probe_by_layer.png", probe_by_layer), ("cka.png", cka_heatmap)):
        try:
            figure = draw(history)
        except ValueError:
            continue
        figure.savefig(out / name, dpi=120)
        close_figure(figure)
        written.append(out / name)
    if not written:
        raise ValueError("nothing to plot: no LinearProbe or LayerCKA values in the metrics")
    return written
