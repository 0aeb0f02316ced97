"""Shuffled small batches at scale: the time to write, open and resume a store, and IndexSet alone.

    python benchmarks/index_scale.py          # stores of 10^3..10^5 batches; IndexSet 10^5, 10^6
    python benchmarks/index_scale.py --quick  # stores of 10^3, 10^4 batches; IndexSet 10^4, 10^5
    python benchmarks/index_scale.py --repeats 3 --dir /scratch

A predict loader with ``shuffle=True, batch_size=2`` gives batches of two indices drawn
from a permutation. Each size writes such a store through ``ShardWriter`` (rows of one int8,
shards of 16 KiB: the bookkeeping is measured, not the bytes), then times, each in this
process: ``write`` (every ``write`` and ``close``), ``open`` (``FeatureStore(path)``) and
``resume`` (``prepare_store(path, "resume", ...)``). ``growth`` is the median's ratio to
the previous size's (10x the batches: about 10x is linear, 100x quadratic).

``index_set``: what the writer and the reader ask of an :class:`IndexSet` per batch (is
it known, which of its progression is present, add it), alone, for batches of shuffled
pairs, shuffled triples, and 1 to 5 random ids drawn from a range 1000x the batches:
seconds, microseconds per batch, and the bytes of the pickled set (what a resume
broadcasts), once per size.

Prints JSON: the median, min and max over the repeats (one repeat at the largest size).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import run_facts, spread

SETTINGS: dict[str, Any] = {"spec": None, "stage": "predict", "dtype": None, "tokens": None}
SHARD_BYTES = 16 << 10  # about 900 batches a shard: many shards, as a long dump has


def pairs(batches: int, seed: int, size: int = 2) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(batches * size)
    return [order[i * size : (i + 1) * size].tolist() for i in range(batches)]


def sparse(batches: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, batches * 1000, rng.integers(1, 6)).tolist() for _ in range(batches)]


def store_round(root: Path, batches: int, seed: int) -> dict[str, float]:
    """Write, open and resume one store of ``batches`` shuffled pairs: seconds each."""
    from lightning_iocatch import FeatureStore
    from lightning_iocatch.store import ShardWriter, prepare_store

    path = root / f"pairs-{batches}-{seed}"
    indices = pairs(batches, seed)
    rows = {"x": torch.ones(2, 1, dtype=torch.int8)}
    start = time.perf_counter()
    plan = prepare_store(path, "create", SETTINGS)
    writer = ShardWriter(path, rank=0, plan=plan, durable=False, max_shard_bytes=SHARD_BYTES)
    for batch_idx, batch in enumerate(indices):
        writer.write(rows, batch, batch_idx=batch_idx)
    writer.close()
    result = {"write": time.perf_counter() - start}
    start = time.perf_counter()
    store = FeatureStore(path)
    result["open"] = time.perf_counter() - start
    assert len(store) == 2 * batches
    start = time.perf_counter()
    prepare_store(path, "resume", SETTINGS)
    result["resume"] = time.perf_counter() - start
    shutil.rmtree(path)
    return result


def index_round(batches: list[list[int]]) -> dict[str, float]:
    """The writer's and reader's asks of one IndexSet, per batch: seconds, pickled bytes."""
    from lightning_iocatch.store.index_set import IndexSet

    seen = IndexSet()
    start = time.perf_counter()
    for batch in batches:
        seen.contains(batch)
        values = sorted(set(batch))
        step = values[1] - values[0] if len(values) > 1 else 1
        seen.overlap(values[0], step, len(values))
        seen.add(batch)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "us_per_batch": 1e6 * seconds / len(batches),
            "pickled_bytes": float(len(pickle.dumps(seen)))}  # fmt: skip


def grown(report: dict[str, Any], sizes: list[int], names: tuple[str, ...]) -> None:
    """Add each size's ``growth``: its median over the previous size's, per name."""
    for before, after in itertools.pairwise(sizes):
        entry = report[f"{after:.0e}"]
        entry["growth"] = {
            name: round(entry[name]["median"] / report[f"{before:.0e}"][name]["median"], 1)
            for name in names
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    sizes = [10**3, 10**4] if args.quick else [10**3, 10**4, 10**5]
    groups = [10**4, 10**5] if args.quick else [10**5, 10**6]
    root = Path(tempfile.mkdtemp(dir=args.dir))
    stores: dict[str, Any] = {}
    for batches in sizes:
        repeats = 1 if batches == sizes[-1] else args.repeats
        runs = [store_round(root, batches, seed) for seed in range(repeats)]
        stores[f"{batches:.0e}"] = {
            name: spread([run[name] for run in runs]) for name in ("write", "open", "resume")
        }
        print(f"{batches} batches: {stores[f'{batches:.0e}']}", flush=True)
    grown(stores, sizes, ("write", "open", "resume"))
    shutil.rmtree(root)
    index_sets: dict[str, Any] = {}
    patterns = {"pairs": pairs, "triples": lambda n, s: pairs(n, s, 3), "sparse": sparse}
    for name, pattern in patterns.items():
        by_size: dict[str, Any] = {}
        for count in groups:
            runs = [index_round(pattern(count, 0))]  # 10^6 batches take minutes: once
            by_size[f"{count:.0e}"] = {
                key: spread([run[key] for run in runs])
                for key in ("seconds", "us_per_batch", "pickled_bytes")
            }
        grown(by_size, groups, ("seconds",))
        index_sets[name] = by_size
        print(f"index_set {name}: {by_size}", flush=True)
    report = run_facts(shard_bytes=SHARD_BYTES, repeats=args.repeats)
    print(
        json.dumps({**report, "store_of_shuffled_pairs": stores, "index_set": index_sets}, indent=2)
    )


if __name__ == "__main__":
    main()
