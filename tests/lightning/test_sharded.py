"""Sharded models through every consumer, against the unsharded model in one process.

A tiny Llama (``tests.lightning.sharded_models``) sharded under Lightning's
``ModelParallelStrategy`` on CPU with gloo: torch's tensor-parallel plan (local shards in
layer 0, DTensors in layer 1's MLP) with dp=1 x tp=2 and dp=2 x tp=2 (4 processes), Hugging
Face's own plan, and FSDP2 (dp=2). Each run dumps, keeps captures in memory, feeds probes
and ``UnitActivations``, edits, measures ``InterventionEffects`` and
``AttributionPatching`` (validate) and watches two training steps with
``ActivationMonitor`` (fit); the truth is the same code on the same weights unsharded in
one process (:func:`tests.scripts.sharded_run.run` with ``plan="none"``), whose capture
path is itself tested against hand-written hooks elsewhere. A dump SIGKILLed under
dp=1 x tp=2 is resumed under dp=2 x tp=2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_iocatch import FeatureStore
from tests.conftest import ROOT
from tests.scripts.sharded_run import run

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "scripts" / "sharded_run.py"
TWO = ["torch:1:2:13:all", "hf:1:2:13:all", "fsdp:2:1:14:all"]
KILL = ["torch:1:2:13:kill"]
FOUR = ["torch:2:2:13:resume", "torch:2:2:13:all"]


def launch(out: Path, cases: list[str]) -> int:
    """Run the script's ``cases`` in their processes; its return code (-9: rank 0 killed)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *cases],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode in (0, -9), result.stderr[-4000:]
    return result.returncode


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The launch of 2 processes: three plans."""
    out = tmp_path_factory.mktemp("sharded")
    assert launch(out, TWO) == 0
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In ``make test-slow`` (four imports of Lightning on two cores): a dump killed in a
    launch of 2 processes, then the launch of 4: the resume under another layout, then
    the 2 x 2 run."""
    out = tmp_path_factory.mktemp("sharded-four")
    assert launch(out, KILL) == -9  # the case kills rank 0
    assert launch(out, FOUR) == 0
    return out


class Truths(dict):  # type: ignore[type-arg]
    """The unsharded runs, by (data-parallel ranks the truth stands for, samples), each run
    the first time a test asks for it."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def __missing__(self, key: tuple[int, int]) -> dict[str, Any]:
        dp, n = key
        path = self.out / f"{dp}-{n}"
        self[key] = run("none", dp, 1, path, n) | {"path": path}
        return self[key]


@pytest.fixture(scope="module")
def truths(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], dict[str, Any]]:
    return Truths(tmp_path_factory.mktemp("truth"))


def results(runs: Path, name: str) -> dict[str, Any]:
    return torch.load(runs / name / "results.pt", weights_only=False)


def close(got: Any, want: Any, path: str = "", tol: float = 1e-5) -> None:
    """``got`` equals ``want`` (nested dicts, lists, tensors, floats) within ``tol``."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for key in want:
            close(got[key], want[key], f"{path}/{key}", tol)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a, b, f"{path}/{i}", tol)
    elif isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor and got.shape == want.shape, (path, got.shape, want.shape)
        torch.testing.assert_close(
            got.double(), want.double(), atol=tol, rtol=tol, equal_nan=True, msg=path
        )
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=tol, abs=tol, nan_ok=True), path
    else:
        assert got == want, path


def same_store(path: Path, truth: Path) -> None:
    """Every key of the truth's store, row by row by dataset index, each index once."""
    got, want = FeatureStore(path), FeatureStore(truth)
    assert got.keys() == want.keys()
    assert got.indices.tolist() == want.indices.tolist()
    for key in want.keys():  # noqa: SIM118 (a FeatureStore)
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=key)


def same_figures(got: dict[str, Any], want: dict[str, Any], *, same_batches: bool) -> None:
    """Probes, unit summaries, effects, attribution scores and the monitor's history equal
    the truth's; with other batches (dp > 1) a unit's top example may swap with one whose
    value ties within float noise, so there the indices are not compared."""
    assert got["probes"] and any(key.endswith("dead_frac") for key in got["probes"])
    close(got["probes"], want["probes"], "probes")
    for key, summary in want["summaries"].items():
        assert torch.equal(got["summaries"][key]["active"], summary["active"]), key
        close(got["summaries"][key]["top_values"], summary["top_values"], key)
        if same_batches:
            assert torch.equal(got["summaries"][key]["top_index"], summary["top_index"]), key
    close(got["effects"], want["effects"], "effects")
    close(got["atp"], want["atp"], "atp", tol=1e-4)
    assert len(got["health"]) == 2
    close(got["health"], want["health"], "health", tol=1e-4)


@pytest.mark.parametrize("plan", ["torch", "hf"])
def test_tensor_parallel_values_are_whole_and_written_once(
    runs: Path, truths: dict[tuple[int, int], dict[str, Any]], plan: str
) -> None:
    """dp=1 x tp=2: memory captures (local shards and DTensors alike), edits, the store, a
    store of token rows and every figure equal the unsharded model's; each sample once."""
    got, want = results(runs, f"{plan}-1x2"), truths[1, 13]
    assert got["indices"] == want["indices"] == list(range(13))
    close(got["captures"], want["captures"], "captures")
    close(got["edited"], want["edited"], "edited")
    same_store(runs / f"{plan}-1x2" / "store", want["path"] / "store")
    same_store(runs / f"{plan}-1x2" / "tokens", want["path"] / "tokens")
    same_figures(got, want, same_batches=True)


@pytest.mark.soak
def test_two_data_parallel_groups_of_two_tensor_parallel_ranks(
    four: Path, truths: dict[tuple[int, int], dict[str, Any]]
) -> None:
    """dp=2 x tp=2 on 4 processes, 13 samples (uneven over the data-parallel ranks): one
    writer per tensor-parallel group, the store and the figures equal the unsharded run."""
    got, want = results(four, "torch-2x2"), truths[2, 13]
    assert got["indices"] == [0, 2, 4, 6, 8, 10, 12]  # rank 0's share
    store = FeatureStore(four / "torch-2x2" / "store")
    assert sorted(p.name for p in store.path.glob("ledger-*")) == [
        "ledger-r000.jsonl",
        "ledger-r001.jsonl",
    ]
    same_store(four / "torch-2x2" / "store", want["path"] / "store")
    same_store(four / "torch-2x2" / "tokens", want["path"] / "tokens")
    same_figures(got, want, same_batches=False)


def test_fsdp2(runs: Path, truths: dict[tuple[int, int], dict[str, Any]]) -> None:
    """FSDP2 (``fully_shard`` per layer, dp=2): the store and every figure equal the truth."""
    got, want = results(runs, "fsdp-2x1"), truths[2, 14]
    same_store(runs / "fsdp-2x1" / "store", want["path"] / "store")
    same_figures(got, want, same_batches=False)


@pytest.mark.soak
def test_a_killed_tensor_parallel_dump_resumes_under_another_layout(
    four: Path, truths: dict[tuple[int, int], dict[str, Any]]
) -> None:
    """Killed in its third batch under dp=1 x tp=2 (two shards committed by the one
    writer), resumed under dp=2 x tp=2: the committed batch of rank 0's share is not
    computed again, and the store equals the truth's, each sample once."""
    ledger = (four / "resumed" / "ledger-r000.jsonl").read_text().splitlines()
    assert len(ledger) >= 3  # the killed run's two shards, then the resume's
    assert json.loads((four / "resumed.json").read_text()) == [1, 2, 3]  # [0, 2] committed
    same_store(four / "resumed", truths[1, 13]["path"] / "store")
