"""Cost of validation-time probes: a validation epoch with and without IOCaptureCallback.

    python benchmarks/probes.py [--quick]

A 12-block GPT-2-style model (d=256) in a LightningModule validates 16 batches of 4x128
tokens. Rows, as ratios to ``trainer.validate`` without the callback in the same round
(median, min and max over interleaved rounds):

- ``activation_stats``: ``ActivationStats`` on the outputs of all 12 blocks (target <= 1.15);
- ``stats_probe_cka``: ``ActivationStats``, a ``LinearProbe`` and ``LayerCKA`` on the same.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning.pytorch as pl
import torch
from common import Encoder, interleaved_ratios, quiet_trainer, run_facts
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe


def labels_of(batch: Any) -> torch.Tensor:
    return batch[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 9
    torch.manual_seed(0)
    module = Encoder()
    ids = torch.randint(0, 1024, (64, 128))
    loader = DataLoader(TensorDataset(ids, torch.randint(0, 4, (64,))), batch_size=4)
    spec = "outputs[model.h.*]"

    def validate(callbacks: list[pl.Callback]) -> None:
        quiet_trainer(callbacks).validate(module, loader, verbose=False)

    every_probe = [ActivationStats(), LinearProbe(labels_of, num_classes=4), LayerCKA()]
    ratios = interleaved_ratios(
        {
            "plain": lambda: validate([]),
            "activation_stats": lambda: validate(
                [IOCaptureCallback(spec, probes=[ActivationStats()])]
            ),
            "stats_probe_cka": lambda: validate([IOCaptureCallback(spec, probes=every_probe)]),
        },
        repeats,
    )
    results = run_facts(repeats=repeats, batches=len(loader), **ratios)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
