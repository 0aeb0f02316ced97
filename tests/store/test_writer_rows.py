"""Which captured tensors are stored row by row, and which once per batch, on a real
Hugging Face decoder: a Llama layer's inputs hold per-sample hidden states next to rotary
position embeddings and position ids with batch dimension 1.

The ground truth is Hugging Face itself: ``output_hidden_states`` for the hidden states
and the model's own ``rotary_emb`` for the position embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.names import INDEX_KEY
from tests.lightning_models import tiny_llama, trainer

LAYER = "model.model.layers.0"
PER_BATCH = (
    f"{LAYER}/inputs/kwargs/position_embeddings/0",
    f"{LAYER}/inputs/kwargs/position_embeddings/1",
    f"{LAYER}/inputs/kwargs/position_ids",
)


class Decoder(pl.LightningModule):
    """A tiny random-weight Llama (nothing downloaded); ``model.model.layers.{i}``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama(hidden_size=16, intermediate_size=32, max_position_embeddings=32)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.model(batch[0]).logits


def test_llama_layer_inputs_store_hidden_states_by_row_and_rotary_once_per_batch(
    tmp_path: Path,
) -> None:
    module = Decoder()
    ids = torch.randint(0, 64, (7, 5), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids), batch_size=3)  # batches of 3, 3 and 1
    spec = f"inputs[{LAYER}]|outputs[{LAYER}]"
    writer = FeatureWriter(tmp_path, max_shard_bytes=1 << 20)
    trainer([IOCaptureCallback(spec, writer=writer)]).predict(module, loader)

    with torch.no_grad():  # Hugging Face, batch by batch as the loop ran them
        hidden = [
            module.model(batch, output_hidden_states=True).hidden_states for (batch,) in loader
        ]
        cos, sin = module.model.model.rotary_emb(hidden[0][0], torch.arange(5)[None])
    store = FeatureStore(tmp_path)
    assert store.indices.tolist() == list(range(7))
    assert torch.equal(store[f"{LAYER}/inputs/args/0"], torch.cat([h[0] for h in hidden]))
    assert torch.equal(store[f"{LAYER}/outputs"], torch.cat([h[1] for h in hidden]))

    ((record),) = read_ledgers(tmp_path)
    assert record.per_batch == PER_BATCH and record.skipped == {}
    assert record.shapes[PER_BATCH[0]] == [1, 5, 4] and record.shapes[f"{LAYER}/outputs"] == [5, 16]
    tensors = load_file(tmp_path / record.file)
    for position, rows in enumerate([3, 3, 1]):  # the batch of one keeps them per batch
        assert len(tensors[f"b{position}/{INDEX_KEY}"]) == rows
        assert torch.equal(tensors[f"b{position}/{PER_BATCH[0]}"], cos)
        assert torch.equal(tensors[f"b{position}/{PER_BATCH[1]}"], sin)
        assert torch.equal(tensors[f"b{position}/{PER_BATCH[2]}"], torch.arange(5)[None])
