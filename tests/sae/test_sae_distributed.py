"""SAEModule on 2 CPU processes (gloo) ends with the state of 1 process that saw all their
rows: the weights, the dead-latent counts, the input normalisation and BatchTopK's threshold.

The truth is a 1-process ``Trainer.fit`` on the whole global batches (run here); the
2-process runs (DDP, and FSDP2 through ``ModelParallelStrategy``) get each process's slice
of every global batch, in an even and an uneven split (40 and 24 rows of 64), in the shared
launch of tests/ddp_scenarios.py (tests/scripts/sae_distributed.py's ``main``). All in
float64 (JumpReLU's threshold too), where only the order of sums differs: 1e-12 after 28
steps of Adam at lr 3e-3, gradients clipped at 1.0 (clipping on every step here: norms
above 5), with latents dead after 4 batches (the auxiliary loss on), some latents firing on
process 1's rows only (a fired count of one process's rows kept TopK's weights 0.09 apart),
and the normalisation from 2 batches.

The soak test kills a 1-process BatchTopK run on a store (StoreDataModule) with SIGKILL
mid-epoch and resumes it from its last checkpoint: on 1 process it ends bit for bit where
the uninterrupted run does (float32); on 2 processes (half the batch each, the epoch's rest
read in the same global batches, its last one split 19/18) within float32 rounding.
"""

from __future__ import annotations

import functools
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import start_script
from tests.ddp_scenarios import ranks_of
from tests.scripts.sae_distributed import (
    BATCH,
    CASES,
    fit_shares,
    module,
    write_store,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/sae_distributed.py"
DEAD_AFTER = 4 * BATCH
BUFFERS = ("tokens_since_fired", "norm_rows", "norm_batches")


@functools.cache
def one_process(architecture: str) -> dict[str, torch.Tensor]:
    """The truth: 1 process, the whole global batches (the split does not reach it)."""
    return fit_shares(architecture, (BATCH,), 1)


@pytest.fixture(scope="module")
def two_processes(ddp_scenarios: Path) -> dict[tuple[str, str, str], dict[str, torch.Tensor]]:
    return torch.load(ranks_of(ddp_scenarios, "sae_distributed") / "states.pt")


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_two_processes_end_as_one(two_processes: dict, case: tuple[str, str, str]) -> None:
    strategy, architecture, _ = case
    found, truth = dict(two_processes[case]), dict(one_process(architecture))
    # FSDP2 sharded every parameter (DDP none): the comparison is of the whole tensors
    assert bool(found.pop("sharded").all()) == (strategy == "fsdp")
    assert not truth.pop("sharded").any()
    assert found.keys() == truth.keys()
    for name in BUFFERS:  # counted over every process: exactly
        assert torch.equal(found[name], truth[name]), name
    for name in ("norm_sum", "input_scale", "topk_threshold"):
        if name in truth:
            assert truth[name].dtype == torch.float64
            torch.testing.assert_close(found[name], truth[name], rtol=1e-14, atol=0)
    assert int(truth["norm_batches"]) == 2 and float(truth["input_scale"]) != 1.0
    parameters = {
        name: value.detach() for name, value in module(architecture).sae.named_parameters()
    }
    for name in parameters:
        assert found[name].dtype == truth[name].dtype == torch.float64
        torch.testing.assert_close(found[name], truth[name], rtol=0, atol=1e-12)
    moved = float((truth["W_dec"] - parameters["W_dec"]).abs().max())
    assert moved > 1e-2  # it trained
    if architecture == "batchtopk":
        assert float(truth["topk_threshold"]) > 0
    if architecture in ("topk", "batchtopk"):  # the auxiliary loss was on at the end
        assert int((truth["tokens_since_fired"] > DEAD_AFTER).sum()) > 0


# SIGKILL mid-epoch, resumed on 1 and on 2 processes

ROWS = 12 * BATCH + 37  # 13 batches an epoch, the last one short; 2 epochs, 24 steps
KILL_AFTER = 8  # batch 8 of epoch 0: after step 7 (2 batches estimate the scale)
CKPT = "step=6.ckpt"  # the last one before (every 3 steps)


def run(out: Path, *options: str) -> subprocess.Popen[str]:
    """tests/scripts/sae_distributed.py's resume mode in a session of its own (it kills
    its process group)."""
    return start_script(SCRIPT, str(out.parent / "store"), str(out), *options)


def finish(process: subprocess.Popen[str], killed: bool = False) -> None:
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == (-signal.SIGKILL if killed else 0), stderr[-4000:]
    assert "not resumable" not in stderr  # Lightning's warning: not on a correct resume


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs, two at a time: uninterrupted and killed; then the killed one resumed on
    1 process (64 rows a batch) and on 2 (32 each)."""
    folder = tmp_path_factory.mktemp("sae-resume")
    write_store(folder / "store", ROWS)
    whole, killed = run(folder / "whole"), run(folder / "killed", "--kill-after-batch", "8")
    finish(whole)
    finish(killed, killed=True)
    saved = sorted(path.name for path in (folder / "killed/ckpt").iterdir())
    assert saved == ["step=3.ckpt", CKPT]
    assert not (folder / "killed/final.pt").exists()
    ckpt = str(folder / "killed/ckpt" / CKPT)
    one = run(folder / "one", "--ckpt", ckpt)
    two = run(folder / "two", "--ckpt", ckpt, "--devices", "2", "--batch-size", "32")
    finish(one)
    finish(two)
    return folder


def final(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final.pt")


@pytest.mark.soak
def test_killed_and_resumed_ends_bit_for_bit(resumed: Path) -> None:
    whole, again = final(resumed / "whole"), final(resumed / "one")
    assert int(whole["steps"]) == 24 and whole["W_dec"].dtype == torch.float32
    assert int((whole["tokens_since_fired"] > DEAD_AFTER).sum()) > 0
    assert float(whole["topk_threshold"]) > 0
    for name, value in whole.items():
        assert torch.equal(again[name], value), name


@pytest.mark.soak
def test_killed_and_resumed_on_two_processes(resumed: Path) -> None:
    """The rest of the run on 2 processes: the same global batches, so the same rows
    counted and the same normalisation; weights within float32 rounding."""
    whole, two = final(resumed / "whole"), final(resumed / "two")
    for name in ("steps", *BUFFERS, "norm_sum", "input_scale"):
        assert torch.equal(two[name], whole[name]), name
    torch.testing.assert_close(two["topk_threshold"], whole["topk_threshold"], rtol=0, atol=1e-8)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(two[name], whole[name], rtol=0, atol=1e-6)


def test_validation_counts_a_samplers_repeats_once(two_processes: dict) -> None:
    from tests.scripts.sae_distributed import validate_figures

    alone = validate_figures(devices=1)
    for loader in ("items", "samples"):
        together = two_processes["validate"][loader]
        assert together.keys() == alone[loader].keys() and "val/mse" in together
        for name, value in alone[loader].items():
            assert together[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (loader, name)
