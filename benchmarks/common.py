"""What the benchmarks share: the GPT-2-style model, a quiet Trainer, interleaved medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import GPT2Config, GPT2Model


def gpt2(n_layer: int = 12, width: int = 256, n_head: int = 8, vocab: int = 1024) -> GPT2Model:
    """A GPT-2-style model with random weights (nothing is downloaded), in eval mode."""
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=width,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2Model(config).eval()


class Encoder(pl.LightningModule):
    """A GPT-2-style model as ``self.model``; predicts hidden states, validates their norm."""

    def __init__(self, model: GPT2Model | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else gpt2()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0]).last_hidden_state

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        hidden = self.model(input_ids=batch[0]).last_hidden_state
        self.log("val_norm", hidden.norm(dim=-1).mean())


def quiet_trainer(callbacks: list[pl.Callback], accelerator: str = "cpu") -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(
    variants: dict[str, Callable[[], object]], repeats: int
) -> dict[str, float]:
    """Median seconds of each variant over ``repeats`` rounds, after one warm-up round."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, fn in variants.items():
            elapsed = seconds(fn)
            if round_:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def ratios_to_plain(medians: dict[str, float], **facts: Any) -> dict[str, Any]:
    """The printed result: run facts, the plain time, and every other variant over it."""
    plain = medians["plain"]
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **facts,
        "plain_s": round(plain, 3),
        **{name: round(value / plain, 3) for name, value in medians.items() if name != "plain"},
    }
