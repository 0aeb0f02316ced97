"""Predict-loop dumps through FeatureWriter: throughput, predict slowdown, peak memory.

    python benchmarks/dump.py [--quick]

Prints JSON with, in one run:

- ``write_throughput``: bytes per second of FeatureWriter (checksum, fsync, atomic
  rename, ledger) writing a stream of captured batches, against
  ``safetensors.torch.save_file`` + ``os.fsync`` writing the same tensors in the same
  shard sizes, both into fresh directories, interleaved (target ratio >= 0.8; median,
  min and max of the per-round ratio). Only durable writes are compared: a write left
  in the page cache measures the cache, not the writer;
- ``predict_slowdown``: ``trainer.predict`` of a 12-block GPT-2-style model dumping the
  output of block 6, against the same predict without the callback;
- ``peak_rss``: peak RSS of a fresh process dumping 1 shard's worth of data and one
  dumping 20 shards' worth (it must not grow with the data).
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
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import Encoder, interleaved_ratios, quiet_trainer, run_facts
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_iocatch import BatchCaptures, CaptureBuffer, FeatureWriter, IOCaptureCallback


def fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def write_throughput(root: Path, batches: int, shard_bytes: int, repeats: int) -> dict[str, Any]:
    """FeatureWriter against plain ``save_file`` + fsync on identical tensors and shards.

    Both durable: data on disk, not in the page cache, when the timing ends. Each round
    writes into fresh directories, in an order reversed every other round.
    """
    data = [torch.randn(32, 128, 768) for _ in range(batches)]  # 12.6 MB a batch
    indices = tuple(range(32))
    trainer = quiet_trainer([])  # for its rank and broadcast only

    def ours() -> None:
        writer = FeatureWriter(fresh(root / "ours"), max_shard_bytes=shard_bytes)
        writer.on_loop_start(trainer, None, "predict")  # type: ignore[arg-type]
        for batch_idx, batch in enumerate(data):
            rows = tuple(batch_idx * 32 + i for i in indices)
            captures = CaptureBuffer({"h.6": {"inputs": [], "outputs": [batch]}})
            writer.on_batch(BatchCaptures("predict", batch_idx, 0, captures, rows))
        writer.on_loop_end(trainer, None, "predict")  # type: ignore[arg-type]

    def plain() -> None:
        directory = fresh(root / "plain")
        per_shard = max(1, shard_bytes // (data[0].numel() * 4))
        for shard in range(0, batches, per_shard):
            chunk = data[shard : shard + per_shard]
            tensors = {f"b{j}/h.6/outputs": batch for j, batch in enumerate(chunk)}
            path = directory / f"{shard}.safetensors"
            save_file(tensors, str(path))
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())

    ratios = interleaved_ratios({"plain": plain, "ours": ours}, repeats)
    times, plain_s = ratios["ours"], ratios["baseline_s"]
    total = batches * data[0].numel() * 4
    return {
        "bytes": total,
        "save_file_fsync_MBps": round(total / plain_s / 1e6, 1),
        # throughput ratio ours/plain is the inverse of the time ratio
        "ratio": {
            "median": round(1 / times["median"], 3),
            "min": round(1 / times["max"], 3),
            "max": round(1 / times["min"], 3),
        },
    }


def predict_slowdown(root: Path, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Encoder()
    loader = DataLoader(TensorDataset(torch.randint(0, 1024, (64, 128))), batch_size=4)

    def predict(with_writer: bool) -> None:
        callbacks: list[pl.Callback] = []
        if with_writer:
            writer = FeatureWriter(fresh(root / "predict"))
            callbacks = [IOCaptureCallback("outputs[model.h.6]", writer=writer)]
        quiet_trainer(callbacks).predict(module, loader, return_predictions=False)

    ratios = interleaved_ratios(
        {"plain": lambda: predict(False), "with_writer": lambda: predict(True)}, repeats
    )
    return {"batches": len(loader), **ratios}


class RandomRows(Dataset[torch.Tensor]):
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(256, generator=torch.Generator().manual_seed(index))


class Widen(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.widen = nn.Linear(256, 2048)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.widen(batch)


def rss_child(path: str, shards: int, shard_bytes: int) -> None:
    """Dump ``shards`` shards' worth of (64, 2048) float32 rows, then print peak RSS in MiB."""
    rows = shards * shard_bytes // (2048 * 4)
    writer = FeatureWriter(path, max_shard_bytes=shard_bytes)
    callback = IOCaptureCallback("outputs[widen]", writer=writer)
    trainer = quiet_trainer([callback])
    trainer.predict(Widen(), DataLoader(RandomRows(rows), batch_size=64), return_predictions=False)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": rows, "bytes": writer.bytes_written, "peak_rss_MiB": peak_kib >> 10}))


def peak_rss(root: Path, shard_bytes: int) -> dict[str, Any]:
    results = {}
    for shards in (1, 20):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--rss-child",
                str(fresh(root / f"rss{shards}")),
                str(shards),
                str(shard_bytes),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results[f"{shards}_shards"] = json.loads(out.strip().splitlines()[-1])
    one, twenty = results["1_shards"]["peak_rss_MiB"], results["20_shards"]["peak_rss_MiB"]
    return {**results, "shard_bytes": shard_bytes, "growth_MiB": twenty - one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--rss-child", nargs=3, metavar=("PATH", "SHARDS", "SHARD_BYTES"))
    args = parser.parse_args()
    if args.rss_child:
        path, shards, shard_bytes = args.rss_child
        rss_child(path, int(shards), int(shard_bytes))
        return
    root = Path(tempfile.mkdtemp(prefix="iocatch-bench-"))
    try:
        results = {
            **run_facts(),
            "write_throughput": write_throughput(
                root,
                batches=8 if args.quick else 80,
                shard_bytes=64 << 20,
                repeats=1 if args.quick else 5,
            ),
            "predict_slowdown": predict_slowdown(root, repeats=1 if args.quick else 5),
            "peak_rss": peak_rss(root, shard_bytes=(2 if args.quick else 32) << 20),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
