"""The main job, end to end, on scikit-learn's bundled digits (nothing is downloaded).

    make demo        # or: .venv/bin/python examples/demo.py [--epochs 12] [--out runs/demo]

1. Train a small MLP (``net.layers.0`` .. ``net.layers.3``, then ``net.head``) with
   Lightning, with validation probes on every layer: ActivationStats, a LinearProbe on the
   digit labels, LayerCKA. Values go to a CSVLogger.
2. ``trainer.predict`` with early exit after the penultimate layer, dumping its features
   with FeatureWriter.
3. Open the dump with FeatureStore and fit a logistic regression on the features of one
   part of the data, scored on the rest.
4. Print a summary table; write ``probe_by_layer.png`` and ``cka.png``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback
from lightning_iocatch.plots import read_metrics_csv, save_probe_figures
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe

WIDTHS = (64, 128, 128, 64, 32)
PENULTIMATE = f"net.layers.{len(WIDTHS) - 2}"


class DigitsNet(pl.LightningModule):
    """An MLP whose blocks are ``net.layers.{i}`` (Linear + ReLU) and ``net.head``."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Module()
        self.net.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in itertools.pairwise(WIDTHS)
        )
        self.net.head = nn.Linear(WIDTHS[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net.layers:
            x = layer(x)
        return self.net.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digit_labels(batch: Any) -> torch.Tensor:
    return batch[1]


@dataclass
class DemoResult:
    out: Path
    probe_acc: dict[str, float]
    dead_frac: dict[str, float]
    rows_dumped: int
    bytes_dumped: int
    dataset_size: int
    feature_classifier_acc: float
    figures: list[Path]
    seconds: dict[str, float]


def digits() -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    data = load_digits()  # 1,797 8x8 images shipped inside scikit-learn
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:1000], order[1000:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val]), TensorDataset(x, y)


def quiet_trainer(**options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )


def run(epochs: int = 12, out: str | Path = "runs/demo") -> DemoResult:
    """Train with probes, dump features with early exit, read them back, draw the figures."""
    out = Path(out)
    pl.seed_everything(0, verbose=False)
    train, val, everything = digits()
    model = DigitsNet()
    seconds = {}

    probes = [ActivationStats(), LinearProbe(digit_labels, num_classes=10), LayerCKA()]
    watch = IOCaptureCallback("outputs[net.layers.*]", stages=["validate"], probes=probes)
    logger = CSVLogger(out, name="logs")
    start = time.perf_counter()
    quiet_trainer(max_epochs=epochs, logger=logger, callbacks=[watch], log_every_n_steps=10).fit(
        model, DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=128)
    )
    seconds["train"] = time.perf_counter() - start

    writer = FeatureWriter(out / "features", mode="overwrite", max_shard_bytes=1 << 20)
    dump = IOCaptureCallback(f"outputs[{PENULTIMATE}]", early_exit=True, writer=writer)
    start = time.perf_counter()
    quiet_trainer(logger=False, callbacks=[dump]).predict(
        model, DataLoader(everything, batch_size=256), return_predictions=False
    )
    seconds["dump"] = time.perf_counter() - start

    store = FeatureStore(out / "features")
    features = store[f"{PENULTIMATE}/outputs"].numpy()
    labels = everything.tensors[1][store.indices].numpy()
    fit_part = np.arange(len(labels)) % 5 != 0  # every fifth sample is held out
    classifier = LogisticRegression(max_iter=2000).fit(features[fit_part], labels[fit_part])
    accuracy = float(classifier.score(features[~fit_part], labels[~fit_part]))

    assert watch.probes is not None
    last = watch.probes.last_values
    layers = [f"net.layers.{i}" for i in range(len(WIDTHS) - 1)]
    figures = save_probe_figures(read_metrics_csv(Path(logger.log_dir) / "metrics.csv"), out)
    return DemoResult(
        out=out,
        probe_acc={layer: last[f"iocatch/{layer}/outputs/probe_acc"] for layer in layers},
        dead_frac={layer: last[f"iocatch/{layer}/outputs/dead_frac"] for layer in layers},
        rows_dumped=len(store),
        bytes_dumped=store.metadata["bytes"],
        dataset_size=len(everything),
        feature_classifier_acc=accuracy,
        figures=figures,
        seconds=seconds,
    )


def summary(result: DemoResult) -> str:
    lines = ["", "layer            probe acc (held out)   dead units"]
    for layer, accuracy in result.probe_acc.items():
        lines.append(f"{layer:<16} {accuracy:>20.3f}   {result.dead_frac[layer]:>10.1%}")
    lines += [
        "",
        f"dumped {PENULTIMATE}/outputs: {result.rows_dumped} of {result.dataset_size} rows, "
        f"{result.bytes_dumped / 1024:.0f} KiB in {result.out / 'features'}",
        f"logistic regression on the dumped features, held-out accuracy: "
        f"{result.feature_classifier_acc:.3f}",
        f"time: training with probes {result.seconds['train']:.1f} s, "
        f"predict dump with early exit {result.seconds['dump']:.1f} s",
        "figures: " + ", ".join(str(path) for path in result.figures),
    ]
    return "\n".join(lines)


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banners
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args()
    print(summary(run(args.epochs, args.out)))


if __name__ == "__main__":
    main()
