"""Run every CPU benchmark and print the README's performance table (markdown).

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


def table(overhead: dict, predict: dict, dump: dict, probes: dict) -> str:
    gpt2 = overhead["gpt2_12_blocks"]
    mlp = overhead["mlp_200_layers"]
    many = overhead["model_2000_modules"]
    early = [gpt2[f"early_exit_{label}"] for label in ("block0", "middle", "last")]
    write = dump["write_throughput"]
    rows = [
        (
            "idle catcher (no session open), 200-layer MLP / 2,000 modules / GPT-2",
            f"{mlp['idle']:.3f}x / {many['idle']:.3f}x / {gpt2['idle']:.3f}x",
            "≤ 1.01x",
        ),
        (
            "armed catcher, 1 module, 200-layer MLP / 2,000 modules / GPT-2",
            f"{mlp['armed']:.3f}x / {many['armed']:.3f}x / {gpt2['armed']:.3f}x",
            "≤ 1.03x",
        ),
        (
            "for contrast: inert hooks on every module (the reference design)",
            f"{mlp['all_hooks_idle']:.3f}x / {many['all_hooks_idle']:.3f}x / "
            f"{gpt2['all_hooks_idle']:.3f}x",
            "",
        ),
        (
            "early exit after block 0 / 6 / 11 of 12 (share of network run)",
            " / ".join(f"{e['ratio']:.3f}x ({e['share_run']:.3f})" for e in early),
            "± 0.03",
        ),
        (
            "`trainer.predict`, early exit after block 0",
            f"{predict['early_exit_block0']:.3f}x "
            f"(model cut by hand: {predict['share_block0']:.3f}x)",
            "",
        ),
        (
            "`trainer.predict`, capture block 0 without early exit",
            f"{predict['capture_block0']:.3f}x",
            "",
        ),
        (
            "`trainer.predict` dumping block 6 with FeatureWriter",
            f"{dump['predict_slowdown']['ratio']:.3f}x",
            "",
        ),
        (
            "FeatureWriter vs `save_file` (durable=False)",
            f"{write['feature_writer_MBps']:,.0f} vs {write['save_file_MBps']:,.0f} MB/s = "
            f"{write['ratio']:.2f}x",
            "≥ 0.8x",
        ),
        (
            "FeatureWriter vs `save_file` + fsync (durable=True, default)",
            f"{write['feature_writer_durable_MBps']:,.0f} vs {write['save_file_fsync_MBps']:,.0f} "
            f"MB/s = {write['ratio_durable']:.2f}x",
            "≥ 0.8x",
        ),
        (
            "peak RSS growth, dump of 20 shards vs 1 shard",
            f"{dump['peak_rss']['growth_MiB']} MiB",
            "0",
        ),
        (
            "validation epoch with ActivationStats on 12 blocks",
            f"{probes['activation_stats']:.3f}x",
            "≤ 1.15x",
        ),
        (
            "validation epoch with ActivationStats + LinearProbe + LayerCKA",
            f"{probes['stats_probe_cka']:.3f}x",
            "",
        ),
    ]
    lines = ["| measurement | result | target |", "|---|---|---|"]
    lines += [f"| {name} | {result} | {target} |" for name, result, target in rows]
    lines.append(
        f"\nRatios are medians against the same work without lightning-iocatch, measured in "
        f"the same run (torch {torch.__version__}, {torch.get_num_threads()} CPU threads)."
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
