"""The cost of whole values under tensor parallelism, against the sharded forward alone.

A Llama (hidden 256, MLP 1024, 8 heads, 4 layers; batch 4 x 128 tokens) sharded over 2
gloo processes on the CPU by torch's plan (column-split q/k/v/gate/up with local outputs,
row-split o/down), one thread each. Per round, interleaved, each variant runs the same
forwards (a fixed count, the same on both processes):

- ``plain``: the sharded forward, no session (the baseline of every ratio).
- ``local_copies``: hand-written hooks copying what they see to the host, shards as they
  are (the old, wrong behaviour: the cost floor of a copy without a gather).
- ``whole``: a ``ModelIOCatcher`` session capturing, per layer, ``q_proj``'s output (a
  local shard), ``act_fn``'s output (a shard whose placement is inferred), the layer's
  output (replicated) and ``down_proj``'s input (a DTensor): 16 values a forward, each
  made whole on the device before its copy (one all_gather each; the layer's output,
  replicated, none after its first call).

    python benchmarks/sharded.py              # about 30 s on 2 cores (make bench-sharded)
    python benchmarks/sharded.py --rounds 3   # a smoke test

Prints JSON: each variant's time over ``plain`` of the same round (median, min, max).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

LAYERS = 4
SITES = [
    f"model.layers.{i}.{site}"
    for i in range(LAYERS)
    for site in ("self_attn.q_proj", "mlp.act_fn", "")
]


def build() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
        attn_implementation="eager", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def local_copies(model: nn.Module) -> Callable[[], None]:
    """Hooks that copy each site's value (and down_proj's input) to the host as it is."""
    names = dict(model.named_modules())
    handles = []

    def copy(value: Any) -> None:
        value = value.to_local() if hasattr(value, "to_local") else value
        value.detach().to("cpu", copy=True)

    for name in (n.rstrip(".") for n in SITES):
        handles.append(names[name].register_forward_hook(lambda m, a, o: copy(o)))
    for i in range(LAYERS):
        down = names[f"model.layers.{i}.mlp.down_proj"]
        handles.append(down.register_forward_pre_hook(lambda m, a: copy(a[0])))
    return lambda: [h.remove() for h in handles]


def worker(rank: int, port: int, rounds: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_iocatch import ModelIOCatcher

    model = build()
    shard(model, init_device_mesh("cpu", (2,)))
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(1))
    catcher = ModelIOCatcher(model, "cpu")
    outputs = [n.rstrip(".") for n in SITES]
    inputs = [f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]

    def forwards() -> None:
        with torch.inference_mode():
            for _ in range(calls):
                model(input_ids=ids)

    def whole() -> None:
        with catcher(outputs=outputs, inputs=inputs):
            forwards()

    def copies() -> None:
        remove = local_copies(model)
        try:
            forwards()
        finally:
            remove()

    variants = {"plain": forwards, "local_copies": copies, "whole": whole}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds + 1):  # round 0 warms up
        order = list(variants) if round_ % 2 else list(reversed(variants))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            dist.barrier()
            if round_:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times, handle)
    dist.destroy_process_group()


def summary(times: dict[str, list[float]], calls: int) -> dict[str, Any]:
    plain = times["plain"]
    result: dict[str, Any] = {"plain_forward_s": statistics.median(plain) / calls}
    for name, values in times.items():
        if name == "plain":
            continue
        ratios = [v / p for v, p in zip(values, plain, strict=True)]
        result[name] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=3, help="forwards per timing")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = f"/tmp/iocatch-sharded-bench-{os.getpid()}.json"
    mp.spawn(worker, args=(port, args.rounds, args.calls, out), nprocs=2)
    with open(out) as handle:
        times = json.load(handle)
    os.remove(out)
    facts = {"torch": torch.__version__, "processes": 2, "threads_each": 1, "rounds": args.rounds}
    facts |= {"values_per_forward": len(SITES) + LAYERS}
    print(json.dumps({**facts, **summary(times, args.calls)}, indent=2))


if __name__ == "__main__":
    main()
