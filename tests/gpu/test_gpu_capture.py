"""The GPU path: asynchronous CUDA-to-CPU captures into pinned memory, checked bit for bit.

Skipped without CUDA. Every captured tensor must equal a synchronous ``.cpu()`` copy of
the same forward, also when the allocator reuses the model's memory right after the
capture hooks ran and when the pinned budget is small enough to be waited on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, ModelIOCatcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = "outputs[h.1|h.3|h.5]|inputs[h.2]"


def gpt2(layers: int = 6) -> GPT2Model:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=256, n_head=8, vocab_size=512, bos_token_id=0, eos_token_id=0
    )
    return GPT2Model(config).to("cuda", torch.bfloat16).eval()


def pressure() -> None:
    """Allocate and overwrite freed GPU memory, as the next batch's activations would."""
    junk = [torch.full((8 << 20,), float("nan"), device="cuda") for _ in range(8)]
    del junk


def flat(buffer: Any) -> list[torch.Tensor]:
    tensors = []
    for name in sorted(buffer):
        for entry in buffer[name]["outputs"]:
            tensors.append(entry)
        for entry in buffer[name]["inputs"]:
            tensors.append(entry["args"][0])
    return tensors


@pytest.mark.parametrize("early_exit", [False, True])
def test_async_captures_equal_synchronous_copies(early_exit: bool) -> None:
    model = gpt2()
    batches = [torch.randint(0, 512, (8, 128), device="cuda") for _ in range(200)]
    fast = ModelIOCatcher(model, "cpu", pinned_memory_bytes=16 << 20)  # small: it gets waited on
    slow = ModelIOCatcher(model, "cpu", pinned_memory_bytes=0)
    with torch.no_grad(), fast.from_spec(SPEC, early_exit=early_exit) as got:
        for ids in batches:
            fast.run(ids)
            pressure()
    with torch.no_grad(), slow.from_spec(SPEC, early_exit=early_exit) as expected:
        for ids in batches:
            slow.run(ids)
    got_tensors, expected_tensors = flat(got), flat(expected)
    assert len(got_tensors) == len(expected_tensors) == 200 * 4
    for a, b in zip(got_tensors, expected_tensors, strict=True):
        assert a.device.type == "cpu" and a.dtype == torch.bfloat16
        assert torch.equal(a, b)
    assert fast.transfer.budget is not None and fast.transfer.budget.peak <= 16 << 20


def test_captures_read_inside_the_session_are_complete() -> None:
    model = gpt2()
    to_cpu = ModelIOCatcher(model, "cpu")
    on_gpu = ModelIOCatcher(model, None)  # a private copy on the GPU, stream-ordered
    with (
        torch.no_grad(),
        to_cpu.from_spec("outputs[h.5]", False) as cpu_buf,
        on_gpu.from_spec("outputs[h.5]", False) as gpu_buf,
    ):
        for _ in range(50):
            model(torch.randint(0, 512, (8, 128), device="cuda"))
            captured = cpu_buf["h.5"]["outputs"][-1]  # read at once: must wait for the copy
            pressure()
            assert torch.equal(captured, gpu_buf["h.5"]["outputs"][-1].cpu())


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0]).last_hidden_state


def test_predict_dump_equals_the_synchronous_path(tmp_path: Path) -> None:
    ids = torch.randint(0, 512, (256, 64))
    stores = {}
    for name, pinned in (("async", 64 << 20), ("sync", 0)):
        writer = FeatureWriter(tmp_path / name, max_shard_bytes=4 << 20)
        callback = IOCaptureCallback(
            "outputs[model.h.2|model.h.4]",
            early_exit=True,
            writer=writer,
            pinned_memory_bytes=pinned,
        )
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            callbacks=[callback],
        )
        trainer.predict(
            Encoder(), DataLoader(TensorDataset(ids), batch_size=16), return_predictions=False
        )
        stores[name] = FeatureStore(tmp_path / name)
    assert stores["async"].keys() == stores["sync"].keys()
    for key in stores["sync"]:
        assert torch.equal(stores["async"][key], stores["sync"][key]), key
