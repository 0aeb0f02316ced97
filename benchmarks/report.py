"""Run every CPU benchmark and print the performance table of docs/performance.md (markdown).

    python benchmarks/report.py            # about 4 minutes on 2 cores
    python benchmarks/report.py --quick    # smoke test

Each benchmark runs in its own process and prints JSON; this script only formats it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def run(script: str, quick: bool) -> dict:
    command = [sys.executable, str(HERE / script), *(["--quick"] if quick else [])]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def spread(r: dict) -> str:
    """``median (min to max)`` of a ratio, as the table prints it."""
    return f"{r['median']:.3f}x ({r['min']:.3f} to {r['max']:.3f})"


def state(r: dict, at_most: float | None = None, at_least: float | None = None) -> str:
    """Meets only when the whole spread is on the right side; straddling is said so."""
    low, high = r["min"], r["max"]
    if at_most is not None:
        ok, miss = high <= at_most, low > at_most
    else:
        assert at_least is not None
        ok, miss = low >= at_least, high < at_least
    return "meets" if ok else "misses" if miss else "spread straddles it"


def verdict(
    results: list[dict], at_most: float | None = None, at_least: float | None = None
) -> str:
    target = f"≤ {at_most}x" if at_most is not None else f"≥ {at_least}x"
    return f"{target}: " + " / ".join(state(r, at_most, at_least) for r in results)


def three(results: list[dict], key: str) -> str:
    return " / ".join(spread(r[key]) for r in results)


def table(overhead: dict, predict: dict, dump: dict, probes: dict) -> str:
    models = [overhead[k] for k in ("mlp_200_layers", "model_2000_modules", "gpt2_12_blocks")]
    gpt2 = overhead["gpt2_12_blocks"]
    write = dump["write_throughput"]
    rows = [
        (
            "idle catcher (no session open), 200-layer MLP / 2,000 modules / GPT-2",
            three(models, "idle"),
            verdict([m["idle"] for m in models], at_most=1.01),
        ),
        (
            "armed catcher, 1 module, 200-layer MLP / 2,000 modules / GPT-2",
            three(models, "armed"),
            verdict([m["armed"] for m in models], at_most=1.03),
        ),
        (
            "for contrast: inert hooks on every module (the reference design)",
            three(models, "all_hooks_idle"),
            "",
        ),
    ]
    for label in ("block0", "middle", "last"):
        e = gpt2[f"early_exit_{label}"]
        rows.append(
            (
                f"early exit after `{e['block']}` of `h.0`..`h.11` (share of network run)",
                f"{spread(e)} (share {e['share_run']:.3f}, excess {e['excess']:+.3f})",
                "excess of the medians ≤ 0.03: "
                + ("meets" if abs(e["excess"]) <= 0.03 else "misses"),
            )
        )
    rows += [
        (
            "`trainer.predict`, early exit after block 0 (model cut by hand)",
            f"{spread(predict['early_exit_block0'])} ({spread(predict['share_block0'])})",
            "",
        ),
        (
            "`trainer.predict`, capture block 0 without early exit",
            spread(predict["capture_block0"]),
            "",
        ),
        (
            "`trainer.predict` dumping block 6 with FeatureWriter",
            spread(dump["predict_slowdown"]["with_writer"]),
            "",
        ),
        (
            "FeatureWriter vs `save_file` + fsync, durable, throughput "
            f"({write['save_file_fsync_MBps']:,.0f} MB/s plain)",
            spread(write["ratio"]),
            verdict([write["ratio"]], at_least=0.8),
        ),
        (
            "peak RSS growth, dump of 20 shards vs 1 shard",
            f"{dump['peak_rss']['growth_MiB']} MiB",
            "0",
        ),
        (
            "validation epoch with ActivationStats on 12 blocks",
            spread(probes["activation_stats"]),
            verdict([probes["activation_stats"]], at_most=1.15),
        ),
        (
            "validation epoch with ActivationStats + LinearProbe + LayerCKA",
            spread(probes["stats_probe_cka"]),
            "",
        ),
    ]
    lines = ["| measurement | median (min to max) | target |", "|---|---|---|"]
    lines += [f"| {name} | {result} | {target} |" for name, result, target in rows]
    lines.append(
        "\nEach ratio is taken round by round against the same work without lightning-iocatch "
        "in the same run, over interleaved rounds; a target is met only when the whole spread "
        f"is on its side (torch {torch.__version__}, {torch.get_num_threads()} CPU threads)."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args()
    results = [
        run(script, args.quick) for script in ("overhead.py", "predict.py", "dump.py", "probes.py")
    ]
    print(table(*results))


if __name__ == "__main__":
    main()
