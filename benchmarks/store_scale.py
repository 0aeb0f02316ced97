"""Stores at scale: the memory and time to open, resume and read a store of token rows.

    python benchmarks/store_scale.py                 # 10^6, 10^7 and 10^8 rows (~1.3 GB on disk)
    python benchmarks/store_scale.py --quick         # 10^5 and 10^6 rows, smoke test
    python benchmarks/store_scale.py --dir /scratch  # where the stores are built and kept

Builds, once (kept in ``--dir``, default ``benchmarks/.stores``), a store of token rows per
size, as ``ShardWriter`` writes them for two DDP ranks: rank ``r``'s batches hold samples
``r, r + 2, ...`` of 50 tokens each, every row one int8 element plus its ``__index__`` and
``__position__``; 10^4 batches per store, whatever its size (the rows per batch grow with
it). Then, each in a fresh process, in rounds that interleave the sizes:

- ``open``: ``FeatureStore(path)``: seconds, and how far the process's peak RSS (VmHWM)
  rose above its RSS before the call (imports done, nothing of the store read);
- ``resume``: ``prepare_store(path, "resume", ...)``: the same, and the bytes of the
  pickled plan (what a DDP resume broadcasts to every rank);
- ``epoch``: one shuffled epoch of ``StoreRows(path, key, batch_size=4096,
  with_indices=True)`` (``--epoch-up-to`` rows at most): rows per second, and the RSS after
  10 %, 50 % and 100 % of its batches (flat memory: the three are alike at every size).

Prints JSON: per size, the median, min and max over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import peak_memory
import torch
from common import run_facts, spread

HERE = Path(__file__).resolve().parent
KEY = "h/outputs"
TOKENS = 50  # per sample
BATCHES = 10_000
WORLD = 2
SETTINGS: dict[str, Any] = {
    "spec": None,
    "stage": "predict",
    "dtype": None,
    "tokens": {"mask": "attention_mask", "token_ids": None, "drop_first": False,
               "drop_token_ids": [], "reduce": None},
}  # fmt: skip


def build(path: Path, rows: int) -> None:
    """A store of ``rows`` token rows in :data:`BATCHES` batches of two ranks' writers."""
    from lightning_iocatch.store import ShardWriter, TokenSelection, prepare_store

    done = path / "built"
    if done.exists():
        return
    plan = prepare_store(path, "overwrite" if path.exists() else "create", SETTINGS)
    samples = max(1, rows // BATCHES // TOKENS)  # per batch
    writers = [ShardWriter(path, rank=rank, plan=plan, durable=False) for rank in range(WORLD)]
    keep = torch.ones(samples, TOKENS, dtype=torch.bool)
    selection = TokenSelection(keep, None, None)
    data = {KEY: torch.ones(samples * TOKENS, 1, dtype=torch.int8)}
    for batch in range(rows // (samples * TOKENS)):
        rank, step = batch % WORLD, batch // WORLD
        first = (step * samples) * WORLD + rank
        indices = list(range(first, first + samples * WORLD, WORLD))
        writers[rank].write(data, indices, batch_idx=step, tokens=selection, token_keys=[KEY])
    for writer in writers:
        writer.close()
    done.touch()


def _rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, path: Path, epoch_up_to: int) -> dict[str, Any]:
    """One measurement, in this fresh process."""
    from lightning_iocatch import FeatureStore, StoreRows
    from lightning_iocatch.store import prepare_store

    peak_memory.reset_peak()
    before = _rss()
    start = time.perf_counter()
    if kind == "open":
        store = FeatureStore(path)
        result = {"rows": len(store), "samples": store.sample_count}
    elif kind == "resume":
        plan = prepare_store(path, "resume", SETTINGS)
        result = {"plan_bytes": len(pickle.dumps(plan))}
    else:
        data = StoreRows(path, KEY, batch_size=4096, with_indices=True)
        total = min(len(data), max(1, epoch_up_to // 4096))
        marks, rss, rows = {total // 10, total // 2, total - 1}, [], 0
        for i, batch in enumerate(data):
            rows += len(batch[KEY])
            if i in marks:
                rss.append(round(_rss() / 2**20, 1))
            if i == total - 1:
                break
        result = {"rows_per_s": rows / (time.perf_counter() - start), "rss_mib": rss}
    result["seconds"] = time.perf_counter() - start
    result["peak_growth_mib"] = (peak_memory.peak() - before) / 2**20
    return result


def measure(kind: str, path: Path, epoch_up_to: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", kind, str(path), str(epoch_up_to)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=HERE / ".stores")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epoch-up-to", type=int, default=10**8)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, up_to = args.child
        print(json.dumps(child(kind, Path(path), int(up_to))))
        return
    sizes = [10**5, 10**6] if args.quick else [10**6, 10**7, 10**8]
    repeats = 1 if args.quick else args.repeats
    built = {}
    for rows in sizes:
        path = args.dir / f"tokens-{rows:.0e}"
        start = time.perf_counter()
        build(path, rows)
        built[rows] = (path, time.perf_counter() - start)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for round_ in range(repeats):
        order = sizes if round_ % 2 == 0 else sizes[::-1]
        for rows in order:
            for kind in ("open", "resume", "epoch"):
                result = measure(kind, built[rows][0], args.epoch_up_to)
                runs.setdefault((rows, kind), []).append(result)
    report: dict[str, Any] = run_facts(batches=BATCHES, world=WORLD, repeats=repeats)
    for rows in sizes:
        path = built[rows][0]
        disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        entry: dict[str, Any] = {"disk_mib": round(disk / 2**20, 1)}
        for kind in ("open", "resume", "epoch"):
            results = runs[(rows, kind)]
            summary = {
                name: spread([float(r[name]) for r in results])
                for name in ("seconds", "peak_growth_mib", "plan_bytes", "rows_per_s")
                if name in results[0]
            }
            if kind == "epoch":
                summary["rss_mib_at_10_50_100_percent"] = results[-1]["rss_mib"]
            entry[kind] = summary
        report[f"{rows:.0e} rows"] = entry
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
