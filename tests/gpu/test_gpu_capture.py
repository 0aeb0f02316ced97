"""The GPU path on a real CUDA device, checked bit for bit against synchronous copies.

Skipped without CUDA (run it with `benchmarks/gpu_check.sh`). The ground truth is a
plain hook that clones the value on the model's stream at capture time, in the same forward
(a blocking ``.cpu()`` there would drain the stream and hide the race being tested), read
after ``torch.cuda.synchronize()``, on models whose next op after a captured module works
in place: a ResNet block's
``out += identity`` after its last batch norm, ``ReLU(inplace=True)``, and a module that
modifies its own input. Hundreds of batches run with the allocator under pressure, with
and without early exit, with a ring far smaller than one forward's captures.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, ModelIOCatcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Doubler(nn.Module):
    """Modifies its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)  # overwrites bn1's output
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.doubler = Doubler()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # overwrites bn2's output
        return self.relu(self.doubler(out))


def resnet(blocks: int = 4, channels: int = 64) -> nn.Module:
    torch.manual_seed(0)
    layers = [ResBlock(channels) for _ in range(blocks)]
    return nn.Sequential(*layers).to("cuda").eval()


SPEC_OUT = ["*.bn1", "*.bn2"]
SPEC_IN = ["*.doubler"]


def truth_hooks(model: nn.Module, sink: list[torch.Tensor]) -> list[Any]:
    """Clones on the model's stream, never a synchronous copy: the stream keeps running ahead."""
    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("bn1", "bn2"):
            handles.append(module.register_forward_hook(lambda m, a, o: sink.append(o.clone())))
        if leaf == "doubler":
            handles.append(module.register_forward_pre_hook(lambda m, a: sink.append(a[0].clone())))
    return handles


def pressure() -> None:
    """Allocate and overwrite freed GPU memory, as the next batch's activations would."""
    junk = [torch.full((8 << 20,), float("nan"), device="cuda") for _ in range(8)]
    del junk


def in_call_order(buffer: Any, model: nn.Module) -> list[torch.Tensor]:
    """The captured tensors in the order the truth hooks saw them, batch after batch."""
    per_module = []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("bn1", "bn2"):
            per_module.append(buffer[name]["outputs"])
        elif leaf == "doubler":
            per_module.append([entry["args"][0] for entry in buffer[name]["inputs"]])
    batches = len(per_module[0])
    return [values[i] for i in range(batches) for values in per_module]


@pytest.mark.parametrize("early_exit", [False, True])
def test_captures_equal_synchronous_copies_despite_in_place_ops(early_exit: bool) -> None:
    model = resnet()
    truth: list[torch.Tensor] = []
    handles = truth_hooks(model, truth)
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=8 << 20)  # < one forward
    batches = 100  # the truth stays on the GPU until the end: 2.4 GiB of clones
    with torch.no_grad(), catcher(inputs=SPEC_IN, outputs=SPEC_OUT, early_exit=early_exit):
        session = catcher.session
        assert session is not None
        got: list[torch.Tensor] = []
        for _ in range(batches):
            catcher.run(torch.randn(8, 64, 32, 32, device="cuda"))
            pressure()
            got += in_call_order(session.take(), model)
    for handle in handles:
        handle.remove()
    torch.cuda.synchronize()  # only now: every clone of the truth has landed
    # with early exit the forward stops at the last block's doubler input: still 12 a batch
    assert len(got) == len(truth) == batches * 12
    for a, b in zip(got, truth, strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b.cpu())
    assert catcher.transfer.host is not None
    assert catcher.transfer.host.ring.peak_in_flight <= 8 << 20


def test_captures_larger_than_the_ring_never_stall() -> None:
    model = resnet(blocks=8, channels=128)
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=4 << 20)  # ~1/40 of a forward
    x = torch.randn(16, 128, 32, 32, device="cuda")
    times = []
    with torch.no_grad(), catcher(outputs=SPEC_OUT) as _:
        session = catcher.session
        assert session is not None
        for _ in range(30):
            start = time.perf_counter()
            model(x)
            session.take()
            times.append(time.perf_counter() - start)
    assert max(times[2:]) < 1.0, f"a batch took {max(times):.2f} s: the ring stalled"
    assert catcher.transfer.host is not None and catcher.transfer.host.ring.waits > 0


def test_captures_read_inside_the_session_are_complete() -> None:
    model = resnet()
    to_cpu = ModelIOCatcher(model, "cpu")
    on_gpu = ModelIOCatcher(model, None)  # a private copy on the GPU, stream-ordered
    with (
        torch.no_grad(),
        to_cpu(outputs=["3.bn2"]) as cpu_buf,
        on_gpu(outputs=["3.bn2"]) as gpu_buf,
    ):
        for _ in range(50):
            model(torch.randn(8, 64, 32, 32, device="cuda"))
            captured = cpu_buf["3.bn2"]["outputs"][-1]  # read at once: waits for the copy
            pressure()
            assert torch.equal(captured, gpu_buf["3.bn2"]["outputs"][-1].cpu())


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = resnet()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def test_predict_dump_equals_the_synchronous_path(tmp_path: Path) -> None:
    images = torch.randn(256, 64, 16, 16)
    stores = {}
    for name, pinned in (("async", 2 << 20), ("sync", 0)):
        writer = FeatureWriter(tmp_path / name, max_shard_bytes=4 << 20)
        callback = IOCaptureCallback(
            "outputs[model.1.bn2|model.3.bn2]",
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
            Encoder(), DataLoader(TensorDataset(images), batch_size=16), return_predictions=False
        )
        stores[name] = FeatureStore(tmp_path / name)
    assert stores["async"].keys() == stores["sync"].keys()
    for key in stores["sync"]:
        assert torch.equal(stores["async"][key], stores["sync"][key]), key


class Tokens(pl.LightningModule):
    """Embedding, a Linear whose output the next op overwrites in place, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 256)
        self.proj = nn.Linear(256, 256)
        self.head = nn.Linear(256, 4)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.proj(self.embed(batch["input_ids"]))
        return self.head(hidden.mul_(3.0))  # in place, right after the captured module


def test_token_rows_on_the_gpu_copy_only_selected_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_iocatch import TokenRows
    from lightning_iocatch.capture.host_copy import HostCopier

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (64, 32), generator=generator)
    lengths = torch.randint(1, 33, (64,), generator=generator)
    mask = (torch.arange(32)[None] < lengths[:, None]).long()
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask, strict=True)]
    copied: list[tuple[int, ...]] = []
    real_copy = HostCopier.copy

    def spy(self: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        copied.append(tuple(tensor.shape))
        return real_copy(self, tensor, *args)

    monkeypatch.setattr(HostCopier, "copy", spy)
    writer = FeatureWriter(tmp_path, tokens=TokenRows(drop_first=True))
    callback = IOCaptureCallback("outputs[proj]", writer=writer, pinned_memory_bytes=1 << 20)
    trainer = pl.Trainer(accelerator="gpu", devices=1, logger=False, callbacks=[callback])
    module = Tokens()
    trainer.predict(module, DataLoader(rows, batch_size=8), return_predictions=False)

    module = module.cpu()
    with torch.no_grad():
        truth = module.proj(module.embed(ids))  # the CPU reference, token by token below
    want = [truth[i, p] for i in range(64) for p in range(1, int(lengths[i]))]
    store = FeatureStore(tmp_path)
    torch.testing.assert_close(store["proj/outputs"], torch.stack(want), rtol=1e-4, atol=1e-5)
    assert sum(shape[0] for shape in copied) == len(want)  # padding never left the GPU


def test_captures_made_in_inference_mode_read_after_the_block() -> None:
    model = resnet()
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=8 << 20)
    x = torch.randn(8, 64, 32, 32, device="cuda")
    with catcher(outputs=["3.bn2"]) as buf, torch.inference_mode():
        model(x)
    with torch.inference_mode():
        truth = model[:3](x)
        truth = model[3].bn2(model[3].conv2(model[3].relu(model[3].bn1(model[3].conv1(truth)))))
    assert torch.equal(buf["3.bn2"]["outputs"][0], truth.cpu())


class FailsAfterACapture(Encoder):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.model[:2](batch[0])  # model.1.bn2 is captured (staged) in here
        if batch_idx == 3:
            raise RuntimeError("CUDA out of memory (simulated) after a staged copy")
        return self.model[2:](hidden)


def test_a_predict_batch_failing_after_a_staged_copy_commits_the_batches_before(
    tmp_path: Path,
) -> None:
    images = torch.randn(64, 64, 16, 16)
    callback = IOCaptureCallback(
        "outputs[model.1.bn2]", writer=FeatureWriter(tmp_path), pinned_memory_bytes=2 << 20
    )
    trainer = pl.Trainer(accelerator="gpu", devices=1, logger=False, callbacks=[callback])
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        trainer.predict(
            FailsAfterACapture(),
            DataLoader(TensorDataset(images), batch_size=4),
            return_predictions=False,
        )
    assert FeatureStore(tmp_path).indices.tolist() == list(range(12))
