"""Unit statistics at scale: top-k examples and density of a 4,096-latent SAE over a dump of
token rows, against a plain read of the same rows, ``torch.topk`` in memory and delphi's
cache.

    python benchmarks/units.py [--quick] [--dir DIR] [--plot PNG] > RESULT.json  # or --markdown
    python benchmarks/units.py --render RESULT.json --markdown [--plot PNG]
    make bench-units    # in an environment of its own, with eai-delphi (about 50 minutes)
    python benchmarks/units_peers.py profile STORE 0    # ours under cProfile

The store holds what a dump of an SAE's input holds: token rows of residual activations
(width 256, float16, one row per token of samples of 128 tokens, each with its dataset
index, position and token id; ``ShardWriter``, batches of 32 samples), built once per size
in ``--dir`` (default ``benchmarks/.stores``: 10^7 rows are 5.3 GB). The SAE's latents
are not stored (10^7 x 4,096 float16 would be 82 GB): every kind computes them from the
stored rows with the same ReLU encoder (random weights, biases giving latent ``i`` the
density ``10 ** linspace(-4, -1)``, mean 1.45 %), as ``UnitActivations(of=encoder)`` does.

Each measurement runs in a fresh process (``benchmarks/units_peers.py``), reads the store
from a warm page cache (its files read once, untimed, before the clock starts), and
reports rows per second and its peak RSS (VmHWM, reset after the imports, the encoder and
opening the store; the RSS then is a few hundred MiB of torch and Python):

- ``read``: every stored batch read and converted to float32, nothing else;
- ``encode``: the same, and the encoder's latents computed and dropped: **the plain read**
  the goal compares with (the same bytes, read the same way, ``FeatureStore.row_batches``);
- ``ours``: ``summarize_store(store, key, UnitActivations(k=20, window=8, above=0.0,
  of=encoder))``;
- ``density_only``: the same with ``k=0`` (a diagnostic: the density's share);
- ``topk``: the latents of the first rows held in one float32 tensor, then
  ``torch.topk(20, dim=0)`` and the active count per latent;
- ``delphi``: eai-delphi's ``InMemoryCache`` fed as its ``LatentCache.run`` feeds it
  (skipped where delphi is not installed).

The ratio phase interleaves ``read``, ``encode`` and ``ours`` (and ``density_only``) in
rounds of alternating order at ``--ratio-rows``; a ratio is taken within a round. The
scale phase runs ``ours`` once at each size (and ``encode`` at the largest). The check
phase runs ``ours``, ``topk`` and ``delphi`` on one small store and compares their top
values and active counts exactly. Prints JSON, or markdown with ``--markdown``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from units_peers import build

HERE = Path(__file__).resolve().parent
WORK = str(HERE / "units_peers.py")


def measure(kind: str, path: Path, up_to: int = 0, save: Path | None = None) -> dict[str, Any]:
    """One kind in a fresh process."""
    command = [sys.executable, WORK, kind, str(path), str(up_to)] + ([str(save)] if save else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  {kind:>12} {result['rows']:>10,} rows: {result['rows_per_s']:>9,.0f} rows/s, "
        f"peak RSS {result['peak_rss_mib']:,.0f} MiB (+{result['peak_growth_mib']:,.0f})",
        file=sys.stderr,
    )
    return result


def spread(values: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def store(root: Path, rows: int) -> Path:
    path = root / f"units-{rows}"
    start = time.perf_counter()
    build(path, rows)
    if time.perf_counter() - start > 1:
        print(f"built {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


def has_delphi() -> bool:
    from importlib.util import find_spec

    return find_spec("delphi") is not None and find_spec("delphi.latents") is not None


def ratio_phase(path: Path, repeats: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for round_ in range(repeats):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            runs[kind].append(measure(kind, path))
    base = runs["encode"]
    result: dict[str, Any] = {"rounds": repeats, "rows": base[0]["rows"]}
    for kind in kinds:
        result[kind] = {
            "rows_per_s": spread([r["rows_per_s"] for r in runs[kind]], 0),
            "peak_rss_mib": spread([r["peak_rss_mib"] for r in runs[kind]], 0),
            "peak_growth_mib": spread([r["peak_growth_mib"] for r in runs[kind]], 0),
        }
        if kind != "encode":  # throughput over the plain read's, round by round
            ratios = [b["seconds"] / r["seconds"] for r, b in zip(runs[kind], base, strict=True)]
            result[kind]["throughput_vs_encode"] = spread(ratios)
    return result


def check_phase(path: Path, scratch: Path, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Every kind's top values and active counts on one store, against ``ours``."""
    found: dict[str, Any] = {}
    results = {}
    for kind in kinds:
        save = scratch / f"{kind}.pt"
        results[kind] = measure(kind, path, up_to=1 << 40, save=save)
        found[kind] = torch.load(save)
    ours = found["ours"]
    check: dict[str, Any] = {"rows": results["ours"]["rows"]}
    for kind in kinds:
        if kind == "ours":
            continue
        top = found[kind]["top"]
        same_top = bool(torch.equal(top.isnan(), ours["top"].isnan())) and bool(
            torch.equal(top.nan_to_num(-1.0), ours["top"].nan_to_num(-1.0))
        )
        same_active = bool(torch.equal(found[kind]["active"].long(), ours["active"].long()))
        check[kind] = {"same_top_values": same_top, "same_active_counts": same_active}
    summary = {
        kind: {
            "rows_per_s": round(r["rows_per_s"]),
            "peak_growth_mib": round(r["peak_growth_mib"]),
            "bytes_per_row": round(r["peak_growth_mib"] * 2**20 / r["rows"]),
            "rss_before_mib": round(r["rss_before_mib"]),
            **({"nonzeros": r["nonzeros"]} if "nonzeros" in r else {}),
        }
        for kind, r in results.items()
    }
    return {"check": check, "runs": summary}


GIB = 2**30


def _rate(r: dict[str, float]) -> str:
    return f"{r['median']:,.0f} ({r['min']:,.0f} to {r['max']:,.0f})"


def table(report: dict[str, Any]) -> str:
    """The markdown of docs/performance.md's section from a report."""
    import report as house  # the verdict wording of the other benchmarks

    lines = ["| measurement | rows/s | peak RSS (growth) | target |", "|---|---|---|---|"]
    ratio = report.get("ratio")
    if ratio:
        names = {
            "read": "plain read (float16 rows to float32), nothing else",
            "encode": "**plain read + SAE encoder** (the baseline)",
            "ours": "`summarize_store`, `UnitActivations(k=20, window=8, above=0.0, of=encoder)`",
            "density_only": "the same with `k=0` (density alone; diagnostic)",
        }
        for kind, label in names.items():
            r = ratio[kind]
            memory = (
                f"{r['peak_rss_mib']['median']:,.0f} MiB (+{r['peak_growth_mib']['median']:,.0f})"
            )
            lines.append(
                f"| {label}, {ratio['rows']:,} rows | {_rate(r['rows_per_s'])} | {memory} | |"
            )
        for kind in ("ours", "density_only"):
            r = ratio[kind]["throughput_vs_encode"]
            target = house.verdict([r], at_least=0.5) if kind == "ours" else ""
            lines.append(
                f"| throughput, {kind} / plain read + encoder | {house.spread(r)} | | {target} |"
            )
    for runs in report.get("scale", {}).values():
        for kind, r in runs.items():
            marks = ", ".join(f"{m['rss_mib']:,}" for m in r.get("marks", []))
            label = "ours" if kind == "ours" else "plain read + encoder"
            lines.append(
                f"| {label}, {r['rows']:,} rows (one run) | {r['rows_per_s']:,.0f} | "
                f"{r['peak_rss_mib']:,.0f} MiB (+{r['peak_growth_mib']:,.0f}); RSS at 10, 50, "
                f"100 %: {marks} MiB | |"
            )
        if "encode" in runs:
            both = runs["encode"]["seconds"] / runs["ours"]["seconds"]
            lines.append(
                f"| throughput, ours / plain read + encoder, one run each | {both:.3f}x | | |"
            )
    memory = report.get("in_memory")
    if memory:
        check, rows = memory["check"], memory["check"]["rows"]
        for kind, label in (("topk", "`torch.topk` over all latents in memory"),
                            ("delphi", "delphi's `InMemoryCache` (non-zero latents)")):  # fmt: skip
            if kind not in memory["runs"]:
                continue
            r, same = memory["runs"][kind], check[kind]
            agree = (
                "same" if same["same_top_values"] and same["same_active_counts"] else "DIFFERENT"
            )
            at_scale = 10**7 * r["bytes_per_row"] / GIB
            lines.append(
                f"| {label}, {rows:,} rows | {r['rows_per_s']:,} | +{r['peak_growth_mib']:,} MiB: "
                f"{r['bytes_per_row']:,} bytes a row, {at_scale:,.0f} GiB at 10^7 rows | top "
                f"values and active counts: {agree} as ours |"
            )
        ours = memory["runs"]["ours"]
        growth = ours["peak_growth_mib"]
        lines.append(
            f"| ours, the same {rows:,} rows | {ours['rows_per_s']:,} | +{growth:,} MiB | |"
        )
    lines.append(
        f"\ntorch {report['torch']}, {report['threads']} threads; load average "
        f"{report['load_average_at_start']:.2f} at the start, {report['load_average_at_end']:.2f} "
        "at the end."
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Peak RSS growth against rows (ours measured; the in-memory ways' measured bytes a
    row, drawn to 10^7 rows) and rows/s at the ratio size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, speed) = plt.subplots(1, 2, figsize=(12, 4.6))
    scale = report["scale"]
    rows = [int(n) for n in scale]
    growth = [scale[str(n)]["ours"]["peak_growth_mib"] / 1024 for n in rows]
    memory.plot(rows, growth, "o-", label="ours: summarize_store (measured, one run a size)")
    grid = [10**5, 10**6, 10**7]
    runs = report.get("in_memory", {}).get("runs", {})
    at = report.get("in_memory", {}).get("check", {}).get("rows", 0)
    for kind, label in (("topk", "torch.topk in memory"), ("delphi", "delphi InMemoryCache")):
        if kind in runs:
            per_row = runs[kind]["bytes_per_row"]
            text = f"{label}: {per_row:,} bytes a row (measured at {at:,} rows)"
            memory.plot(grid, [n * per_row / GIB for n in grid], "--", label=text)
    memory.axhline(24, color="grey", lw=0.8)
    memory.text(1.1e5, 26, "this machine: 24 GiB", color="grey")
    memory.set(xscale="log", yscale="log", xlabel="token rows", ylabel="peak RSS growth (GiB)",
               title="Memory against rows (4,096 latents)")  # fmt: skip
    memory.legend(fontsize=8)
    ratio = report["ratio"]
    kinds = ["encode", "ours", "density_only"]  # a read alone is 20-500x faster: not drawn
    labels = ["plain read + encoder", "ours", "ours, k=0 (density alone)"]
    medians = [ratio[k]["rows_per_s"]["median"] for k in kinds]
    low = [m - ratio[k]["rows_per_s"]["min"] for m, k in zip(medians, kinds, strict=True)]
    high = [ratio[k]["rows_per_s"]["max"] - m for m, k in zip(medians, kinds, strict=True)]
    speed.bar(labels, medians, yerr=[low, high], color=["#888", "#1f77b4", "#9ecae1"])
    speed.set(ylabel="rows/s (median, min-max)",
              title=f"Throughput, {ratio['rows']:,} rows, {ratio['rounds']} rounds")  # fmt: skip
    for x, m in enumerate(medians):
        speed.text(x + 0.05, m * 1.02, f"{m:,.0f}", ha="left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--dir", type=Path, default=HERE / ".stores")
    parser.add_argument("--ratio-rows", type=int, default=2**18)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-rows", type=int, default=2**18)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10**6, 3 * 10**6, 10**7])
    parser.add_argument("--phases", default="ratio,check,scale")
    parser.add_argument("--render", type=Path, help="print (and --plot) a saved JSON report")
    parser.add_argument("--plot", type=Path, help="save the figure here (PNG)")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(table(saved) if args.markdown else json.dumps(saved, indent=2))
        if args.plot:
            plot(saved, args.plot)
        return
    if args.quick:
        args.ratio_rows, args.check_rows, args.repeats = 2**14, 2**14, 1
        args.sizes = [2**14, 2**15]
    phases = args.phases.split(",")
    load = os.getloadavg()[0]
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_at_start": load,
    }
    if "ratio" in phases:
        kinds = ("read", "encode", "ours", "density_only")
        report["ratio"] = ratio_phase(store(args.dir, args.ratio_rows), args.repeats, kinds)
    if "check" in phases:
        kinds = ("ours", "topk", *(("delphi",) if has_delphi() else ()))
        with tempfile.TemporaryDirectory() as scratch:
            path = store(args.dir, args.check_rows)
            report["in_memory"] = check_phase(path, Path(scratch), kinds)
    if "scale" in phases:
        scale: dict[str, Any] = {}
        for rows in args.sizes:
            path = store(args.dir, rows)
            scale[str(rows)] = {"ours": _brief(measure("ours", path))}
        scale[str(rows)]["encode"] = _brief(measure("encode", path))
        report["scale"] = scale
    report["load_average_at_end"] = os.getloadavg()[0]
    print(table(report) if args.markdown else json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("rows", "seconds", "rows_per_s", "peak_rss_mib", "peak_growth_mib", "marks")
    return {key: round(result[key], 1) if isinstance(result[key], float) else result[key]
            for key in keys if key in result}  # fmt: skip


if __name__ == "__main__":
    main()
