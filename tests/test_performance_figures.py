"""The performance page's plot shows the figures its table prints.

``benchmarks/report.py`` draws ``docs/images/performance-bench.png`` from the rows it
records in ``benchmarks/recorded.json``; the page collapses the table ``make bench``
printed. This test parses that markdown table (the medians, mins and maxes as printed)
and checks the recorded rows against it, so a rerun that updates one and not the other
fails here instead of showing a plot that disagrees with the numbers under it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPREAD = re.compile(r"([\d.]+)x \(([\d.]+) to ([\d.]+)\)")


def printed_spreads() -> list[tuple[float, float, float]]:
    """Every ``median (min to max)`` of the ``make bench`` table, in reading order."""
    spreads: list[tuple[float, float, float]] = []
    page = (ROOT / "docs" / "performance.md").read_text()
    start = page.index("| measurement | median (min to max) | target |")
    table = page[start : page.index("\n\n", start)]
    for line in table.splitlines()[2:]:
        cells = line.strip().strip("|").split("|")
        if "peak RSS" in cells[0]:
            continue  # not a ratio, not in the plot
        # "a / b / c" for the three models; the first spread of each (a second, in
        # parentheses, is a share of the network for comparison)
        for part in cells[1].split(" / "):
            match = SPREAD.match(part.strip())
            assert match, f"no spread in {part!r}"
            spreads.append((float(match[1]), float(match[2]), float(match[3])))
    return spreads


def test_the_plotted_rows_are_the_printed_table() -> None:
    recorded = json.loads((ROOT / "benchmarks" / "recorded.json").read_text())
    rows = recorded["make bench"]["rows"]
    plotted = [(r["median"], r["min"], r["max"]) for r in rows]
    assert plotted == printed_spreads()
    targets = {r["label"]: r.get("at_most", r.get("at_least")) for r in rows}
    assert targets["idle catcher, GPT-2"] == 1.01  # the table's "≤ 1.01x"
    assert targets["armed catcher, GPT-2"] == 1.03
    assert targets["FeatureWriter throughput / save_file+fsync"] == 0.8
    # early exit: the share of the network run (0.087 in the table) plus 0.03
    assert targets["early exit after h.0 (target on the median)"] == 0.117


def test_each_plot_is_small_enough_for_the_site() -> None:
    for name in ("performance-bench.png", "performance-tokens.png", "probe-by-layer.png"):
        assert (ROOT / "docs" / "images" / name).stat().st_size < 150_000, name
