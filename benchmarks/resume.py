"""StoreRows resumed mid-epoch on a store of 10^6 rows: exactly once, and how fast.

    python benchmarks/resume.py            # 10^6 rows of 128 bytes (~140 MB, built once)
    python benchmarks/resume.py --quick    # 10^5 rows, one round

Builds, once (kept in ``--dir``, default ``benchmarks/.stores``), a store of ``--rows`` rows
of 32 float32 in stored batches of 1,000, each row's first value its dataset index. Then, in
rounds (3; each variant in a fresh process, interleaved):

- ``epoch``: a whole shuffled epoch through a DataLoader with 2 workers (batch 4,096):
  rows per second, seconds to the first batch;
- ``resume_at_10/37/90``: a run of 2 processes (ranks read by hand, batch 1,000) stopped
  after 10, 37 or 90 % of its steps, its state saved; then one process with 2 workers and
  batch 1,500 loads it and reads the rest: seconds from ``iter(loader)`` to the first batch
  (the target: within 2 s; nothing consumed is replayed), rows per second for the rest, and
  the check that the rows of both runs are every row once, in the epoch's sequence.

Prints JSON: per variant, the median, min and max over the rounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import run_facts, spread

HERE = Path(__file__).resolve().parent
KEY = "h/outputs"
SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
ORDER = {"seed": 5, "with_indices": True}


def build(path: Path, rows: int) -> None:
    from lightning_iocatch.store import ShardWriter, prepare_store

    done = path / "built"
    if done.exists():
        return
    plan = prepare_store(path, "overwrite" if path.exists() else "create", SETTINGS)
    writer = ShardWriter(path, rank=0, plan=plan, durable=False)
    for first in range(0, rows, 1000):
        index = torch.arange(first, min(first + 1000, rows))
        values = torch.zeros(len(index), 32)
        values[:, 0] = index.float()
        writer.write({KEY: values}, indices=index.tolist())
    writer.close()
    done.touch()


def read(loader: Any) -> tuple[list[torch.Tensor], float, float]:
    """Every batch's indices (checked against the rows), seconds to the first, and in all."""
    start = time.perf_counter()
    first, indices = 0.0, []
    for batch in loader:
        if not indices:
            first = time.perf_counter() - start
        assert torch.equal(batch[KEY][:, 0].long(), batch["index"])
        indices.append(batch["index"])
    return indices, first, time.perf_counter() - start


def child(kind: str, path: Path) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from lightning_iocatch import StoreRows

    torch.set_num_threads(1)
    if kind == "epoch":
        data = StoreRows(path, KEY, batch_size=4096, **ORDER)
        loader = DataLoader(data, batch_size=None, num_workers=2)
        indices, first, seconds = read(loader)
        rows = sum(len(i) for i in indices)
        assert sorted(torch.cat(indices).tolist()) == list(range(data.rows))
        return {"first_batch_s": first, "rows_per_s": rows / seconds}
    fraction = int(kind.rsplit("_", 1)[1]) / 100
    truth = StoreRows(path, KEY, batch_size=10**9, **ORDER)
    (whole,) = list(truth)
    ranks = [StoreRows(path, KEY, batch_size=1000, rank=r, world_size=2, **ORDER) for r in (0, 1)]
    steps = round(fraction * len(ranks[0]))
    state = ranks[0].state_dict(batches=steps)
    per_rank = []
    for data in ranks:
        batches = []
        for batch in data:
            if len(batches) == steps:
                break
            batches.append(batch["index"])
        per_rank.append(batches)
    # the first run's steps, rank 0's batch then rank 1's
    consumed = [batch for step in zip(*per_rank, strict=True) for batch in step]
    resumed = StoreRows(path, KEY, batch_size=1500, **ORDER)
    resumed.load_state_dict(state)
    loader = DataLoader(resumed, batch_size=None, num_workers=2)
    rest, first, seconds = read(loader)
    assert torch.equal(torch.cat(consumed + rest), whole["index"])  # each row once, in order
    return {
        "first_batch_s": first,
        "rows_per_s": sum(len(i) for i in rest) / seconds,
        "rows_before": state["rows"],
        "rows_after": sum(len(i) for i in rest),
        "duplicated_or_missing": len(whole["index"]) - len(torch.cat(consumed + rest).unique()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=HERE / ".stores")
    parser.add_argument("--rows", type=int, default=10**6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    if args.quick:
        args.rows, args.repeats = 10**5, 1
    path = args.dir / f"resume-{args.rows:.0e}"
    build(path, args.rows)
    kinds = ["epoch", "resume_at_10", "resume_at_37", "resume_at_90"]
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for round_ in range(args.repeats):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            command = [sys.executable, __file__, "--child", kind, str(path)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[kind].append(json.loads(out))
    report: dict[str, Any] = run_facts(rows=args.rows, repeats=args.repeats)
    for kind, results in runs.items():
        report[kind] = {
            name: spread([float(r[name]) for r in results]) for name in sorted(results[0])
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
