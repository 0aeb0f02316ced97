"""Overhead of ModelIOCatcher against a plain forward, in one run, printed as JSON.

Every figure is the ratio of a variant's time to a plain forward of the same model in
the same round, over interleaved rounds (median, min and max), so that machine noise
hits all variants alike.

    python benchmarks/overhead.py            # full run (about a minute on 2 cores)
    python benchmarks/overhead.py --quick    # fewer repeats, for a smoke test
    python benchmarks/overhead.py --linear8 --threads 1 --repeats 41  # that row only

Rows:
- ``idle``: a catcher exists (and a session was opened and closed before), none open.
- ``armed``: a session captures the output of one module in the middle, to the CPU.
- ``all_hooks_idle``: for contrast, the reference design's inert hooks on every module.
- ``armed_extra_us``: the armed catcher's fixed cost, microseconds a forward: (the armed
  median - 1) x the plain forward's time. ``linear8_200_layers`` (200 ``Linear(8, 8)``
  on 64 rows, a forward of about 1 ms) is where it shows: each layer's work is tiny.
- ``armed_fixed_us`` (with ``--linear8``): the same cost measured where the forward is
  too short for machine noise to hide it: 3 ``Linear(8, 8)`` (a forward of about 30 µs),
  armed minus plain, microseconds a forward, over interleaved rounds of 20,000 forwards.
- ``early_exit_*``: a session with ``early_exit=True`` on block 0, the middle block and
  the last block; ``share_run`` is the time of the same model with the later blocks and
  the final layer norm removed, as a fraction of the full forward (the ideal ratio).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from common import gpt2, interleaved_ratios, run_facts, spread
from torch import nn
from transformers import GPT2Model

from lightning_iocatch import ModelIOCatcher


@contextmanager
def all_module_hooks(model: nn.Module) -> Iterator[None]:
    """The reference design: a pre-hook and a hook on every module, inert unless armed."""
    armed: set[str] = set()

    def make(name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if name in armed:
                raise AssertionError("never armed here")

        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(make(name)))
        handles.append(module.register_forward_hook(make(name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def idle_and_armed(model: nn.Module, x: torch.Tensor, middle: str, repeats: int) -> dict:
    catcher = ModelIOCatcher(model, "cpu")
    with catcher(outputs=[middle]):  # open and close once: nothing may stay behind
        model(x)
    session = catcher(outputs=[middle])

    def armed() -> None:  # a forward inside the open session, buffer emptied each time
        model(x)
        session.take()

    forward = partial(model, x)
    variants = {"plain": forward, "idle": forward, "armed": armed, "all_hooks_idle": forward}
    around = {"armed": lambda: session, "all_hooks_idle": lambda: all_module_hooks(model)}
    with torch.inference_mode():
        ratios = interleaved_ratios(variants, repeats, around=around, min_seconds=0.25)
    extra = (ratios["armed"]["median"] - 1) * ratios["baseline_s"] * 1e6
    return {"modules": sum(1 for _ in model.modules()), **ratios, "armed_extra_us": round(extra, 1)}


def armed_fixed_us(rounds: int) -> dict:
    """Armed minus plain on 3 ``Linear(8, 8)``, µs a forward (median, min, max of rounds)."""
    model, x = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]), torch.randn(64, 8)
    session = ModelIOCatcher(model, "cpu")(outputs=["1"])
    calls, differences = 20_000, []

    def timed(forward: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            forward()
        return (time.perf_counter() - start) / calls * 1e6

    with torch.inference_mode(), session:
        for round_ in range(rounds + 1):
            plain = timed(partial(model, x)) if round_ % 2 else 0.0
            armed = timed(lambda: (model(x), session.take()))
            plain = plain or timed(partial(model, x))
            if round_:
                differences.append(armed - plain)
    return spread(differences)


def mlp(depth: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def many_modules(count: int, width: int) -> nn.Sequential:
    """About ``count`` modules: blocks of Linear, LayerNorm, GELU, Identity."""
    blocks = [
        nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Identity())
        for _ in range(count // 5)
    ]
    return nn.Sequential(*blocks)


def early_exit(model: GPT2Model, ids: torch.Tensor, repeats: int) -> dict:
    catcher = ModelIOCatcher(model, "cpu")
    last = len(model.h) - 1

    def truncated_forward(stop: int) -> Callable[[], object]:
        """The same model and code path with the blocks after `stop` (and ln_f) removed."""
        blocks, ln_f = model.h, model.ln_f
        truncated = nn.ModuleList(blocks[: stop + 1])

        def forward() -> object:
            model.h, model.ln_f = truncated, nn.Identity()
            try:
                return model(ids)
            finally:
                model.h, model.ln_f = blocks, ln_f

        return forward

    def cut_at(stop: int) -> Callable[[], object]:
        session = catcher(outputs=[f"h.{stop}"], early_exit=True)

        def forward() -> None:
            with session:
                assert catcher.run(ids) is None

        return forward

    stops = {"block0": 0, "middle": last // 2, "last": last}
    variants: dict[str, Callable[[], object]] = {"plain": lambda: model(ids)}
    for label, stop in stops.items():
        variants[f"early_exit_{label}"] = cut_at(stop)
        variants[f"share_{label}"] = truncated_forward(stop)
    with torch.inference_mode():
        ratios = interleaved_ratios(variants, repeats, min_seconds=0.25)
    result: dict = {"baseline_s": ratios["baseline_s"]}
    for label in stops:
        ratio, share = ratios[f"early_exit_{label}"], ratios[f"share_{label}"]
        result[f"early_exit_{label}"] = {
            **ratio,
            "block": f"h.{stops[label]}",
            "share_run": share["median"],
            "excess": round(ratio["median"] - share["median"], 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--linear8", action="store_true", help="only 200 x Linear(8, 8)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 21)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    linear8 = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])
    small = {"linear8_200_layers": idle_and_armed(linear8, torch.randn(64, 8), "100", repeats)}
    if args.linear8:
        small["armed_fixed_us"] = armed_fixed_us(max(5, repeats // 4))
        print(json.dumps({**run_facts(repeats=repeats), **small}, indent=2))
        return

    model = gpt2()
    ids = torch.randint(0, 1024, (4, 128))
    results = {
        **run_facts(repeats=repeats),
        "mlp_200_layers": idle_and_armed(mlp(200, 256), torch.randn(64, 256), "200", repeats),
        **small,
        "model_2000_modules": idle_and_armed(
            many_modules(2000, 32), torch.randn(16, 32), "200", repeats
        ),
        "gpt2_12_blocks": {
            **idle_and_armed(model, ids, "h.6", repeats),
            **early_exit(model, ids, repeats),
        },
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
