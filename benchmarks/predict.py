"""Time of ``trainer.predict`` with IOCaptureCallback against the same run without it.

    python benchmarks/predict.py [--quick]

A 12-block GPT-2-style model (d=256) in a LightningModule predicts 16 batches of 4x128
tokens. Rows, as median ratios to ``trainer.predict`` without the callback, measured in
the same run and interleaved:

- ``early_exit_block0``: ``IOCaptureCallback("outputs[model.h.0]", early_exit=True)``;
- ``capture_block0``: the same capture without early exit (the whole forward runs);
- ``share_block0``: the same model with blocks 1.. and the final norm removed, the ideal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import IOCaptureCallback


class Encoder(pl.LightningModule):
    def __init__(self, n_layer: int = 12) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=n_layer, n_embd=256, n_head=8, vocab_size=1024, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2Model(config).eval()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0]).last_hidden_state


def run_predict(module: Encoder, loader: DataLoader, callbacks: list[pl.Callback]) -> float:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.predict(module, loader, return_predictions=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 7
    torch.manual_seed(0)
    module = Encoder()
    truncated = Encoder(n_layer=1)
    truncated.model.load_state_dict(module.model.state_dict(), strict=False)
    truncated.model.ln_f = nn.Identity()
    ids = torch.randint(0, 1024, (64, 128))
    loader = DataLoader(TensorDataset(ids), batch_size=4)

    variants: dict[str, Callable[[], float]] = {
        "plain": lambda: run_predict(module, loader, []),
        "early_exit_block0": lambda: run_predict(
            module, loader, [IOCaptureCallback("outputs[model.h.0]", early_exit=True)]
        ),
        "capture_block0": lambda: run_predict(
            module, loader, [IOCaptureCallback("outputs[model.h.0]")]
        ),
        "share_block0": lambda: run_predict(truncated, loader, []),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, fn in variants.items():
            elapsed = fn()
            if round_:
                samples[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    plain = medians["plain"]
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "repeats": repeats,
                "batches": len(loader),
                "plain_predict_s": round(plain, 3),
                **{
                    name: round(value / plain, 3)
                    for name, value in medians.items()
                    if name != "plain"
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
