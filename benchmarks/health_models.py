"""The models ``benchmarks/health.py`` trains, each with the spec the monitor watches.

- ``mlp`` (the default): 12 blocks of ``Linear(256, 1024)``, ``GELU``, ``Linear(1024,
  256)`` as ``self.model``, SGD on one fixed batch of 64 rows, the mean square of the
  output as the loss: a step of about 40 ms on one CPU thread, where the monitor's fixed
  costs (hooks, the callback) show. Each block's output is 64 x 256 values.
- ``gpt2``: the 12-block GPT-2-style model of ``make bench`` (``common.gpt2``'s
  configuration: width 256, 8 heads, vocabulary 1,024, random weights) with its
  language-model head, SGD on one fixed batch of 8 sequences of 128 tokens, the
  next-token loss: a step of about 1.4 s, where the statistics themselves dominate.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ = 8, 128  # gpt2: sequences, tokens
ROWS, WIDTH, HIDDEN, BLOCKS = 64, 256, 1024, 12  # mlp


@dataclass(frozen=True)
class Bench:
    """A model to train and what the monitor watches of it."""

    name: str
    spec: str  # the 12 blocks' outputs
    grad_spec: str  # and their gradients
    batch: tuple[int, ...]

    def module(self) -> pl.LightningModule:
        return MLP() if self.name == "mlp" else LM()

    def data(self, steps: int) -> Dataset:
        return FixedRows(steps) if self.name == "mlp" else FixedBatch(steps)


BENCHES = {
    "mlp": Bench(
        "mlp", "outputs[model.*]", "outputs[model.*]|grad_outputs[model.*]", (ROWS, WIDTH)
    ),
    "gpt2": Bench(
        "gpt2",
        "outputs[model.transformer.h.*]",
        "outputs[model.transformer.h.*]|grad_outputs[model.transformer.h.*]",
        (BATCH, SEQ),
    ),
}


class FixedBatch(Dataset):
    """The same batch of token ids at every index (one index a step)."""

    def __init__(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 1024, (BATCH, SEQ), generator=generator)
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "attention_mask": torch.ones_like(self.ids)}


class FixedRows(Dataset):
    """The same 64 x 256 rows at every index (one index a step)."""

    def __init__(self, steps: int) -> None:
        self.rows = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows


class LM(pl.LightningModule):
    """``common.gpt2``'s configuration with its head, as ``self.model``; SGD, next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=12, n_embd=256, n_head=8, vocab_size=1024, n_positions=1024,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class MLP(pl.LightningModule):
    """12 blocks of ``Linear(256, 1024)``, ``GELU``, ``Linear(1024, 256)`` as ``self.model``;
    SGD, the mean square of the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
                for _ in range(BLOCKS)
            ]
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)
