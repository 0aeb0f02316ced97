"""What the benchmarks share: the GPT-2-style model, a quiet Trainer, interleaved medians."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
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


def interleaved_ratios(
    variants: dict[str, Callable[[], object]],
    repeats: int,
    *,
    baseline: str = "plain",
    around: dict[str, Callable[[], AbstractContextManager[object]]] | None = None,
    min_seconds: float = 0.05,
) -> dict[str, Any]:
    """Each variant's time over the baseline's, round by round: median, min and max.

    One warm-up round, then ``repeats`` rounds; every round times each variant once, in
    an order reversed every other round so that neither drift nor position favours one,
    and each variant's ratio is taken to the baseline of the same round. A timing runs
    its variant as many times as the baseline needs to last ``min_seconds`` (the same
    count for every variant), so that short forwards are not lost in timer noise.
    ``around[name]`` gives a context entered before and left after each timing.
    Returns ``{"baseline_s": median seconds a call, "calls": calls a timing, name:
    {"median", "min", "max"}, ...}``.
    """
    around = around or {}
    names = list(variants)
    calls = 1
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats + 1):
        for name in names if round_ % 2 else reversed(names):
            with around.get(name, nullcontext)():
                start = time.perf_counter()
                for _ in range(calls):
                    variants[name]()
                elapsed = time.perf_counter() - start
            if round_:
                samples[name].append(elapsed)
            elif name == baseline:  # warm-up: how many calls make one timing
                calls = max(1, math.ceil(min_seconds / max(elapsed, 1e-9)))
    base = samples[baseline]
    result: dict[str, Any] = {"baseline_s": round(statistics.median(base) / calls, 5)}
    result["calls"] = calls
    for name in names:
        if name != baseline:
            ratios = [t / b for t, b in zip(samples[name], base, strict=True)]
            result[name] = spread(ratios)
    return result


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max, rounded for printing."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def run_facts(**facts: Any) -> dict[str, Any]:
    """What every printed result starts with: the torch version and thread count."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), **facts}
