"""The SAE's training step alone, ours against SAELens': the same batches, in memory.

    ../.venv-bench/bin/python sae_step_speed.py [--rounds 5] [--steps 96]   # in benchmarks/
    ../.venv-bench/bin/python sae_step_speed.py --from-store [--rounds 7] [--steps 128]

``sae_quality.py`` compares the tools as users run them: ours reads the dump through
``StoreDataModule``, SAELens' batches are a permutation of rows in memory. This script
takes the store out: both train on the same ``--steps`` batches of 1,024 random rows of
width 128 held in memory (SAELens through ``SAETrainer.step``, ours through
``Trainer.fit`` over a ``DataLoader`` of those batches), 1,024 latents, the settings of
``sae_quality.py`` (our input normalisation off, its default: SAELens' trainer has none,
so both train on every batch); for TopK, SAELens also with its sparse option
(``use_sparse_activations=True``: sparse tensors for the latents), reported as
``vs_sparse_activations``. Torch single-threaded; CPU seconds of the training itself
(SAELens' steps; ours from ``on_train_start`` to ``on_train_end``), the tools alternating;
printed per architecture as SAELens' seconds over ours (a throughput ratio), median (min
to max) over the rounds.

``--from-store``: the same, with ours as users run it, reading ``sae_quality.py``'s dump
through ``StoreDataModule`` (every row shuffled with every other, each epoch's rows read
from the shards inside the timing), and SAELens on ``--steps`` batches of a permutation
of the same rows in memory: the quality runs' throughput comparison, in more rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import sae_quality as quality
import torch
from compact_common import FULL
from torch.utils.data import DataLoader

from lightning_iocatch import StoreDataModule

WIDTH = 128


def saelens_seconds(architecture: str, batches: list[torch.Tensor], sparse: bool = False) -> float:
    _, trainer = quality.saelens_trainer(architecture, 0, batches, sparse)
    start = time.process_time()
    quality.step_all(trainer, batches)
    return time.process_time() - start


def sparse_failure(batches: list[torch.Tensor]) -> str:
    """Why SAELens' TopK with ``use_sparse_activations=True`` cannot train here, or ``""``
    (its sparse tensors' backward fails on the CPU with torch 2.13)."""
    try:
        saelens_seconds("topk", batches[:2], sparse=True)
    except (NotImplementedError, RuntimeError) as error:
        return f"fails: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return ""


class _Timed(pl.Callback):
    seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.process_time() - self.start


def our_seconds(architecture: str, batches: list[torch.Tensor]) -> float:
    module = quality.our_module(architecture, 0, WIDTH, len(batches))
    timed = _Timed()
    trainer = quality.fit_trainer(1, callbacks=[timed])
    trainer.fit(module, DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
    return timed.seconds


def our_seconds_from_store(
    architecture: str, batches: list[torch.Tensor], *, path: Path, key: str, rows: int
) -> float:
    """``our_seconds`` with ours reading ``len(batches)`` batches of the dump ``path``
    (``rows`` rows, every one shuffled with every other) instead of ``batches``."""
    data = StoreDataModule(path, key, batch_size=quality.BATCH, seed=0, drop_last=True,
                           shuffle_rows=rows)  # fmt: skip
    module = quality.our_module(architecture, 0, WIDTH, len(batches), key=key)
    timed = _Timed()
    trainer = quality.fit_trainer(1, callbacks=[timed], max_steps=len(batches))
    trainer.fit(module, datamodule=data)
    return timed.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--only", default=",".join(quality.ARCHITECTURES))
    parser.add_argument("--from-store", action="store_true", help="ours reading the dump")
    args = parser.parse_args()
    quality.quiet()
    torch.set_num_threads(1)
    ours: Callable[[str, list[torch.Tensor]], float] = our_seconds
    if args.from_store:
        path, rows, _ = quality.rows_store(FULL, quality.HERE / ".stores")
        batches = quality.permuted_batches(rows, 0, 1)[: args.steps]
        ours = functools.partial(our_seconds_from_store, path=path, key=FULL.key,
                                 rows=rows.shape[0])  # fmt: skip
    else:
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randn(quality.BATCH, WIDTH, generator=generator)
                   for _ in range(args.steps)]  # fmt: skip
    report: dict[str, Any] = {
        "torch": torch.__version__, "steps": args.steps, "from_store": args.from_store
    }  # fmt: skip
    for architecture in args.only.split(","):
        ratios: dict[str, list[float]] = {"saelens": [], "saelens_sparse": []}
        sparse_fails = architecture == "topk" and sparse_failure(batches)
        for round_ in range(args.rounds):
            order = [("saelens", saelens_seconds), ("ours", ours)]
            if architecture == "topk" and not sparse_fails:  # SAELens' sparse latents
                order.append(("saelens_sparse", functools.partial(saelens_seconds, sparse=True)))
            seconds = {name: run(architecture, batches) for name, run in
                       (order if round_ % 2 else order[::-1])}  # fmt: skip
            for name in ratios:
                if name in seconds:
                    ratios[name].append(seconds[name] / seconds["ours"])
        report[architecture] = {
            "throughput_ratio": round(statistics.median(ratios["saelens"]), 3),
            "min": round(min(ratios["saelens"]), 3),
            "max": round(max(ratios["saelens"]), 3),
        }
        if sparse_fails:
            report[architecture]["vs_sparse_activations"] = sparse_fails
        if ratios["saelens_sparse"]:
            found = ratios["saelens_sparse"]
            report[architecture]["vs_sparse_activations"] = [
                round(statistics.median(found), 3), round(min(found), 3), round(max(found), 3)
            ]  # fmt: skip
        print(architecture, report[architecture], flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
