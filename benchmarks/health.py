"""What ``ActivationMonitor`` costs in training, against the same training without it.

The 12-block GPT-2-style model of ``make bench`` (``common.gpt2``'s configuration: width
256, 8 heads, vocabulary 1,024, random weights) with its language-model head, trained by a
real Lightning ``Trainer`` (``fit`` with ``max_steps``; no logger, no checkpointing): SGD
(lr 1e-3) on one fixed batch of 8 sequences of 128 tokens, the next-token loss. The monitor
watches all 12 blocks (``outputs[model.transformer.h.*]``: the LightningModule holds the
model as ``self.model``).

A step's time is the time between two consecutive ``on_train_batch_start`` calls of a
timing callback: the whole step (the batch, forward, backward, optimizer, and every
callback's hooks, the monitor's statistics, merge and ``self.log`` calls included). The
first step of each ``fit`` is left out (warm-up).

Variants, one ``fit`` each per round, in interleaved rounds (the order reversed every
other round); each ratio is taken to the run without the monitor of the same round, and
printed as median (min to max) over the rounds:

- ``watched``: ``every_n_steps=1``: every step is watched. Its mean step time over
  ``off``'s is the cost of a watched step (goal: at most 1.05x).
- ``grads``: the same with the gradients too
  (``outputs[...]|grad_outputs[model.transformer.h.*]``).
- ``every50``: ``every_n_steps=50``: the steps timed (1 to ``steps - 1``) are not watched,
  so this is the cost of an unwatched step with the monitor attached.
- the average over a run with ``every_n_steps=50`` is computed from the two measured
  ratios of the same round: ``(watched + 49 x every50) / 50``; ``--direct`` also measures
  it: ``fit`` runs of 101 steps, steps 1 to 100 timed (steps 50 and 100 watched), mean
  step time over ``off``'s.

On a machine shared with others, whole ``fit`` runs a minute apart vary by 10-15 %, more
than the effect measured. Paired steps cancel most of that drift: ``fit`` runs watched
every other step (``every_n_steps=2``, twice for each spec), each watched step's time over
the mean of its two unwatched neighbours' (a second apart; an unwatched step has nothing
registered). The average over a run with ``every_n_steps=50`` is then ``(mean + 49) / 50``,
the unwatched steps taken as free (the ``every50`` row checks that, within its noise).
``--profile`` times the monitor's own parts within a watched step.

    python benchmarks/health.py                          # about 6 minutes on 2 cores
    python benchmarks/health.py --threads 1 --clock cpu  # on a machine shared with others
    python benchmarks/health.py --quick
    python benchmarks/health.py --direct                 # also the 100-step runs: 10 min
    python benchmarks/health.py --profile                # where a watched step's time goes
    python benchmarks/health.py --baseline               # also the old statistics, same run
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from common import run_facts, spread
from health_baseline import Baseline
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import lightning_iocatch.lightning.health_monitor as health_monitor
from lightning_iocatch.capture.gradients import GradientSites
from lightning_iocatch.lightning.health_monitor import ActivationMonitor

BATCH, SEQ = 8, 128
SPEC = "outputs[model.transformer.h.*]"
GRAD_SPEC = f"{SPEC}|grad_outputs[model.transformer.h.*]"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class FixedBatch(Dataset):
    """The same batch of token ids at every index (one index a step)."""

    def __init__(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 1024, (BATCH, SEQ), generator=generator)
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "attention_mask": torch.ones_like(self.ids)}


class LM(pl.LightningModule):
    """``common.gpt2``'s configuration with its head, as ``self.model``; SGD, next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=12, n_embd=256, n_head=8, vocab_size=1024, n_positions=1024,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    """The clock at every ``on_train_batch_start`` and at the end of training."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.marks = clock, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(self.clock())

    def on_train_end(self, *args: Any) -> None:
        self.marks.append(self.clock())

    def steps(self) -> list[float]:
        """Each step's seconds, the first (warm-up) left out."""
        return [b - a for a, b in zip(self.marks[1:-1], self.marks[2:], strict=True)]


def monitors(baseline: bool = False) -> dict[str, Callable[[], list[pl.Callback]]]:
    variants: dict[str, Callable[[], list[pl.Callback]]] = {
        "off": lambda: [],
        "watched": lambda: [ActivationMonitor(SPEC, every_n_steps=1)],
        "grads": lambda: [ActivationMonitor(GRAD_SPEC, every_n_steps=1)],
        "every50": lambda: [ActivationMonitor(SPEC, every_n_steps=50)],
    }
    if baseline:
        variants["watched_old"] = lambda: [Baseline(), ActivationMonitor(SPEC, every_n_steps=1)]
        variants["grads_old"] = lambda: [Baseline(), ActivationMonitor(GRAD_SPEC, every_n_steps=1)]
    return variants


def fit(lm: LM, callbacks: list[pl.Callback], steps: int, clock: Callable[[], float]) -> float:
    """The mean seconds of steps 1 to ``steps - 1`` of one ``fit``."""
    timer = StepTimer(clock)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer, *callbacks])  # fmt: skip
    trainer.fit(lm, DataLoader(FixedBatch(steps), batch_size=None))
    return statistics.fmean(timer.steps())


def rounds(
    lm: LM, variants: dict[str, Callable[[], list[pl.Callback]]], steps: int, repeats: int,
    clock: Callable[[], float], warm_up: bool = True,
) -> dict[str, list[float]]:  # fmt: skip
    """Mean step seconds of each variant per round (after a warm-up round, if asked)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(0 if warm_up else 1, repeats + 1):
        for name in names if round_ % 2 else list(reversed(names)):
            seconds = fit(lm, variants[name](), steps, clock)
            if round_:
                samples[name].append(seconds)
    return samples


def alternating(
    lm: LM, spec: str, steps: int, clock: Callable[[], float], old: bool = False
) -> list[float]:
    """One ``fit`` watched every other step (``every_n_steps=2``): each watched step's time
    over the mean of its two unwatched neighbours' (steps 2, 4, ... of steps 1 to
    ``steps - 1``): pairs a second apart, so a shared machine's drift mostly cancels."""
    timer = StepTimer(clock)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[timer, *([Baseline()] if old else []),
                                    ActivationMonitor(spec, every_n_steps=2)])  # fmt: skip
    trainer.fit(lm, DataLoader(FixedBatch(steps), batch_size=None))
    took = timer.steps()  # took[i]: step i + 1
    return [took[s - 1] / ((took[s - 2] + took[s]) / 2) for s in range(2, steps - 1, 2)]


def over(samples: dict[str, list[float]], name: str) -> list[float]:
    return [t / b for t, b in zip(samples[name], samples["off"], strict=True)]


def breakdown(lm: LM, spec: str, steps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Milliseconds a watched step spends in the monitor's parts: its hooks at the step's
    start and end, the statistics of the captured outputs and gradients, the gradient
    sites' copies in the forward (``GradientSites.attach``) and their collection, the
    ``self.log`` calls; and the whole step. The parts are timed by wrapping them (benchmark
    only: private methods)."""
    parts = ("batch_start", "batch_end", "outputs", "grad_outputs", "attach", "collect", "log")
    spent = dict.fromkeys(parts, 0.0)

    def timed(fn: Callable[..., Any], name: Callable[..., str]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name(*args)] += clock() - start

        return wrapper

    monitor = ActivationMonitor(spec, every_n_steps=1)
    for hook in ("batch_start", "batch_end"):
        name = f"on_train_{hook}"
        setattr(monitor, name, timed(getattr(monitor, name), lambda *a, h=hook: h))
    patched = [
        (health_monitor._Statistics, "capture", lambda s, tensor, site: site.kind),
        (GradientSites, "attach", lambda *a: "attach"),
        (GradientSites, "collect", lambda *a: "collect"),
    ]
    kept = [getattr(owner, name) for owner, name, _ in patched]
    for owner, name, key in patched:
        setattr(owner, name, timed(getattr(owner, name), key))
    lm.log = timed(lm.log, lambda *a: "log")  # type: ignore[method-assign]
    try:
        step = fit(lm, [monitor], steps + 1, clock)
    finally:
        for (owner, name, _), original in zip(patched, kept, strict=True):
            setattr(owner, name, original)
        del lm.log
    return {"step": step * 1000, **{k: v / (steps + 1) * 1000 for k, v in spent.items()}}


def profile(lm: LM, steps: int, baseline: bool = False) -> None:
    """Where a watched step's time goes: the monitor's parts (outputs, and with the
    gradients), then torch.profiler of each kind of training, and cProfile with gradients."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    print(f"\n## A watched step's parts, ms (CPU clock, mean of {steps} steps)\n")
    print("| spec | step | at batch start | at batch end | of which `self.log` | statistics "
          "of outputs | of gradients | gradient copies (attach) | collect |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    runs = [("outputs", SPEC), ("with gradients", GRAD_SPEC)]
    for name, spec in runs + ([(f"{n}, old statistics", s) for n, s in runs] if baseline else []):
        old = Baseline() if "old" in name else None
        if old is not None:
            old.setup()
        try:
            p = breakdown(lm, spec, steps, time.process_time)
        finally:
            if old is not None:
                old.teardown()
        print(f"| {name} | {p['step']:.0f} | {p['batch_start']:.1f} | {p['batch_end']:.1f} | "
              f"{p['log']:.1f} | {p['outputs']:.1f} | {p['grad_outputs']:.1f} | "
              f"{p['attach']:.1f} | {p['collect']:.1f} |")  # fmt: skip
    for name in ("off", "watched", "grads"):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fit(lm, monitors()[name](), steps, time.perf_counter)
        print(f"\n## torch.profiler, {name} ({steps} steps)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    profiler = cProfile.Profile()
    profiler.enable()
    fit(lm, monitors()["grads"](), steps, time.perf_counter)
    profiler.disable()
    print(f"\n## cProfile, grads ({steps} steps), the monitor's functions\n")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats("iocatch|module.py.*[(]log[)]", 20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--direct", action="store_true", help="also 101-step runs, N=50")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--baseline", action="store_true",
        help="also the monitor with the statistics as they were (float64 copies), same run",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=0, help="steps a fit (default 8; 4 quick)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 4; 1 quick)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: the process' CPU time, steadier on a shared machine",
    )
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers")
    warnings.filterwarnings("ignore", ".*`max_epochs` was not set")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as effects.py: random weights make subnormals
    steps = args.steps or (4 if args.quick else 8)
    repeats = args.rounds or (1 if args.quick else 4)
    lm = LM()
    if args.profile:
        profile(lm, steps, args.baseline)
        return
    clock = CLOCKS[args.clock]
    samples = rounds(lm, monitors(args.baseline), steps, repeats, clock)
    watched, every50 = over(samples, "watched"), over(samples, "every50")
    kinds = [("outputs", SPEC, False), ("grads", GRAD_SPEC, False)]
    if args.baseline:
        kinds += [("outputs_old", SPEC, True), ("grads_old", GRAD_SPEC, True)]
    paired = {name: [] for name, _, _ in kinds}  # type: ignore[var-annotated]
    for _ in range(2):
        for name, spec, old in kinds:
            paired[name] += alternating(lm, spec, 2 * steps + 1, clock, old)
    rows = {
        "paired": spread(paired["outputs"]),
        "paired_mean": statistics.fmean(paired["outputs"]),
        "paired_grads": spread(paired["grads"]),
        "paired_grads_mean": statistics.fmean(paired["grads"]),
        "paired_average50": (statistics.fmean(paired["outputs"]) + 49) / 50,
        "pairs": len(paired["outputs"]),
        "step_s": statistics.median(samples["off"]),
        "watched": spread(watched),
        "grads": spread(over(samples, "grads")),
        "every50": spread(every50),
        "average50": spread([(w + 49 * u) / 50 for w, u in zip(watched, every50, strict=True)]),
    }
    if args.baseline:
        rows["old"] = {
            "watched": spread(over(samples, "watched_old")),
            "grads": spread(over(samples, "grads_old")),
            "paired": spread(paired["outputs_old"]),
            "paired_mean": statistics.fmean(paired["outputs_old"]),
            "paired_grads": spread(paired["grads_old"]),
            "paired_grads_mean": statistics.fmean(paired["grads_old"]),
            "paired_average50": (statistics.fmean(paired["outputs_old"]) + 49) / 50,
        }
    if args.direct:
        direct = {name: monitors()[name] for name in ("off", "every50")}
        long = rounds(lm, direct, 101, max(1, repeats // 4), clock, warm_up=False)
        rows["direct50"] = spread(over(long, "every50"))
        rows["direct_rounds"] = len(long["off"])
    facts = run_facts(batch=[BATCH, SEQ], spec=SPEC, steps=steps, rounds=repeats,
                      clock=args.clock)  # fmt: skip
    print(markdown(facts, rows))


def markdown(facts: dict[str, Any], r: dict[str, Any]) -> str:
    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.3f}x ({x['min']:.3f} to {x['max']:.3f})"

    lines = [
        f"torch {facts['torch']}, {facts['threads']} threads, {facts['clock']} clock; batch "
        f"{facts['batch']}, SGD, Lightning `fit`; `{facts['spec']}` (12 blocks); "
        f"{facts['rounds']} interleaved rounds of {facts['steps']}-step fits (step 0 left "
        f"out); one unwatched step {r['step_s'] * 1000:.0f} ms (median of the rounds' means)",
        "",
        "| mean step time / without the monitor, same round | median (min to max) |",
        "|---|---|",
        f"| **a watched step** (`every_n_steps=1`; goal <= 1.05x) | {cell(r['watched'])} |",
        f"| a watched step with gradients (`\\|grad_outputs[...]`) | {cell(r['grads'])} |",
        f"| an unwatched step, monitor attached (`every_n_steps=50`) | {cell(r['every50'])} |",
        "| average over a run, `every_n_steps=50`, computed: "
        f"(watched + 49 x unwatched) / 50 | {cell(r['average50'])} |",
    ]
    if "direct50" in r:
        lines.append(
            "| average over a run, `every_n_steps=50`, measured: steps 1-100 of 101-step fits "
            f"({r['direct_rounds']} rounds; steps 50 and 100 watched) | {cell(r['direct50'])} |"
        )
    lines += [
        "",
        f"Paired steps: `fit` runs watched every other step ({r['pairs']} watched steps in "
        "all), each watched step over the mean of its two unwatched neighbours:",
        "",
        "| watched step / its unwatched neighbours | median (min to max); mean |",
        "|---|---|",
        f"| **a watched step** (goal <= 1.05x) | {cell(r['paired'])}; {r['paired_mean']:.3f}x |",
        f"| a watched step with gradients | {cell(r['paired_grads'])}; "
        f"{r['paired_grads_mean']:.3f}x |",
        "| **average over a run, `every_n_steps=50`** (goal <= 1.01x), computed: (mean + 49) "
        f"/ 50, unwatched steps taken as free | {r['paired_average50']:.4f}x |",
    ]
    if "old" in r:
        o = r["old"]
        lines += [
            "",
            "Baseline, same run: the monitor with the statistics as they were (`--baseline`: "
            "`float64_statistics`, a float64 copy of every tensor):",
            "",
            "| with the old statistics | median (min to max) |",
            "|---|---|",
            f"| a watched step / without the monitor, same round | {cell(o['watched'])} |",
            f"| with gradients / without the monitor, same round | {cell(o['grads'])} |",
            f"| a watched step / its unwatched neighbours | {cell(o['paired'])}; "
            f"{o['paired_mean']:.3f}x |",
            f"| with gradients / its unwatched neighbours | {cell(o['paired_grads'])}; "
            f"{o['paired_grads_mean']:.3f}x |",
            f"| average over a run, `every_n_steps=50`, (paired mean + 49) / 50 | "
            f"{o['paired_average50']:.4f}x |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
