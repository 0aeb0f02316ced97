"""The GPU path, on one CUDA device: capture overhead, bandwidth, dump throughput (JSON).

    python benchmarks/gpu.py [--quick]

A GPT-2-medium-sized model (24 blocks, d=1024, random weights) in bf16, batches of
32x512 tokens. Ratios to a plain forward, measured in the same run and interleaved,
each forward followed by ``torch.cuda.synchronize()`` and, for captures, by the point
where every captured value is complete in ordinary CPU memory:

- ``ours``: ``ModelIOCatcher(model, "cpu")`` capturing the output of every block
  (snapshot on the model's stream, copy through the pinned ring on a side stream);
- ``sync_cpu``: hooks calling ``.cpu()`` on the same outputs;
- ``non_blocking_unsafe``: hooks calling ``.to("cpu", non_blocking=True)`` with no
  synchronisation (for reference only: it races with in-place ops, see host_copy.py).

Bandwidth: ``link_pinned_GBps`` is one large ``pinned.copy_(gpu, non_blocking=True)``
measured in the same run; ``ours_GBps`` is the captured bytes of a forward divided by
the time ``ours`` takes beyond a plain forward when the captures are large (the
transfer-bound case: a smaller model, the same bytes). Targets: ``ours`` <= 1.10x,
``ours_GBps`` >= 0.8 x ``link_pinned_GBps``. Also ``predict_dump_GBps``: bytes of
captures per second of ``trainer.predict`` dumping 4 block outputs with FeatureWriter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import Encoder, gpt2, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Model

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, ModelIOCatcher

BLOCKS = ("h.5", "h.11", "h.17", "h.23")
ALL_BLOCKS = tuple(f"h.{i}" for i in range(24))


def model_and_batch(layers: int, batch: int, tokens: int) -> tuple[GPT2Model, torch.Tensor]:
    torch.manual_seed(0)
    model = gpt2(n_layer=layers, width=1024, n_head=16, vocab=50257).to("cuda", torch.bfloat16)
    return model, torch.randint(0, 50257, (batch, tokens), device="cuda")


def hooks(model: nn.Module, copy: Callable[[torch.Tensor], torch.Tensor], sink: list) -> list:
    modules = dict(model.named_modules())
    return [
        modules[name].register_forward_hook(lambda m, a, out: sink.append(copy(out)))
        for name in ALL_BLOCKS
    ]


def timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for round_ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if round_ >= 2:  # two warm-up rounds
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def link_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of one large device-to-host copy into pinned memory."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = timed(lambda: pinned.copy_(source, non_blocking=True), repeats)
    return nbytes / seconds / 1e9


def overheads(model: GPT2Model, ids: torch.Tensor, repeats: int) -> dict[str, Any]:
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=1 << 30)
    session = catcher(outputs=list(ALL_BLOCKS))

    def ours() -> None:
        with session:
            model(ids)
            session.take()  # settled: every value complete in ordinary memory

    sink: list = []

    def with_hooks(copy: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            handles = hooks(model, copy, sink)
            try:
                model(ids)
            finally:
                for handle in handles:
                    handle.remove()
                sink.clear()

        return run

    with torch.inference_mode():
        variants = {
            "plain": lambda: model(ids),
            "ours": ours,
            "sync_cpu": with_hooks(lambda t: t.cpu()),
            "non_blocking_unsafe": with_hooks(lambda t: t.to("cpu", non_blocking=True)),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(3):  # interleave whole groups
            for name, fn in variants.items():
                times[name].append(timed(fn, repeats))
    medians = {name: statistics.median(values) for name, values in times.items()}
    plain = medians.pop("plain")
    captured = len(ALL_BLOCKS) * ids.numel() * 1024 * 2
    return {
        "plain_ms": round(plain * 1e3, 2),
        "captured_MB_per_forward": round(captured / 1e6, 1),
        **{name: round(value / plain, 3) for name, value in medians.items()},
        "ours_min_max": [
            round(min(times["ours"]) / plain, 3),
            round(max(times["ours"]) / plain, 3),
        ],
    }


class Passthrough(nn.Module):
    """24 modules that hand a large bf16 tensor on unchanged: capture is all the work."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(nn.Identity() for _ in range(24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x) + 0  # a new tensor per block, as real blocks make
        return x


def transfer_bound(repeats: int) -> dict[str, Any]:
    """Achieved device-to-host GB/s of captures when copying is all there is to do."""
    model = Passthrough()
    x = torch.randn(32, 512, 1024, device="cuda", dtype=torch.bfloat16)  # 32 MiB a capture
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=256 << 20)
    session = catcher(outputs=list(ALL_BLOCKS))

    def ours() -> None:
        with session:
            model(x)
            session.take()

    with torch.inference_mode():
        seconds = timed(ours, repeats)
    captured = len(ALL_BLOCKS) * x.numel() * x.element_size()
    return {
        "captured_MB": round(captured / 1e6, 1),
        "ours_GBps": round(captured / seconds / 1e9, 2),
    }


def dump_throughput(model: GPT2Model, ids: torch.Tensor, batches: int) -> dict[str, Any]:
    data = TensorDataset(ids.cpu().repeat(batches, 1))
    with tempfile.TemporaryDirectory() as directory:
        writer = FeatureWriter(directory, max_shard_bytes=1 << 30)
        spec = "outputs[" + "|".join(f"model.{b}" for b in BLOCKS) + "]"
        callback = IOCaptureCallback(spec, writer=writer, pinned_memory_bytes=1 << 30)
        trainer = quiet_trainer([callback], accelerator="gpu")
        start = time.perf_counter()
        trainer.predict(
            Encoder(model), DataLoader(data, batch_size=ids.shape[0]), return_predictions=False
        )
        elapsed = time.perf_counter() - start
        rows = len(FeatureStore(directory))
    return {
        "batches": batches,
        "rows": rows,
        "bytes": writer.bytes_written,
        "seconds": round(elapsed, 2),
        "predict_dump_GBps": round(writer.bytes_written / elapsed / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few repeats")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    layers, batch, tokens, repeats = (24, 32, 512, 10) if not args.quick else (24, 8, 128, 3)
    model, ids = model_and_batch(layers, batch, tokens)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"GPT-2 style, {layers} blocks, d=1024, bf16, batch {batch}x{tokens}",
        "link_pinned_GBps": round(link_bandwidth(), 2),
        "capture_every_block_to_cpu": overheads(model, ids, repeats),
        "predict_dump": dump_throughput(model, ids, batches=4 if args.quick else 16),
    }
    results["transfer_bound"] = transfer_bound(repeats)
    achieved = results["transfer_bound"]["ours_GBps"]
    results["ours_GBps_over_link"] = round(achieved / results["link_pinned_GBps"], 3)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
