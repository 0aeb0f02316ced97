"""The benchmark scripts still run (quick mode); their figures are read by people, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_json(script: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{") : result.stdout.rindex("}") + 1])


@pytest.mark.slow
def test_overhead_benchmark_runs() -> None:
    results = run_json("overhead.py")
    assert set(results) >= {"mlp_200_layers", "model_2000_modules", "gpt2_12_blocks"}
    assert 0 < results["gpt2_12_blocks"]["early_exit_block0"]["ratio"] < 1


@pytest.mark.slow
def test_predict_benchmark_runs() -> None:
    results = run_json("predict.py")
    assert 0 < results["early_exit_block0"] < 1


@pytest.mark.slow
def test_dump_benchmark_runs() -> None:
    results = run_json("dump.py")
    assert results["write_throughput"]["ratio"] > 0
    assert results["peak_rss"]["20_shards"]["bytes"] > results["peak_rss"]["1_shards"]["bytes"]


@pytest.mark.slow
def test_probes_benchmark_runs() -> None:
    results = run_json("probes.py")
    assert results["activation_stats"] > 0
