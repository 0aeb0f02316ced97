"""Compact stores: bytes per row, dump and read throughput of each storage variant.

The same token rows (one block's output of a byte-level GPT-2 trained on the Python
standard library, :mod:`compact_common`) dumped with ``FeatureWriter(dtype=..., codec=...,
tokens=TokenRows())`` as float32, bfloat16 and float8_e4m3fn, each without and with
``codec="zstd"``. A variant this library refuses is skipped with a printed line.

- **bytes/row**: every file of the store (shards, ledger, metadata) over its rows; each row
  also stores its index, position and token id (20 bytes).
- **dump rows/s**: rows over the seconds of ``trainer.predict`` (the model's forward up to
  the block, with early exit, the capture and the writer, ``durable=True``: each shard is
  fsynced), ``rounds`` interleaved rounds after a warm-up one, the order reversed every
  other round; median (min, max), and the median over rounds of the ratio to float32's
  time in the same round.
- **read rows/s**: one shuffled epoch of ``StoreRows(dtype=torch.float32)`` (what an SAE
  trainer asks for: fp8 dequantized, bf16 widened), batches of 1,024 rows, one process, no
  worker, timed the same way. The stores were just written and are read again every round:
  this is a **warm page cache** (nothing is dropped), i.e. decoding and gathering, not the
  disk.

With ``--synthetic`` the rows are not a model's: 131,072 rows of width 256 drawn as
activations with outlier dimensions (each unit Gaussian with its own spread, 4 units 40
times wider and offset by 20), written by the store's ``ShardWriter`` alone (its
rows/s are the writer's, coding included, with no forward beside it: not the dump's) and
read as above. No model, no training: the reads in about a minute.

    python benchmarks/compact_store.py              # 3 rounds: 3.5 minutes on 2 shared
                                                    # cores (+ the model's training once,
                                                    # 3 to 5 minutes, cached)
    python benchmarks/compact_store.py --rounds 2   # 2.5 minutes once the model is cached
    python benchmarks/compact_store.py --synthetic  # width 256, reads: about a minute
    python benchmarks/compact_store.py --quick      # a few seconds (a tiny model)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import run_facts, spread
from compact_common import (
    CODECS,
    DTYPES,
    FULL,
    QUICK,
    Setup,
    accepted_variants,
    dump,
    dump_ids,
    quiet,
    records_scale,
    store_bytes,
    synthetic_rows,
    trained_lm,
    variant_name,
    write_rows,
    writer,
)
from torch.utils.data import DataLoader

from lightning_iocatch import StoreRows

BASELINE = "float32"
SYNTHETIC_ROWS, SYNTHETIC_WIDTH, SYNTHETIC_KEY = 131_072, 256, "h/outputs"


def read_epoch(path: Path, key: str) -> int:
    """Read every row once, shuffled, as float32; the rows read."""
    data = StoreRows(path, key, batch_size=1024, shuffle=True, seed=0, dtype=torch.float32)
    return sum(len(batch[key]) for batch in DataLoader(data, batch_size=None))


def interleaved(timed: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant per round: a warm-up round, then ``rounds``, the order
    reversed every other round."""
    names = list(timed)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name in names if round_ % 2 else reversed(names):
            elapsed = timed[name]()
            if round_:
                samples[name].append(elapsed)
    return samples


def figures(samples: dict[str, list[float]], rows: dict[str, int]) -> dict[str, Any]:
    """Rows/s median (min, max) of each variant, and its speed's ratio to the baseline's
    in the same round, median (min, max) over the rounds."""
    found: dict[str, Any] = {}
    base = samples.get(BASELINE)
    for name, seconds in samples.items():
        found[name] = {"rows_per_s": spread([rows[name] / s for s in seconds])}
        if base is not None:
            ratios = [b / s for s, b in zip(seconds, base, strict=True)]  # speed ratio
            found[name]["speed_ratio"] = spread(ratios)
    return found


def measure_synthetic(rounds: int, work: Path) -> dict[str, Any]:
    """Bytes per row, the writer's and the reads' throughput of every variant on width-256
    rows with outlier dimensions (see the module docstring)."""
    x = synthetic_rows(SYNTHETIC_ROWS, SYNTHETIC_WIDTH)
    paths = {variant_name(d, c): work / variant_name(d, c) for d in DTYPES for c in CODECS}
    rows = {name: len(x) for name in paths}

    def write_once(name: str) -> float:
        dtype, _, codec = name.partition("+")
        return write_rows(paths[name], SYNTHETIC_KEY, x, dtype, codec or None)

    writes = interleaved({name: (lambda n=name: write_once(n)) for name in paths}, rounds)
    return _read_and_size(paths, rows, SYNTHETIC_KEY, rounds) | {
        **run_facts(rounds=rounds, synthetic=[SYNTHETIC_ROWS, SYNTHETIC_WIDTH]),
        "rows": rows,
        "dump": figures(writes, rows),
        "skipped": {},
        "fp8_scale_recorded": {},
    }


def _read_and_size(
    paths: dict[str, Path], rows: dict[str, int], key: str, rounds: int
) -> dict[str, Any]:
    """Each store's shuffled read (timed, interleaved) and bytes per row."""

    def read_once(name: str) -> float:
        start = time.perf_counter()
        read = read_epoch(paths[name], key)
        if read != rows[name]:
            raise RuntimeError(f"{name}: read {read} rows of {rows[name]}")
        return time.perf_counter() - start

    reads = interleaved({name: (lambda n=name: read_once(n)) for name in paths}, rounds)
    sizes = {name: store_bytes(path) / rows[name] for name, path in paths.items()}
    base_size = sizes.get(BASELINE)
    return {
        "bytes_per_row": {name: round(size, 2) for name, size in sizes.items()},
        "size_ratio": {n: round(s / base_size, 3) for n, s in sizes.items()} if base_size else {},
        "read_warm_cache": figures(reads, rows),
    }


def measure(setup: Setup, rounds: int, work: Path) -> dict[str, Any]:
    """Every variant's bytes per row, dump and read throughput."""
    lm, trained = trained_lm(setup)
    ids = dump_ids(setup)
    writers, skipped = accepted_variants(work, DTYPES, CODECS)
    paths = {name: work / name for name in writers}
    rows: dict[str, int] = {}

    def dump_once(name: str) -> float:
        dtype, _, codec = name.partition("+")
        out = writer(paths[name], dtype, codec or None)
        assert not isinstance(out, str)
        seconds = dump(lm, setup, ids, out)
        rows[name] = out.rows_written
        return seconds

    dumps = interleaved({name: (lambda n=name: dump_once(n)) for name in paths}, rounds)
    return _read_and_size(paths, rows, setup.key, rounds) | {
        **run_facts(setup=setup.digest(), rounds=rounds, lm=trained),
        "rows": rows,
        "dump": figures(dumps, rows),
        "skipped": skipped,
        "fp8_scale_recorded": {n: records_scale(p) for n, p in paths.items() if "float8" in n},
    }


def markdown(result: dict[str, Any]) -> str:
    """The table of the docs."""
    lines = [
        "| variant | bytes/row | size vs float32 | dump rows/s, median (min, max) | dump speed "
        "vs float32 | read rows/s (warm cache) | read speed vs float32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, size in result["bytes_per_row"].items():
        dump_, read = result["dump"][name], result["read_warm_cache"][name]

        def cell(fig: dict[str, Any]) -> str:
            s = fig["rows_per_s"]
            return f"{s['median']:,.0f} ({s['min']:,.0f}, {s['max']:,.0f})"

        def ratio(fig: dict[str, Any]) -> str:
            r = fig.get("speed_ratio")
            return "" if r is None else f"{r['median']:.2f} ({r['min']:.2f}, {r['max']:.2f})"

        lines.append(
            f"| {name} | {size:.1f} | {result['size_ratio'].get(name, float('nan')):.3f} | "
            f"{cell(dump_)} | {ratio(dump_)} | {cell(read)} | {ratio(read)} |"
        )
    for name, reason in result["skipped"].items():
        lines.append(f"| {name} | skipped: {reason.splitlines()[0][:80]} | | | | | |")
    for name, scaled in result["fp8_scale_recorded"].items():
        how = "with a scale recorded in the store" if scaled else "a plain cast, no scale recorded"
        lines.append(f"\n{name}: stored {how}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few seconds")
    parser.add_argument(
        "--synthetic", action="store_true", help="width-256 rows, no model: about a minute"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print the JSON result too")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(args.threads)
    setup = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="compact-store-"))
    try:
        result = measure_synthetic(rounds, work) if args.synthetic else measure(setup, rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.synthetic:
        print(f"{SYNTHETIC_ROWS} synthetic rows of width {SYNTHETIC_WIDTH} (outlier units); "
              f"'dump' is ShardWriter alone; torch {result['torch']}, {result['threads']} "
              f"threads, {rounds} rounds")  # fmt: skip
        print(markdown(result).replace("dump rows/s", "writer rows/s"))
        return
    lm = result["lm"]
    print(f"{sum(result['rows'].values()) // max(len(result['rows']), 1)} token rows of "
          f"{setup.key} (width {setup.width}); the model's held-out loss "
          f"{lm['held_out_loss_before']} -> {lm['held_out_loss_after']} nats/byte; "
          f"torch {result['torch']}, {result['threads']} threads, {rounds} rounds")  # fmt: skip
    print(markdown(result))


if __name__ == "__main__":
    main()
