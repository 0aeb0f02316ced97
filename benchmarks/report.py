"""Run every CPU benchmark and print the performance table of docs/performance.md (markdown).

    python benchmarks/report.py            # about 4 minutes on 2 cores
    python benchmarks/report.py --quick    # smoke test
    python benchmarks/report.py --replot   # only redraw the figures from the recorded rows

Each benchmark runs in its own process and prints JSON; this script only formats it. It
also records each ratio (median, min, max, target) under "make bench" in
benchmarks/recorded.json and draws every group of that file into
docs/images/performance-{group}.png: medians and spreads against their targets. Groups
other than "make bench" (the SAELens comparison of `make bench-tokens`) are transcribed
there by hand from the tables their own benchmarks print.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "recorded.json"
IMAGES = HERE.parent / "docs" / "images"


def run(script: str, quick: bool) -> dict:
    command = [sys.executable, str(HERE / script), *(["--quick"] if quick else [])]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def spread(r: dict) -> str:
    """``median (min to max)`` of a ratio, as the table prints it."""
    return f"{r['median']:.3f}x ({r['min']:.3f} to {r['max']:.3f})"


def state(r: dict, at_most: float | None = None, at_least: float | None = None) -> str:
    """Meets only when the whole spread is on the right side; straddling is said so."""
    low, high = r["min"], r["max"]
    if at_most is not None:
        ok, miss = high <= at_most, low > at_most
    else:
        assert at_least is not None
        ok, miss = low >= at_least, high < at_least
    return "meets" if ok else "misses" if miss else "spread straddles it"


def verdict(
    results: list[dict], at_most: float | None = None, at_least: float | None = None
) -> str:
    target = f"≤ {at_most}x" if at_most is not None else f"≥ {at_least}x"
    return f"{target}: " + " / ".join(state(r, at_most, at_least) for r in results)


def three(results: list[dict], key: str) -> str:
    return " / ".join(spread(r[key]) for r in results)


def table(overhead: dict, predict: dict, dump: dict, probes: dict) -> str:
    models = [overhead[k] for k in ("mlp_200_layers", "model_2000_modules", "gpt2_12_blocks")]
    gpt2 = overhead["gpt2_12_blocks"]
    write = dump["write_throughput"]
    rows = [
        (
            "idle catcher (no session open), 200-layer MLP / 2,000 modules / GPT-2",
            three(models, "idle"),
            verdict([m["idle"] for m in models], at_most=1.01),
        ),
        (
            "armed catcher, 1 module, 200-layer MLP / 2,000 modules / GPT-2",
            three(models, "armed"),
            verdict([m["armed"] for m in models], at_most=1.03),
        ),
        (
            "for contrast: inert hooks on every module (the reference design)",
            three(models, "all_hooks_idle"),
            "",
        ),
    ]
    for label in ("block0", "middle", "last"):
        e = gpt2[f"early_exit_{label}"]
        rows.append(
            (
                f"early exit after `{e['block']}` of `h.0`..`h.11` (share of network run)",
                f"{spread(e)} (share {e['share_run']:.3f}, excess {e['excess']:+.3f})",
                "excess of the medians ≤ 0.03: "
                + ("meets" if abs(e["excess"]) <= 0.03 else "misses"),
            )
        )
    rows += [
        (
            "`trainer.predict`, early exit after block 0 (model cut by hand)",
            f"{spread(predict['early_exit_block0'])} ({spread(predict['share_block0'])})",
            "",
        ),
        (
            "`trainer.predict`, capture block 0 without early exit",
            spread(predict["capture_block0"]),
            "",
        ),
        (
            "`trainer.predict` dumping block 6 with FeatureWriter",
            spread(dump["predict_slowdown"]["with_writer"]),
            "",
        ),
        (
            "FeatureWriter vs `save_file` + fsync, durable, throughput "
            f"({write['save_file_fsync_MBps']:,.0f} MB/s plain)",
            spread(write["ratio"]),
            verdict([write["ratio"]], at_least=0.8),
        ),
        (
            "peak RSS growth, dump of 20 shards vs 1 shard",
            f"{dump['peak_rss']['growth_MiB']} MiB",
            "0",
        ),
        (
            "validation epoch with ActivationStats on 12 blocks",
            spread(probes["activation_stats"]),
            verdict([probes["activation_stats"]], at_most=1.15),
        ),
        (
            "validation epoch with ActivationStats + LinearProbe + LayerCKA",
            spread(probes["stats_probe_cka"]),
            "",
        ),
    ]
    lines = ["| measurement | median (min to max) | target |", "|---|---|---|"]
    lines += [f"| {name} | {result} | {target} |" for name, result, target in rows]
    lines.append(
        "\nEach ratio is taken round by round against the same work without lightning-iocatch "
        "in the same run, over interleaved rounds; a target is met only when the whole spread "
        f"is on its side (torch {torch.__version__}, {torch.get_num_threads()} CPU threads)."
    )
    return "\n".join(lines)


def ratio_rows(overhead: dict, predict: dict, dump: dict, probes: dict) -> list[dict]:
    """Each ratio of the table as a row of the figure: label, median, min, max, target."""
    models = {
        "200-layer MLP": overhead["mlp_200_layers"],
        "2,000 modules": overhead["model_2000_modules"],
        "GPT-2": overhead["gpt2_12_blocks"],
    }

    def row(label: str, r: dict, **target: Any) -> dict:
        return {"label": label, "median": r["median"], "min": r["min"], "max": r["max"], **target}

    rows = [row(f"idle catcher, {m}", r["idle"], at_most=1.01) for m, r in models.items()]
    rows += [row(f"armed catcher, {m}", r["armed"], at_most=1.03) for m, r in models.items()]
    rows += [
        row(f"inert hooks on every module, {m}", r["all_hooks_idle"]) for m, r in models.items()
    ]
    gpt2 = overhead["gpt2_12_blocks"]
    for label in ("block0", "middle", "last"):
        e = gpt2[f"early_exit_{label}"]
        # the target is on the median: at most the share of the network run + 0.03
        limit = round(e["share_run"] + 0.03, 3)
        label = f"early exit after {e['block']} (target on the median)"
        rows.append(row(label, e, at_most=limit, on="median"))
    rows += [
        row("predict, early exit after block 0", predict["early_exit_block0"]),
        row("predict, capture block 0", predict["capture_block0"]),
        row("predict, dump block 6 (FeatureWriter)", dump["predict_slowdown"]["with_writer"]),
        row(
            "FeatureWriter throughput / save_file+fsync",
            dump["write_throughput"]["ratio"],
            at_least=0.8,
        ),
        row("validation with ActivationStats", probes["activation_stats"], at_most=1.15),
        row("validation with stats + probe + CKA", probes["stats_probe_cka"]),
    ]
    return rows


def plot_rows(rows: list[dict], title: str, xlabel: str, path: Path) -> None:
    """Medians (dots) and min-to-max spreads (bars) against each row's target (|)."""
    from matplotlib.figure import Figure

    height = 0.32 * len(rows) + 1.6
    figure = Figure(figsize=(8.2, height))
    axes = figure.add_subplot()
    y = list(range(len(rows)))[::-1]
    for position, r in zip(y, rows, strict=True):
        limit = r.get("at_most", r.get("at_least"))
        if limit is None:
            colour = "#7d7d7d"
        else:
            low, high = (
                (r["median"], r["median"]) if r.get("on") == "median" else (r["min"], r["max"])
            )
            ok = high <= limit if "at_most" in r else low >= limit
            miss = low > limit if "at_most" in r else high < limit
            colour = "#2e7d32" if ok else "#c62828" if miss else "#ef6c00"
            axes.plot([limit, limit], [position - 0.38, position + 0.38], color="black", lw=1.6)
        axes.plot([r["min"], r["max"]], [position, position], color=colour, lw=2.2, alpha=0.55)
        axes.plot([r["median"]], [position], "o", color=colour, ms=5.5)
    axes.axvline(1.0, color="#bbbbbb", lw=0.8, zorder=0)
    axes.set_yticks(y, [r["label"] for r in rows], fontsize=9)
    axes.set_ylim(-0.7, len(rows) - 0.3)
    axes.set_xlim(0, max(r["max"] for r in rows) * 1.05)
    axes.set_xlabel(xlabel, fontsize=9)
    axes.set_title(title, fontsize=10)
    axes.grid(axis="x", color="#eeeeee")
    legend = [
        ("|", "black", "target"),
        ("o", "#2e7d32", "whole spread meets its target"),
        ("o", "#ef6c00", "spread straddles its target"),
        ("o", "#c62828", "misses its target"),
        ("o", "#7d7d7d", "no target"),
    ]
    for marker, colour, text in legend:
        axes.plot([], [], marker, color=colour, label=text)
    figure.legend(fontsize=8.5, loc="lower center", ncol=5, frameon=False)
    figure.tight_layout(rect=(0, 0.3 / height, 1, 1))
    figure.savefig(path, dpi=90)


def replot(recorded: Path = RECORDED, images: Path = IMAGES) -> list[Path]:
    """Draw every group of the recorded rows into ``images/performance-{group}.png``."""
    groups = json.loads(recorded.read_text())
    written = []
    for name, group in groups.items():
        path = images / f"performance-{group['slug']}.png"
        plot_rows(group["rows"], f"{name}: {group['note']}", group["xlabel"], path)
        written.append(path)
    return written


def record(rows: list[dict], recorded: Path = RECORDED) -> None:
    """Replace the "make bench" group of the recorded rows with this run's."""
    groups = json.loads(recorded.read_text()) if recorded.exists() else {}
    note = f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    xlabel = "ratio to the same work without lightning-iocatch"
    groups["make bench"] = {"slug": "bench", "note": note, "xlabel": xlabel, "rows": rows}
    recorded.write_text(json.dumps(groups, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    parser.add_argument("--replot", action="store_true", help="only redraw the figures")
    args = parser.parse_args()
    if not args.replot:
        results = [
            run(script, args.quick)
            for script in ("overhead.py", "predict.py", "dump.py", "probes.py")
        ]
        print(table(*results))
        rows = ratio_rows(*results)
        if args.quick:
            return  # a smoke test records and draws nothing
        record(rows)
    for path in replot():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
