"""Run by tests/store/test_training_resume.py: ``Trainer.fit`` on a store, killed and resumed.

    python tests/scripts/train_resume.py STORE OUT --devices 2 --workers 2 --batch-size 1000
        [--kill-after-batch K] [--ckpt PATH] [--every N] [--limit L] [--persistent]
        [--steps-in-setup] [--steps-in-configure] [--accumulate N]

Each rank appends ``epoch batch rank i,j,k,...`` to ``OUT/seen-r{rank}.txt`` for every
training batch (``batch``: its place in the epoch, which Lightning counts on in a resumed
epoch); rank 0 appends to ``OUT/events.txt`` ``end EPOCH LR BATCHES`` as each epoch ends (the
learning rate of an epoch-interval StepLR, halved each epoch) and ``val EPOCH`` as each
validation ends. ``ModelCheckpoint`` saves ``OUT/ckpt/step=N.ckpt`` every ``--every`` steps;
``--kill-after-batch K`` SIGKILLs every process of the run (its process group) once batch
K of epoch 0 has ended (after the checkpoint callbacks ran), as a preemption does.
``--ckpt`` resumes from a checkpoint; ``--steps-in-setup`` reads
``trainer.estimated_stepping_batches`` in the module's ``setup``, before Lightning restores
the checkpoint (the case of Lightning issue 20550); ``--steps-in-configure`` reads it in
``configure_optimizers``, after the data module's state is restored.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import StoreDataModule

KEY = "h/outputs"


class Data(StoreDataModule):
    """The store for training, and a little validation data (validation ends each epoch)."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)


class Reader(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.args = args

    def setup(self, stage: str) -> None:
        if self.args.steps_in_setup:
            assert self.trainer.estimated_stepping_batches > 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # each row's value is its dataset index: a row that is not its index is wrong data
        assert torch.equal(batch[KEY][:, 0].long(), batch["index"]), "rows not their indices"
        line = f"{self.current_epoch} {batch_idx} {self.global_rank} "
        line += ",".join(map(str, batch["index"].tolist()))
        with (self.args.out / f"seen-r{self.global_rank}.txt").open("a") as log:
            log.write(line + "\n")
        return self.layer(batch[KEY]).pow(2).mean() * 0.0  # the weights stay as they are

    def event(self, line: str) -> None:
        if self.global_rank == 0:
            with (self.args.out / "events.txt").open("a") as log:
                log.write(line + "\n")

    def on_train_epoch_end(self) -> None:
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.event(f"end {self.current_epoch} {lr} {progress.processed}")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.layer(batch[0])

    def on_validation_epoch_end(self) -> None:
        self.event(f"val {self.current_epoch}")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 0 and batch_idx == self.args.kill_after_batch:
            os.killpg(os.getpgid(0), signal.SIGKILL)  # after the checkpoint callbacks ran

    def configure_optimizers(self) -> Any:
        if self.args.steps_in_configure:  # after the data module's state is restored
            assert self.trainer.estimated_stepping_batches > 0
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def main() -> None:
    # a hang shows where every thread of the process stood, then fails the run (a test
    # would otherwise wait for its timeout and say nothing)
    faulthandler.dump_traceback_later(240, exit=True)  # the test waits 300 s
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--kill-after-batch", type=int, default=-1)
    parser.add_argument("--ckpt")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--steps-in-setup", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps-in-configure", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = Data(
        args.store,
        KEY,
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.persistent,
        seed=11,
        shuffle_rows=8192,
        with_indices=True,
    )
    checkpoints = ModelCheckpoint(
        dirpath=args.out / "ckpt",
        filename="{step}",
        every_n_train_steps=args.every,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=2,
        limit_train_batches=args.limit,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    trainer.fit(Reader(args), datamodule=data, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main()
