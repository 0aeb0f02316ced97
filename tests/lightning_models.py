"""Tiny LightningModules and data for driving a real Trainer in tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from lightning_iocatch.store.training import INDEX
from tests.conftest import Counter, RowLinear, hook_count

WIDTH = 8


class TinyNet(nn.Module):
    """``layers.{i}`` Linear+Tanh blocks and a counting ``tail``."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(RowLinear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth)
        )
        self.tail = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.tail(x)


class TinyModule(pl.LightningModule):
    """``self.model`` is a :class:`TinyNet`; names are ``model.layers.{i}``."""

    def __init__(self, model: nn.Module | None = None, fail_at_batch: int | None = None) -> None:
        super().__init__()
        self.model = model if model is not None else TinyNet()
        self.head = RowLinear(WIDTH, 1)
        self.fail_at_batch = fail_at_batch
        self.hooks_seen_in_training: list[int] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.hooks_seen_in_training.append(hook_count(self))
        x, y = batch
        return nn.functional.mse_loss(self(x).squeeze(-1), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if batch_idx == self.fail_at_batch:
            raise RuntimeError("boom in predict_step")
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def dataset(n: int = 20, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, WIDTH, generator=generator), torch.randn(n, generator=generator)
    )


def loader(n: int = 20, batch_size: int = 6, seed: int = 0) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=batch_size)


ID_STEP = 10**12  # document ids far apart, as a corpus keyed by id has them


class DocumentIds(Dataset):
    """``dataset(n)``'s rows keyed by document id ``k * step`` (a map-style dataset that
    ``len`` does not bound): item ``k * step`` is ``(row k, k * step)``."""

    def __init__(self, n: int, step: int = ID_STEP) -> None:
        self.rows, self.step = dataset(n).tensors[0], step

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, doc_id: int) -> tuple[torch.Tensor, int]:
        return self.rows[doc_id // self.step], doc_id


class IdSampler(Sampler[int]):
    """The ids of a :class:`DocumentIds`, in order."""

    def __init__(self, data: DocumentIds) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, len(self.data) * self.data.step, self.data.step))


def document_loader(n: int, batch_size: int) -> DataLoader:
    data = DocumentIds(n)
    return DataLoader(data, batch_size=batch_size, sampler=IdSampler(data))


def trainer(callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def manual_outputs(module: TinyModule, x: torch.Tensor) -> list[torch.Tensor]:
    """Outputs of each ``model.layers.{i}``, by hand."""
    outs = []
    with torch.no_grad():
        for layer in module.model.layers:
            x = layer(x)
            outs.append(x)
    return outs


def tiny_llama(**config: Any) -> Any:
    """A Llama-style causal LM with random weights (nothing downloaded), in eval mode.

    ``config`` overrides the small defaults of its ``LlamaConfig``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    options: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    options.update(config)
    return LlamaForCausalLM(LlamaConfig(**options)).eval()


class SAE(nn.Module):
    """A sparse autoencoder of ``width`` inputs and 64 latents with seeded random weights:
    ``decoder(relu(encoder(h)))``, for splicing into a model."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.encoder, self.decoder = nn.Linear(width, 64), nn.Linear(64, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.encoder(h)))


class IndexRecorder(pl.LightningModule):
    """Trains a ``Linear(8, 1)`` on ``batch[key]`` of a store's rows and records the dataset
    indices (``StoreRows(with_indices=True)``'s entry) of every training batch, by epoch."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.layer = nn.Linear(8, 1)
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).append(batch[INDEX].tolist())
        return self.layer(batch[self.key]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
