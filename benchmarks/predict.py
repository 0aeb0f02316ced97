"""Time of ``trainer.predict`` with IOCaptureCallback against the same run without it.

    python benchmarks/predict.py [--quick]

A 12-block GPT-2-style model (d=256) in a LightningModule predicts 16 batches of 4x128
tokens. Rows, as ratios to ``trainer.predict`` without the callback in the same round
(median, min and max over interleaved rounds):

- ``early_exit_block0``: ``IOCaptureCallback("outputs[model.h.0]", early_exit=True)``;
- ``capture_block0``: the same capture without early exit (the whole forward runs);
- ``share_block0``: the same model with blocks 1.. and the final norm removed, the ideal.
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
from common import Encoder, gpt2, interleaved_ratios, quiet_trainer, run_facts
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import IOCaptureCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 9
    torch.manual_seed(0)
    module = Encoder()
    truncated = Encoder(gpt2(n_layer=1))
    truncated.model.load_state_dict(module.model.state_dict(), strict=False)
    truncated.model.ln_f = nn.Identity()
    loader = DataLoader(TensorDataset(torch.randint(0, 1024, (64, 128))), batch_size=4)

    def predict(model: Encoder, callbacks: list[pl.Callback]) -> None:
        quiet_trainer(callbacks).predict(model, loader, return_predictions=True)

    ratios = interleaved_ratios(
        {
            "plain": lambda: predict(module, []),
            "early_exit_block0": lambda: predict(
                module, [IOCaptureCallback("outputs[model.h.0]", early_exit=True)]
            ),
            "capture_block0": lambda: predict(module, [IOCaptureCallback("outputs[model.h.0]")]),
            "share_block0": lambda: predict(truncated, []),
        },
        repeats,
    )
    results = run_facts(repeats=repeats, batches=len(loader), **ratios)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
