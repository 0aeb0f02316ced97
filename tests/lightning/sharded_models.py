"""A tiny Llama LightningModule that shards itself as users do: tensor parallelism (torch's
``parallelize_module`` plan, or Hugging Face's own plan) or FSDP2, in ``configure_model``
under Lightning's ``ModelParallelStrategy``; unsharded with ``plan="none"`` (the truth).

Layer 0's MLP and attention are column/row split with local outputs (the hooks see local
shards: ``gate_proj``, ``up_proj``, ``act_fn``, ``q_proj``); layer 1's MLP keeps DTensors
(``use_local_output=False``): ``act_fn`` and ``down_proj``'s input are DTensors there.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from tests.lightning_models import tiny_llama

VOCAB, WIDTH = 64, 32
PLANS = ("none", "torch", "hf", "fsdp")
SITES = [
    "model.model.layers.0",
    "model.model.layers.0.mlp.gate_proj",
    "model.model.layers.0.mlp.act_fn",
    "model.model.layers.0.self_attn.q_proj",
    "model.model.layers.1.mlp.act_fn",
    "model.model.layers.1.mlp.up_proj",
]
INPUT_SITES = ["model.model.layers.0.mlp.down_proj", "model.model.layers.1.mlp.down_proj"]
SPEC = f"outputs[{'|'.join(SITES)}]|inputs[{'|'.join(INPUT_SITES)}]"


class ShardedLlama(pl.LightningModule):
    """A 2-layer Llama (hidden 32, MLP 64, 4 heads, 2 KV heads) sharded by ``plan``."""

    def __init__(self, plan: str = "none", lr: float = 0.0) -> None:
        super().__init__()
        assert plan in PLANS
        self.plan, self.lr = plan, lr
        self.model = tiny_llama(attn_implementation="eager", use_cache=False)
        self._sharded = False
        self.computed: list[int] = []  # the predict batches that ran

    def configure_model(self) -> None:
        if self.plan == "none" or self._sharded:
            return
        self._sharded = True
        if self.plan == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            return
        mesh = self.device_mesh["tensor_parallel"]
        if self.plan == "hf":
            from transformers import DistributedConfig
            from transformers.distributed.tensor_parallel import apply_tensor_parallelism

            plan, _, _ = self.model._resolve_parallel_plans(DistributedConfig(tp_size=2))
            apply_tensor_parallelism(self.model, mesh, plan)
            return
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for i, layer in enumerate(self.model.model.layers):
            local = i == 0  # layer 1 hands DTensors on inside its MLP
            parallelize_module(
                layer,
                mesh,
                {
                    "self_attn.q_proj": ColwiseParallel(),
                    "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(),
                    "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(use_local_output=local),
                    "mlp.up_proj": ColwiseParallel(use_local_output=local),
                    "mlp.down_proj": RowwiseParallel(),
                },
            )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.computed.append(batch_idx)
        self(batch["input_ids"], batch["attention_mask"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch["input_ids"], batch["attention_mask"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch["input_ids"], batch["attention_mask"])
        logits = out.logits[:, :-1].reshape(-1, VOCAB).float()
        targets = batch["input_ids"][:, 1:].reshape(-1)  # summed: a sample's gradient is its own
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def samples(n: int, length: int = 10) -> list[dict[str, torch.Tensor]]:
    """``n`` right-padded token sequences (0-3 padding tokens) with a corrupted copy."""
    generator = torch.Generator().manual_seed(5)
    data = []
    for index in range(n):
        mask = torch.ones(length, dtype=torch.long)
        mask[length - index % 4 :] = 0
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        corrupted = ids.clone()
        corrupted[3:5] = torch.randint(0, VOCAB, (2,), generator=generator)
        data.append({"input_ids": ids, "attention_mask": mask, "corrupted_input_ids": corrupted})
    return data


def loader(n: int = 13, batch_size: int = 2) -> DataLoader:
    return DataLoader(samples(n), batch_size=batch_size)


def forward(module: pl.LightningModule, batch: dict[str, torch.Tensor]) -> Any:
    return module(batch["input_ids"], batch["attention_mask"])
