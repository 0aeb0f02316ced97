"""The GPU path, on one CUDA device: capture overhead and dump throughput (JSON).

    python benchmarks/gpu.py [--quick]

A GPT-2-medium-sized model (24 blocks, d=1024, random weights) in bf16, batches of
32x512 tokens. Ratios to a plain forward, measured in the same run, each forward
followed by ``torch.cuda.synchronize()`` and, for captures, by the point where the
captured values are readable on the CPU:

- ``ours``: ``ModelIOCatcher(model, "cpu")`` capturing 4 block outputs (pinned memory,
  side stream, events);
- ``sync_cpu``: hooks calling ``.cpu()`` on the same 4 outputs;
- ``non_blocking_unsafe``: hooks calling ``.to("cpu", non_blocking=True)`` with no
  synchronisation (for reference only: its values may be read before they arrive).

Also ``predict_dump_GBps``: bytes of captures per second of ``trainer.predict`` dumping the
4 block outputs with FeatureWriter. Targets: ``ours`` <= 1.10 and < ``sync_cpu``.
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


def model_and_batch(layers: int, batch: int, tokens: int) -> tuple[GPT2Model, torch.Tensor]:
    torch.manual_seed(0)
    model = gpt2(n_layer=layers, width=1024, n_head=16, vocab=50257).to("cuda", torch.bfloat16)
    return model, torch.randint(0, 50257, (batch, tokens), device="cuda")


def hooks(model: nn.Module, copy: Callable[[torch.Tensor], torch.Tensor], sink: list) -> list:
    modules = dict(model.named_modules())
    return [
        modules[name].register_forward_hook(lambda m, a, out: sink.append(copy(out)))
        for name in BLOCKS
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


def overheads(model: GPT2Model, ids: torch.Tensor, repeats: int) -> dict[str, Any]:
    catcher = ModelIOCatcher(model, "cpu", pinned_memory_bytes=1 << 30)
    session = catcher(outputs=list(BLOCKS))

    def ours() -> None:
        with session:
            model(ids)
            captured = session.take()
            captured.settle()  # the values are on the CPU and complete

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
    captured_mb = 4 * ids.numel() * 1024 * 2 / 1e6
    return {
        "plain_ms": round(plain * 1e3, 2),
        "captured_MB_per_forward": round(captured_mb, 1),
        **{name: round(value / plain, 3) for name, value in medians.items()},
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
        "capture_4_blocks_to_cpu": overheads(model, ids, repeats),
        "predict_dump": dump_throughput(model, ids, batches=4 if args.quick else 16),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
