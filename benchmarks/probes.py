"""Cost of validation-time probes: a validation epoch with and without IOCaptureCallback.

    python benchmarks/probes.py [--quick]

A 12-block GPT-2-style model (d=256) in a LightningModule validates 16 batches of 4x128
tokens. Rows, as median ratios to ``trainer.validate`` without the callback, measured in
the same run and interleaved:

- ``activation_stats``: ``ActivationStats`` on the outputs of all 12 blocks (target <= 1.15);
- ``stats_probe_cka``: ``ActivationStats``, a ``LinearProbe`` and ``LayerCKA`` on the same.
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
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=12, n_embd=256, n_head=8, vocab_size=1024, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2Model(config).eval()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        hidden = self.model(input_ids=batch[0]).last_hidden_state
        self.log("val_norm", hidden.norm(dim=-1).mean())


def labels_of(batch: Any) -> torch.Tensor:
    return batch[1]


def run(module: Encoder, loader: DataLoader, callbacks: list[pl.Callback]) -> float:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.validate(module, loader, verbose=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 7
    torch.manual_seed(0)
    module = Encoder()
    ids = torch.randint(0, 1024, (64, 128))
    loader = DataLoader(TensorDataset(ids, torch.randint(0, 4, (64,))), batch_size=4)
    spec = "outputs[model.h.*]"
    variants: dict[str, Callable[[], float]] = {
        "plain": lambda: run(module, loader, []),
        "activation_stats": lambda: run(
            module, loader, [IOCaptureCallback(spec, probes=[ActivationStats()])]
        ),
        "stats_probe_cka": lambda: run(
            module,
            loader,
            [
                IOCaptureCallback(
                    spec,
                    probes=[ActivationStats(), LinearProbe(labels_of, num_classes=4), LayerCKA()],
                )
            ],
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, fn in variants.items():
            elapsed = fn()
            if round_:
                samples[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    plain = medians.pop("plain")
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "repeats": repeats,
                "batches": len(loader),
                "plain_validate_s": round(plain, 3),
                **{name: round(value / plain, 3) for name, value in medians.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
