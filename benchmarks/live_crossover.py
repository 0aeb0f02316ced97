"""Live activations against a store: when does a dump pay for itself?

The same SAE (TopK, 1024 latents, k 32, batches of 1024 token rows, Adam 3e-4) is trained
on the same 8,192 token rows (64 sequences of 128 bytes; a live fill of 4,096 rows): one
block's output of the compact study's byte-level GPT-2 (:mod:`compact_common`, trained
once and cached in ``.cache/compact-study/``):

- **live**: ``LiveActivations`` over the model's inputs: every pass runs the model's
  forward (to the block, with early exit) again;
- **store**: one dump (``trainer.predict`` with ``IOCaptureCallback`` and
  ``FeatureWriter(dtype=..., codec=...)``) in float32, bfloat16 and float8_e4m3fn+zstd,
  then every pass reads the store (``StoreDataModule``, rows widened to float32).

Each variant runs in a child process of its own (its peak resident set, ``ru_maxrss``, is
its own): one ``Trainer.fit`` of 16 epochs, the wall and CPU clocks read at the end of each
epoch; the time of 1, 4 and 16 passes is the clock after that many epochs (plus the dump
for a store). A hyperparameter trial over the same tokens costs what a pass costs (a fit
from scratch pays the forward, or the read, again). The variants run interleaved, the
order rotated each round; the figures are medians over the rounds.

The rule: with ``f`` the live pipeline's seconds per token of one pass without training
(forward to the block, capture, mixing), ``r`` the store's (a read, decoded and widened),
and ``d`` the dump's seconds per token (forward, capture, write), the training itself
costs the same both ways, so a store is faster after ``P* = d / (f - r)`` passes (never if
``f <= r``). ``f`` and ``r`` are also measured alone, outside a Trainer, per token.

    python benchmarks/live_crossover.py          # 3 rounds: about 3 minutes on 2 idle cores
    python benchmarks/live_crossover.py --quick  # a smoke run: a tiny model, about 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "docs" / "images" / "live_crossover.png"
PASSES = (1, 4, 16)
STORES = {  # name -> (dtype, codec)
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "float8_e4m3fn+zstd": ("float8_e4m3fn", "zstd"),
}
VARIANTS = ("live", *STORES)


# -- the child: one variant, one fit of max(PASSES) epochs ---------------------------------


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def child(variant: str, quick: bool, count: int, work: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from compact_common import (
        FULL,
        QUICK,
        dump,
        loader,
        quiet,
        sequences,
        store_bytes,
        texts,
        trained_lm,
    )

    from lightning_iocatch import FeatureWriter, SAEModule, StoreDataModule, TokenRows
    from lightning_iocatch.lightning.live import LiveActivations
    from lightning_iocatch.store.training import StoreRows

    quiet()
    setup = QUICK if quick else FULL
    lm, _ = trained_lm(setup)
    ids = sequences(texts(setup)[0], count, setup.context, seed=setup.seed + 2)  # dump text
    tokens = ids.numel()
    batch, buffer_rows, latents, k = (256, 1024, 256, 8) if quick else (1024, 4096, 1024, 32)
    base = peak_mib()

    class EpochClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.ends.append(clocks())

    def fit(data: pl.LightningDataModule) -> list[tuple[float, float]]:
        clock = EpochClock()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=max(PASSES),
                             logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[clock])  # fmt: skip
        module = SAEModule(setup.width, latents, "topk", k=k, key=setup.key, lr=3e-4, seed=0)
        start = clocks()
        trainer.fit(module, datamodule=data)
        assert int(module.steps) > 0
        return [(w - start[0], c - start[1]) for w, c in clock.ends]

    found: dict[str, Any] = {"variant": variant, "tokens": tokens, "base_mib": base}
    if variant == "live":
        live = LiveActivations(lm, f"outputs[{setup.module}]", loader(ids, batch_size=32),
                               batch_size=batch, buffer_rows=buffer_rows,
                               tokens=TokenRows(), seed=0)  # fmt: skip
        found["epochs"] = fit(live)
        found["peak_mib"] = peak_mib()
        # the pipeline alone (forward to the block, capture, mixing), outside a Trainer
        start = clocks()
        rows = sum(len(b["index"]) for b in live.train_dataloader())
        end = clocks()
        assert rows == tokens, (rows, tokens)
        found["alone"] = (end[0] - start[0], end[1] - start[1])
        return found
    dtype, codec = STORES[variant]
    path = work / variant
    options: dict[str, Any] = {"dtype": dtype, "mode": "overwrite", "tokens": TokenRows()}
    if codec is not None:
        options["codec"] = codec
    start = clocks()
    dump(lm, setup, ids, FeatureWriter(path, **options))
    end = clocks()
    found["dump"] = (end[0] - start[0], end[1] - start[1])
    found["store_bytes"] = store_bytes(path)
    data = StoreDataModule(path, setup.key, batch_size=batch, seed=0, dtype="float32")
    found["epochs"] = fit(data)
    found["peak_mib"] = peak_mib()
    reader = StoreRows(path, setup.key, batch_size=batch, seed=0, dtype="float32")
    start = clocks()
    rows = sum(len(b[setup.key]) for b in reader)
    end = clocks()
    assert rows == tokens, (rows, tokens)
    assert next(iter(reader))[setup.key].dtype == torch.float32
    found["alone"] = (end[0] - start[0], end[1] - start[1])
    shutil.rmtree(path)
    return found


# -- the parent: rounds of children, the table, the crossover, the plot --------------------


def run_child(variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = Path(__file__).resolve()
    command = [sys.executable, str(script), "--child", variant, "--sequences",
               str(args.sequences), "--work", str(work)]  # fmt: skip
    command += ["--quick"] if args.quick else []
    done = subprocess.run(command, capture_output=True, text=True, cwd=script.parent)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one variant."""
    tokens = runs[0]["tokens"]
    dump = [r["dump"] for r in runs] if "dump" in runs[0] else None
    out: dict[str, Any] = {"tokens": tokens, "rounds": len(runs)}
    out["dump_wall"] = median([d[0] for d in dump]) if dump else 0.0
    out["dump_cpu"] = median([d[1] for d in dump]) if dump else 0.0
    for p in PASSES:
        out[f"wall_{p}"] = out["dump_wall"] + median([r["epochs"][p - 1][0] for r in runs])
        out[f"cpu_{p}"] = out["dump_cpu"] + median([r["epochs"][p - 1][1] for r in runs])
        out[f"tps_{p}"] = p * tokens / out[f"wall_{p}"]
    last = max(PASSES)
    out["pass_wall"] = median(  # the median epoch after the first, over every round
        [r["epochs"][e][0] - r["epochs"][e - 1][0] for r in runs for e in range(1, last)]
    )
    out["first_wall"] = median([r["epochs"][0][0] for r in runs])
    out["alone_us"] = median([r["alone"][0] for r in runs]) / tokens * 1e6
    out["dump_us"] = out["dump_wall"] / tokens * 1e6
    out["peak_mib"] = median([r["peak_mib"] for r in runs])
    out["base_mib"] = median([r["base_mib"] for r in runs])
    out["store_mib"] = runs[0].get("store_bytes", 0) / 2**20
    return out


def rule(live: dict[str, Any], store: dict[str, Any]) -> float | None:
    """``P* = d / (f - r)`` from the per-token costs measured alone; None: never."""
    gap = live["alone_us"] - store["alone_us"]
    return store["dump_us"] / gap if gap > 0 else None


def faster_at(live: dict[str, Any], store: dict[str, Any]) -> list[int]:
    """The measured passes at which the store's total (with its dump) is below live's."""
    return [p for p in PASSES if store[f"wall_{p}"] < live[f"wall_{p}"]]


def table(summary: dict[str, dict[str, Any]]) -> list[str]:
    live = summary["live"]
    lines = [
        "| variant | dump s | "
        + " | ".join(f"{p} pass{'es' if p > 1 else ''}: wall s (CPU s), tokens/s" for p in PASSES)
        + " | peak RSS MiB (before fit) | store MiB | f or r µs/token | d µs/token | "
        "store faster at (measured) | P* = d/(f-r) |",
        "|---|" + "---:|" * (len(PASSES) + 7),
    ]
    for name, s in summary.items():
        cells = [name, "—" if name == "live" else f"{s['dump_wall']:.1f}"]
        for p in PASSES:
            cells.append(f"{s[f'wall_{p}']:.1f} ({s[f'cpu_{p}']:.1f}), {s[f'tps_{p}']:,.0f}")
        cells.append(f"{s['peak_mib']:.0f} ({s['base_mib']:.0f})")
        cells.append("—" if name == "live" else f"{s['store_mib']:.1f}")
        cells.append(f"{s['alone_us']:.2f}")
        cells.append("—" if name == "live" else f"{s['dump_us']:.2f}")
        if name == "live":
            cells += ["—", "—"]
        else:
            at = rule(live, s)
            cells.append(", ".join(map(str, faster_at(live, s))) or "none")
            cells.append("never" if at is None else f"{at:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(summary: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.6, 4.2))
    total, speed = figure.subplots(1, 2)
    colours = {"live": "#5e35b1", "float32": "#ef6c00", "bfloat16": "#2e7d32",
               "float8_e4m3fn+zstd": "#1565c0"}  # fmt: skip
    live = summary["live"]
    for name, s in summary.items():
        colour = colours[name]
        label = name if name == "live" else f"store {name} (dump + reads)"
        total.plot(PASSES, [s[f"wall_{p}"] for p in PASSES], "o-", color=colour, label=label)
        speed.plot(PASSES, [s[f"tps_{p}"] for p in PASSES], "o-", color=colour, label=label)
        at = None if name == "live" else rule(live, s)
        if at is not None and at <= max(PASSES):
            total.axvline(at, color=colour, ls=":", lw=1.4)
            total.annotate(f"P* {at:.1f}", (at, 0.97 - 0.07 * list(summary).index(name)),
                           xycoords=("data", "axes fraction"), xytext=(4, 0),
                           textcoords="offset points", fontsize=8, color=colour)  # fmt: skip
    for axes in (total, speed):
        axes.set_xscale("log", base=2)
        axes.set_xticks(PASSES, [str(p) for p in PASSES])
        axes.set_xlabel("passes (or trials) over the same tokens")
        axes.grid(color="#eeeeee")
    total.set_ylabel("total wall seconds (store: with its dump)")
    total.set_title("total time; dotted: P* = d / (f - r)", fontsize=10)
    speed.set_ylabel("trained tokens / s")
    speed.set_title("throughput over the whole run", fontsize=10)
    speed.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="repeats (medians)")
    parser.add_argument("--sequences", type=int, default=None, help="sequences of 128 bytes")
    parser.add_argument("--plot", type=Path, default=None, help=f"default {IMAGE}")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--replot", type=Path, default=None, help="a --json file: table, plot")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sequences is None:
        args.sequences = 16 if args.quick else 64
    if args.child is not None:
        print(json.dumps(child(args.child, args.quick, args.sequences, args.work)))
        return
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        print("\n".join(table(saved["summary"])))
        plot(saved["summary"], args.plot or IMAGE, saved["title"])
        return
    rounds = args.rounds or (1 if args.quick else 3)
    from compact_common import FULL, QUICK, trained_lm

    setup = QUICK if args.quick else FULL
    latents, k = (256, 8) if args.quick else (1024, 32)
    trained_lm(setup)  # trained once and cached, outside the measurement
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    work = Path(tempfile.mkdtemp(prefix="live-crossover-"))
    loads = []
    start = time.perf_counter()
    try:
        for number in range(rounds):
            order = VARIANTS[number % len(VARIANTS) :] + VARIANTS[: number % len(VARIANTS)]
            for name in order:
                found = run_child(name, args, work)
                runs[name].append(found)
                loads.append(os.getloadavg()[0])
                print(f"round {number + 1}/{rounds} {name}: {found['epochs'][-1][0]:.1f} s fit"
                      f" + {found.get('dump', (0.0,))[0]:.1f} s dump, load "
                      f"{loads[-1]:.2f}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {name: summarise(found) for name, found in runs.items()}
    tokens = summary["live"]["tokens"]
    print(f"\n{tokens:,} token rows (byte-level GPT-2, {setup.layers} blocks of width "
          f"{setup.width}, rows of {setup.module}); SAE TopK {latents} latents k {k}; medians of "
          f"{rounds} round(s); {time.perf_counter() - start:.0f} s; 1-minute load average "
          f"during: {min(loads):.2f} to {max(loads):.2f}; {os.cpu_count()} cores\n")  # fmt: skip
    print("\n".join(table(summary)))
    title = (f"SAE on {tokens:,} token rows of a {setup.layers}-block byte GPT-2 "
             f"(width {setup.width}), CPU, {os.cpu_count()} cores")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "loads": loads, "title": title}))
    out = args.plot or (Path(tempfile.gettempdir()) / "live_crossover.png" if args.quick
                        else IMAGE)  # fmt: skip
    plot(summary, out, title)
    print(f"\nplot: {out}")


if __name__ == "__main__":
    main()
