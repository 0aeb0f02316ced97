"""What one attribution patching pass costs, against a clean forward and a hand-written one.

The 12-block GPT-2-style model of ``make bench`` (``common.gpt2``: width 256, 8 heads,
vocabulary 1,024, random weights) with its language-model head (tied to the embedding,
as in ``effects.py``), a batch of 8 clean sequences of 128 tokens and their corrupted
pairs (4 positions changed); the metric is each sequence's mean next-token loss; the
components are every block's output (``outputs[transformer.h.*]``), in the denoising
convention. One pass: a clean forward, a corrupted forward and a backward.

Rows (interleaved rounds, the order reversed every other round; median (min, max) of the
per-round ratios):

- ``hand``: what a user writes with plain PyTorch: ``register_forward_hook`` on the 12
  blocks, the clean forward under ``torch.no_grad``, the corrupted forward with
  gradients, ``torch.autograd.grad(metric.sum(), block outputs)``, and
  ``(a_clean - a_corrupted) . g`` over the width;
- ``ours``: ``attribution_patching(lm, "outputs[transformer.h.*]", run, clean, corrupted)``;
- ``ours_both``: the same with both conventions (a backward of each run);
- each as a ratio to one clean forward (under ``torch.no_grad``, with the loss), and
  ``ours`` to ``hand`` of the same round (the goal: at most 1.1x).

Before timing, ``ours`` is checked equal to ``hand`` (to 1e-5 of the largest score).

The exact patching sweep AtP replaces (every block x every position, one patched forward
each) is extrapolated from the ``exact`` row, timed in the same rounds: ``exact_patching``
of one (block, position) through a ``positions`` mask (a different pair each round; it runs
the clean, corrupted and patched forwards, without gradients), times ``12 x 128``. Its
floor is one forward a patch plus the two runs, a user's own loop sharing them.

    python benchmarks/attribution.py            # about 2 minutes on 2 cores
    python benchmarks/attribution.py --quick
    python benchmarks/attribution.py --threads 1 --clock cpu  # on a machine shared with others
    python benchmarks/attribution.py --profile  # where ours spends its time beyond hand
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import run_facts, spread
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch.capture.attribution import attribution_patching, exact_patching

BATCH, SEQ, CHANGED = 8, 128, (10, 40, 70, 100)
SPEC = "outputs[transformer.h.*]"


def model() -> GPT2LMHeadModel:
    """``common.gpt2``'s configuration with its language-model head, random weights."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=256, n_head=8, vocab_size=1024, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def pairs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 1024, (BATCH, SEQ), generator=generator)
    corrupted = clean.clone()
    corrupted[:, list(CHANGED)] = torch.randint(0, 1024, (BATCH, len(CHANGED)), generator=generator)
    return clean, corrupted


def next_token_loss(lm: GPT2LMHeadModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run(batch)``: each sequence's mean next-token cross-entropy, shape ``[batch]``."""

    def run(ids: torch.Tensor) -> torch.Tensor:
        logits = lm(input_ids=ids, use_cache=False).logits[:, :-1]
        losses = nn.functional.cross_entropy(
            logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        return losses.view(ids.shape[0], -1).mean(1)

    return run


def hand_written(
    lm: GPT2LMHeadModel, run: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """The minimum a user writes: forward hooks on the blocks and ``autograd.grad``."""
    blocks = list(lm.transformer.h)

    def attribution(clean: torch.Tensor, corrupted: torch.Tensor) -> list[torch.Tensor]:
        kept: dict[int, torch.Tensor] = {}

        def keep(i: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                kept[i] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(blocks)]
        try:
            with torch.no_grad():
                run(clean)
            at_clean = dict(kept)
            metric = run(corrupted)
            outputs = [kept[i] for i in range(len(blocks))]
            grads = torch.autograd.grad(metric.sum(), outputs)
        finally:
            for handle in handles:
                handle.remove()
        return [
            ((at_clean[i] - out.detach()) * g).sum(-1)
            for i, (out, g) in enumerate(zip(outputs, grads, strict=True))
        ]

    return attribution


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Seconds of each variant per round: one warm-up round, then ``repeats`` rounds, the
    order reversed every other round (as ``common.interleaved_ratios``), kept raw so that
    ratios to any variant of the same round can be taken."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(repeats + 1):
        for name in names if round_ % 2 else reversed(names):
            start = clock()
            variants[name]()
            if round_:
                samples[name].append(clock() - start)
    return samples


def ratios(samples: dict[str, list[float]], name: str, baseline: str) -> dict[str, float]:
    return spread([t / b for t, b in zip(samples[name], samples[baseline], strict=True)])


def one_exact_patch(
    lm: GPT2LMHeadModel,
    run: Callable[[torch.Tensor], torch.Tensor],
    clean: torch.Tensor,
    corrupted: torch.Tensor,
) -> Callable[[], object]:
    """``exact_patching`` of one block at one position, a different pair each call."""
    generator = torch.Generator().manual_seed(3)

    def patch() -> object:
        block = int(torch.randint(0, 12, (), generator=generator))
        mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        mask[:, int(torch.randint(0, SEQ, (), generator=generator))] = True
        component = f"transformer.h.{block}/outputs"
        return exact_patching(lm, component, run, clean, corrupted, positions=mask)

    return patch


def profile(ours: Callable[[], object], hand: Callable[[], object]) -> None:
    """The operators and Python functions where ``ours`` spends more than ``hand``."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in (("hand", hand), ("ours", ours)):
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fn()
        print(f"\n## torch.profiler, {name} (3 passes)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        ours()
    profiler.disable()
    print("\n## cProfile, ours (3 passes), by cumulative time\n")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: the process' CPU time, steadier than wall time on a shared machine "
        "(with --threads 1, the work done)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as effects.py: random weights make subnormals
    lm, (clean, corrupted) = model(), pairs()
    run = next_token_loss(lm)
    hand = hand_written(lm, run)

    def ours(conventions: Any = "denoising") -> Any:
        return attribution_patching(lm, SPEC, run, clean, corrupted, conventions)

    truth = hand(clean, corrupted)
    found = ours().scores["denoising"]
    scale = max(t.abs().max().item() for t in truth)
    for i, t in enumerate(truth):
        error = (found[f"transformer.h.{i}/outputs"] - t).abs().max().item()
        assert error <= 1e-5 * scale, f"block {i}: ours differs from hand by {error}"

    def forward() -> None:
        with torch.no_grad():
            run(clean)

    if args.profile:
        profile(ours, lambda: hand(clean, corrupted))
        return
    variants: dict[str, Callable[[], object]] = {
        "forward": forward,
        "hand": lambda: hand(clean, corrupted),
        "ours": ours,
        "ours_both": lambda: ours(("denoising", "noising")),
        "exact": one_exact_patch(lm, run, clean, corrupted),
    }
    samples = interleaved(variants, 3 if args.quick else 9, CLOCKS[args.clock])
    forward_s = statistics.median(samples["forward"])
    exact = ratios(samples, "exact", "forward")
    patches = 12 * SEQ
    ours = ratios(samples, "ours", "forward")
    rows = {
        "forward_s": round(forward_s, 4),
        "hand_over_forward": ratios(samples, "hand", "forward"),
        "ours_over_forward": ours,
        "ours_both_over_forward": ratios(samples, "ours_both", "forward"),
        "ours_over_hand": ratios(samples, "ours", "hand"),
        "exact_patch_over_forward": exact,
        "exact_sweep_patches": patches,
        "exact_sweep_over_ours": round(exact["median"] * patches / ours["median"]),
        "exact_floor_over_ours": round((patches + 2) / ours["median"]),
    }
    rounds = len(samples["forward"])
    facts = run_facts(batch=[BATCH, SEQ], components=SPEC, rounds=rounds, clock=args.clock)
    print(markdown(facts, rows))


def markdown(facts: dict[str, Any], r: dict[str, Any]) -> str:
    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.3f}x ({x['min']:.3f} to {x['max']:.3f})"

    patches = r["exact_sweep_patches"]
    lines = [
        f"torch {facts['torch']}, {facts['threads']} threads; batch {facts['batch']}; "
        f"components `{facts['components']}`; {facts['rounds']} interleaved rounds, "
        f"{facts['clock']} clock; one clean forward {r['forward_s'] * 1000:.0f} ms (median)",
        "",
        "| what | cost: median (min to max) |",
        "|---|---|",
        f"| hand-written AtP pass / clean forward | {cell(r['hand_over_forward'])} |",
        f"| `attribution_patching` (denoising) / clean forward | {cell(r['ours_over_forward'])} |",
        "| `attribution_patching` (both conventions) / clean forward "
        f"| {cell(r['ours_both_over_forward'])} |",
        "| **`attribution_patching` / hand-written, same round** (goal <= 1.1x) "
        f"| {cell(r['ours_over_hand'])} |",
        "| one `exact_patching` (1 block, 1 position) / clean forward "
        f"| {cell(r['exact_patch_over_forward'])} |",
        f"| exact sweep of {patches} patches (12 blocks x {SEQ} positions) through "
        f"`exact_patching`, extrapolated / one AtP pass | {r['exact_sweep_over_ours']}x |",
        f"| its floor ({patches} patched forwards + the 2 runs) / one AtP pass "
        f"| {r['exact_floor_over_ours']}x |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
