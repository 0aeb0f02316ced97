"""Whether our reader's row order trains SAEs worse than SAELens' permutation: SAELens alone.

    ../.venv-bench/bin/python sae_order.py [--seeds 6] [--first-seed 0] [--only topk,relu]

``sae_quality.py`` compares the tools on 3 seeds each, and finds that SAELens fed the
order our reader drew for a seed gives our module's SAE (so the tools differ in their
orders). This script asks the remaining question with SAELens' trainer alone, so that
nothing of ours but the order is in it: for each architecture and seed, SAELens from its
initial weights of that seed trained on (a) its own permutation of the rows in memory
(``permuted_batches``) and (b) the batches our ``StoreRows`` reads for that seed
(``our_order``), the settings of ``sae_quality.py``; the held-out MSE, explained variance,
L0 and dead fraction of each. Printed per architecture: each figure's mean (min to max)
over the seeds for both orders, and in how many seeds our order gave the lower MSE; and
first, how alike the two orders of seed 0 are (``sae_quality.order_statistics``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import sae_quality as quality
import torch
from compact_common import FULL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--only", default=",".join(quality.ARCHITECTURES))
    args = parser.parse_args()
    quality.quiet()
    torch.set_num_threads(1)
    path, rows, evaluation = quality.rows_store(FULL, quality.HERE / ".stores")
    report: dict[str, Any] = {"order_statistics": quality.order_statistics(path, FULL.key, rows, 0)}
    print(f"ours / permutation, seed 0: {report['order_statistics']}", flush=True)
    report |= {
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "epochs": args.epochs,
    }
    for architecture in args.only.split(","):
        found: dict[str, dict[str, list[float]]] = {"permutation": {}, "our_order": {}}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            trained = {
                "permutation": quality.train_saelens(architecture, seed, rows, args.epochs),
                "our_order": quality.saelens_on_our_order(
                    architecture, seed, path, FULL.key, rows, args.epochs
                ),
            }
            for order, sae in trained.items():
                figures = quality.held_out(sae.encode, sae.decode, evaluation)
                for name, value in figures.items():
                    found[order].setdefault(name, []).append(value)
        pairs = zip(found["our_order"]["mse"], found["permutation"]["mse"], strict=True)
        lower = sum(ours < theirs for ours, theirs in pairs)
        report[architecture] = {
            order: {name: quality.spread(values) for name, values in figures.items()}
            for order, figures in found.items()
        }
        report[architecture]["our_order_lower_mse_seeds"] = lower
        line = [f"{architecture:9}"]
        for name in ("mse", "explained_variance", "l0", "dead_fraction"):
            mine, theirs = (report[architecture][o][name] for o in ("our_order", "permutation"))
            line.append(f"{name} {_shown(mine)} on our order vs {_shown(theirs)}")
        line.append(f"our order lower MSE in {lower} of {args.seeds} seeds")
        line.append(f"MSE per seed: ours {_rounded(found['our_order']['mse'])}, "
                    f"permutation {_rounded(found['permutation']['mse'])}")  # fmt: skip
        print(" | ".join(line), flush=True)
    print(json.dumps(report, indent=1))


def _shown(figure: dict[str, float]) -> str:
    return f"{figure['mean']:.4g} ({figure['min']:.4g} to {figure['max']:.4g})"


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 3) for value in values]


if __name__ == "__main__":
    main()
