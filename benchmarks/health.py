"""What ``ActivationMonitor`` costs in training, against the same training without it.

A model of ``health_models`` (``--model``): ``mlp`` (the default), 12 blocks of
``Linear(256, 1024)``, ``GELU``, ``Linear(1024, 256)`` on 64 rows, a step of about 40 ms
on one thread, where the monitor's fixed costs show; or ``gpt2``, the 12-block GPT-2-style
model of ``make bench`` with its head on 8 x 128 tokens, a step of about 1.4 s. Trained by
a real Lightning ``Trainer`` (``fit`` with ``max_steps``; no logger, no checkpointing),
SGD on one fixed batch. The monitor watches the outputs of all 12 blocks.

A step's time is the time between two consecutive ``on_train_batch_start`` calls of a
timing callback: the whole step (the batch, forward, backward, optimizer, and every
callback's hooks, the monitor's statistics, merge and logging included). The first step
of each ``fit`` is left out (warm-up).

Variants, one ``fit`` each per round, in interleaved rounds (the order reversed every
other round); each ratio is taken to the run without the monitor of the same round, and
printed as median (min to max) over the rounds:

- ``watched``: ``every_n_steps=1``: every step is watched. Its mean step time over
  ``off``'s is the cost of a watched step (goal: at most 1.05x).
- ``grads``: the same with the gradients too (``|grad_outputs[...]``).
- ``every50``: ``every_n_steps=50``: the steps timed (1 to ``steps - 1``) are not watched,
  so this is the cost of an unwatched step with the monitor attached.
- the average over a run with ``every_n_steps=50`` is computed from the two measured
  ratios of the same round: ``(watched + 49 x every50) / 50``; ``--direct`` also measures
  it: ``fit`` runs of 101 steps, steps 1 to 100 timed (steps 50 and 100 watched), mean
  step time over ``off``'s.

On a machine shared with others, whole ``fit`` runs a minute apart vary by 10-15 %, more
than the effect measured. Paired steps cancel most of that drift: ``fit`` runs watched
every other step (``every_n_steps=2``), each watched step's time over the mean of its two
unwatched neighbours' (an unwatched step has nothing registered). The average over a run
with ``every_n_steps=50`` is then ``(mean + 49) / 50``, the unwatched steps taken as free
(the ``every50`` row checks that, within its noise). ``--profile`` times the monitor's
own parts within a watched step, the fixed cost per watched module among them, and
prints cProfile's top entries (``health_profile.py``).

    python benchmarks/health.py --threads 1 --clock cpu --direct  # make bench-health: 3 min
    python benchmarks/health.py --quick
    python benchmarks/health.py --profile --threads 1       # where a watched step's time goes
    python benchmarks/health.py --model gpt2 --threads 1 --clock cpu  # 1.4 s steps: 10 min
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
from health_models import BENCHES, Bench
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.health_monitor import ActivationMonitor

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


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


def monitors(bench: Bench, baseline: bool = False) -> dict[str, Callable[[], list[pl.Callback]]]:
    spec, grads = bench.spec, bench.grad_spec
    variants: dict[str, Callable[[], list[pl.Callback]]] = {
        "off": lambda: [],
        "watched": lambda: [ActivationMonitor(spec, every_n_steps=1)],
        "grads": lambda: [ActivationMonitor(grads, every_n_steps=1)],
        "every50": lambda: [ActivationMonitor(spec, every_n_steps=50)],
    }
    if baseline:
        variants["watched_old"] = lambda: [Baseline(), ActivationMonitor(spec, every_n_steps=1)]
        variants["grads_old"] = lambda: [Baseline(), ActivationMonitor(grads, every_n_steps=1)]
    return variants


def fit(
    bench: Bench, lm: pl.LightningModule, callbacks: list[pl.Callback], steps: int,
    clock: Callable[[], float],
) -> float:  # fmt: skip
    """The mean seconds of steps 1 to ``steps - 1`` of one ``fit``."""
    timer = StepTimer(clock)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer, *callbacks])  # fmt: skip
    trainer.fit(lm, DataLoader(bench.data(steps), batch_size=None))
    return statistics.fmean(timer.steps())


def rounds(
    bench: Bench, lm: pl.LightningModule, variants: dict[str, Callable[[], list[pl.Callback]]],
    steps: int, repeats: int,
    clock: Callable[[], float], warm_up: bool = True,
) -> dict[str, list[float]]:  # fmt: skip
    """Mean step seconds of each variant per round (after a warm-up round, if asked)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(0 if warm_up else 1, repeats + 1):
        for name in names if round_ % 2 else list(reversed(names)):
            seconds = fit(bench, lm, variants[name](), steps, clock)
            if round_:
                samples[name].append(seconds)
    return samples


def alternating(
    bench: Bench,
    lm: pl.LightningModule,
    spec: str,
    steps: int,
    clock: Callable[[], float],
    old: bool = False,
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
    trainer.fit(lm, DataLoader(bench.data(steps), batch_size=None))
    took = timer.steps()  # took[i]: step i + 1
    return [took[s - 1] / ((took[s - 2] + took[s]) / 2) for s in range(2, steps - 1, 2)]


def over(samples: dict[str, list[float]], name: str) -> list[float]:
    return [t / b for t, b in zip(samples[name], samples["off"], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(BENCHES), default="mlp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--direct", action="store_true", help="also 101-step runs, N=50")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--baseline", action="store_true",
        help="also the monitor with the statistics as they were (float64 copies), same run",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=0, help="steps a fit (default mlp 40, gpt2 8; quick: half)"
    )
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 6; 1 quick)")
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
    bench = BENCHES[args.model]
    steps = args.steps or (40 if bench.name == "mlp" else 8) // (2 if args.quick else 1)
    repeats = args.rounds or (1 if args.quick else 6)
    lm = bench.module()
    if args.profile:
        from health_profile import profile

        profile(bench, lm, steps)
        return
    clock = CLOCKS[args.clock]
    samples = rounds(bench, lm, monitors(bench, args.baseline), steps, repeats, clock)
    watched, every50 = over(samples, "watched"), over(samples, "every50")
    kinds = [("outputs", bench.spec, False), ("grads", bench.grad_spec, False)]
    if args.baseline:
        kinds += [("outputs_old", bench.spec, True), ("grads_old", bench.grad_spec, True)]
    paired = {name: [] for name, _, _ in kinds}  # type: ignore[var-annotated]
    for _ in range(2):
        for name, spec, old in kinds:
            paired[name] += alternating(bench, lm, spec, 2 * steps + 1, clock, old)
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
        direct = {name: monitors(bench)[name] for name in ("off", "every50")}
        long = rounds(bench, lm, direct, 101, max(1, repeats // 3), clock, warm_up=False)
        rows["direct50"] = spread(over(long, "every50"))
        rows["direct_rounds"] = len(long["off"])
    facts = run_facts(model=bench.name, batch=list(bench.batch), spec=bench.spec, steps=steps,
                      rounds=repeats, clock=args.clock)  # fmt: skip
    print(markdown(facts, rows))


def markdown(facts: dict[str, Any], r: dict[str, Any]) -> str:
    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.3f}x ({x['min']:.3f} to {x['max']:.3f})"

    lines = [
        f"torch {facts['torch']}, {facts['threads']} threads, {facts['clock']} clock; batch "
        f"{facts['batch']} ({facts['model']}), SGD, Lightning `fit`; `{facts['spec']}` "
        "(12 blocks); "
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
