"""Train a sparse autoencoder on a layer's activations, dumped to a feature store.

    .venv/bin/python examples/train_sae.py [--out runs/sae] [--sae-epochs 30]
        [--architecture topk] [--k 16]

1. Train a small MLP on scikit-learn's bundled digits (nothing is downloaded).
2. Dump the outputs of its hidden layer ``net.1`` (64 features per image) with
   IOCaptureCallback and FeatureWriter, in a predict loop that stops right after it.
3. Train a sparse autoencoder on the dump with ``Trainer.fit`` through StoreDataModule:
   ``SAEModule``, SAELens' recipe (TopK by default; BatchTopK, JumpReLU or ReLU with L1
   by ``--architecture``). The data module shuffles the rows anew every epoch and reads
   each row once per epoch.
4. Print the reconstruction error (the fraction of variance unexplained) and the mean
   number of active latents per row, before and after training.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import (
    FeatureStore,
    FeatureWriter,
    IOCaptureCallback,
    SAEModule,
    StoreDataModule,
)
from lightning_iocatch.sae import ARCHITECTURES, SparseAutoencoder

LAYER = "net.1"
KEY = f"{LAYER}/outputs"


class DigitsMLP(pl.LightningModule):
    """``net.0`` Linear(64, 64), ``net.1`` ReLU (the dumped layer), ``net.2`` Linear(64, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


@dataclass(frozen=True)
class Result:
    rows: int
    fvu_before: float
    fvu_after: float
    active_after: float
    steps: int
    seconds: float
    sae: SparseAutoencoder


def quiet_trainer(**options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def fvu_and_active(sae: SparseAutoencoder, x: torch.Tensor) -> tuple[float, float]:
    """Fraction of variance unexplained, and mean number of active latents per row."""
    training, _ = sae.training, sae.eval()  # BatchTopK encodes at its threshold in eval
    with torch.no_grad():
        latents = sae.encode(x)
        x_hat = sae.decode(latents)
    sae.train(training)
    unexplained = (x_hat - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    return float(unexplained), float((latents > 0).float().sum(-1).mean())


def run(
    out: Path,
    *,
    mlp_epochs: int = 3,
    sae_epochs: int = 30,
    codes: int = 256,
    architecture: str = "topk",
    k: float = 16,
) -> Result:
    start = time.perf_counter()
    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    data = TensorDataset(x, torch.tensor(digits.target))
    mlp = DigitsMLP()
    quiet_trainer(max_epochs=mlp_epochs).fit(mlp, DataLoader(data, batch_size=64, shuffle=True))

    features = out / "features"
    dump = IOCaptureCallback(
        f"outputs[{LAYER}]", early_exit=True, writer=FeatureWriter(features, mode="overwrite")
    )
    quiet_trainer(callbacks=[dump]).predict(
        mlp, DataLoader(data, batch_size=128), return_predictions=False
    )

    activations = StoreDataModule(features, KEY, batch_size=64, shuffle_rows=1024, seed=0)
    sparse = architecture in ("topk", "batchtopk")
    module = SAEModule(
        64,
        codes,
        architecture,  # type: ignore[arg-type]
        k=k if sparse else None,
        key=KEY,
        lr=3e-3,
        sparsity_coefficient=1e-2 if architecture == "relu" else 1e-3,
        dead_after_tokens=10 * len(x),  # dead: silent over 10 epochs of rows
    )
    every_row = FeatureStore(features)[KEY]
    fvu_before, _ = fvu_and_active(module.sae, every_row)
    trainer = quiet_trainer(max_epochs=sae_epochs)
    trainer.fit(module, datamodule=activations)
    fvu_after, active = fvu_and_active(module.sae, every_row)
    return Result(
        rows=len(every_row),
        fvu_before=fvu_before,
        fvu_after=fvu_after,
        active_after=active,
        steps=trainer.global_step,
        seconds=time.perf_counter() - start,
        sae=module.sae,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/sae"))
    parser.add_argument("--mlp-epochs", type=int, default=3)
    parser.add_argument("--sae-epochs", type=int, default=30)
    parser.add_argument("--codes", type=int, default=256)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="topk")
    parser.add_argument("--k", type=float, default=16, help="latents per row (TopK)")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*IterableDataset.*has `__len__` defined.*")
    result = run(args.out, mlp_epochs=args.mlp_epochs, sae_epochs=args.sae_epochs,
                 codes=args.codes, architecture=args.architecture, k=args.k)  # fmt: skip
    print(f"dumped {KEY}: {result.rows} rows of 64 features to {args.out / 'features'}")
    print(f"sparse autoencoder ({args.architecture}), {args.codes} latents, "
          f"{result.steps} steps:")  # fmt: skip
    print(f"  fraction of variance unexplained: {result.fvu_before:.3f} -> {result.fvu_after:.3f}")
    print(f"  active latents per row: {result.active_after:.1f} of {args.codes}")
    print(f"  {result.seconds:.1f} s in all")


if __name__ == "__main__":
    main()
