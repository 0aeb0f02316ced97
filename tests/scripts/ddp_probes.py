"""Run by tests/test_probes.py: validation probes on 1 or 2 CPU processes.

    python tests/scripts/ddp_probes.py OUT.json DEVICES

Rank 0 writes every logged iocatch value to OUT.json.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe
from tests.lightning_models import TinyModule, loader


def labels_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (batch[1] > 0).long()


def main(out: str, devices: int) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    probes = [ActivationStats(), LinearProbe(labels_of, num_classes=2, holdout=0.3), LayerCKA()]
    callback = IOCaptureCallback("outputs[model.layers.*]", probes=probes)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.validate(module, loader(48, 8, seed=7), verbose=False)
    if trainer.global_rank == 0:
        assert callback.probes is not None
        with open(out, "w") as handle:
            json.dump(callback.probes.last_values, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
