"""2-process CPU DDP: each rank captures its own batches; together they cover the data once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.ddp_scenarios import ranks_of
from tests.lightning_models import TinyModule, dataset, manual_outputs


@pytest.mark.slow
def test_ddp_predict_and_validate(ddp_scenarios: Path) -> None:
    out = ranks_of(ddp_scenarios, "ddp_capture")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    module = TinyModule()
    module.load_state_dict(ranks[0]["state_dict"])
    expected = manual_outputs(module, dataset(21).tensors[0])[1]
    seen: list[int] = []
    for rank in ranks:
        assert rank["hooks_left"] == 0 and rank["predict_step_restored"]
        assert rank["tail_calls_in_predict"] == 0  # early exit cut every predict forward short
        assert rank["tail_calls"] == 3  # validation forwards run whole: 3 batches a rank
        for indices, captured in zip(rank["predict_indices"], rank["predict_outputs"], strict=True):
            assert torch.equal(captured, expected[list(indices)])
            seen += indices
        assert len(rank["validate_outputs"]) == 3  # 20 samples, 2 ranks, batches of 4
    assert sorted(seen) == list(range(21))  # every sample exactly once across ranks


@pytest.mark.soak
def test_a_two_process_cpu_dump_exits_cleanly_every_time(tmp_path: Path) -> None:
    """Before, about 1 run in 6 ended with one process aborting at interpreter exit
    ("terminate called without an active exception": gloo's worker thread freed the last
    collective, the writer's end-of-dump agreement, while Python shut down); measured 6 of
    36 runs here, 0 of 36 after. Three runs, each rank's exit checked through its stderr
    (the mechanism itself is tested deterministically below)."""
    from tests.store.test_writer_resume import save_weights

    weights = save_weights(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DUMP_WEIGHTS": str(weights)}
    for run in range(3):
        result = subprocess.run(
            [
                sys.executable,
                "tests/scripts/dump_features.py",
                str(tmp_path / f"s{run}"),
                "--devices",
                "2",
                "--n",
                "16",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "terminate called" not in result.stderr, f"run {run}: {result.stderr[-2000:]}"


def test_a_gloo_group_is_destroyed_at_exit_while_python_is_whole(tmp_path: Path) -> None:
    """The mitigation itself, deterministic: at exit, the gloo group is already destroyed
    when the handlers registered before the library's run (atexit runs them last first)."""
    code = """
import atexit, os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))
from lightning_iocatch.lightning.process_group_exit import destroy_gloo_group_at_exit
destroy_gloo_group_at_exit()
destroy_gloo_group_at_exit()  # once per process
dist.barrier()
"""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PORT": str(find_free_network_port())}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "initialized at exit: False\n"
