"""LiveActivations on 2 CPU processes (gloo) and across a SIGKILL.

DDP (the shared 2-process launch of tests/ddp_scenarios.py, tests/scripts/live_distributed.py's
``main``): 41 sequences, so the shares are uneven (21 and 20) and, with these buffer
settings, process 0 has a fill more than process 1. The truth is a 1-process dump of the
same inputs (``IOCaptureCallback`` + ``FeatureWriter(tokens=TokenRows())``, read with
``FeatureStore``): every row exactly once across the processes per epoch, the union the
dump's rows (their float32 values equal, though the processes batch other samples), the
same number of steps on both, and every batch with the same keys.

Soak: an ``SAEModule`` trained under DDP on those shares must finish; a 1-process
``SAEModule`` run SIGKILLed mid-epoch and resumed from its last checkpoint uses every row
once per epoch over the whole run (the batches the killed run did after the checkpoint not
counted) and ends bit for bit (``torch.equal``) where an uninterrupted run does.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import start_script
from tests.ddp_scenarios import ranks_of
from tests.live.test_live_rows import Frozen
from tests.scripts.live_distributed import COUNT, INPUT_BATCH, KEY, language_model, texts, trainer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/live_distributed.py"


@pytest.fixture(scope="module")
def ranks(ddp_scenarios: Path) -> list[tuple[list[dict[str, Any]], int]]:
    folder = ranks_of(ddp_scenarios, "live_distributed")
    found = []
    for rank in (0, 1):
        steps = int((folder / f"steps{rank}.txt").read_text())
        found.append((torch.load(folder / f"rank{rank}.pt", weights_only=False), steps))
    return found


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], torch.Tensor]:
    from torch.utils.data import DataLoader

    from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, TokenRows
    from lightning_iocatch.store.names import POSITION_KEY

    path = tmp_path_factory.mktemp("live-ddp-dump")
    writer = FeatureWriter(path, tokens=TokenRows())
    callback = IOCaptureCallback("outputs[lm.model.layers.1]", early_exit=True, writer=writer)
    loader = DataLoader(texts(COUNT), batch_size=INPUT_BATCH)  # type: ignore[arg-type]
    trainer(callbacks=[callback]).predict(Frozen(language_model()), loader,
                                          return_predictions=False)  # fmt: skip
    store = FeatureStore(path)
    pairs = zip(store.indices.tolist(), store[POSITION_KEY].tolist(), strict=True)
    return dict(zip(pairs, store[f"lm.{KEY}"], strict=True))


def test_both_processes_take_the_same_steps(ranks: list) -> None:
    (zero, steps0), (one, steps1) = ranks
    assert steps0 == steps1 == len(zero) == len(one) > 0
    for number in (0, 1):
        assert [b["batch_idx"] for b in zero if b["epoch"] == number] == [
            b["batch_idx"] for b in one if b["epoch"] == number
        ]


def test_every_row_once_across_processes_each_epoch_the_dump_rows(
    ranks: list, dumped: dict
) -> None:
    for number in (0, 1):
        found: dict[tuple[int, int], torch.Tensor] = {}
        counts: Counter[tuple[int, int]] = Counter()
        for seen, _ in ranks:
            for batch in (b for b in seen if b["epoch"] == number):
                for row, pair in enumerate(
                    zip(batch["index"], batch["position"] or [], strict=True)
                ):
                    counts[pair] += 1
                    found[pair] = batch["rows"][row]
        assert set(counts.values()) == {1}, [p for p, n in counts.items() if n > 1][:5]
        assert found.keys() == dumped.keys()
        for pair, row in dumped.items():
            assert torch.equal(found[pair], row), pair


def test_each_process_reads_its_own_share_of_the_inputs(ranks: list) -> None:
    for rank, (seen, _) in enumerate(ranks):
        indices = {index for batch in seen for index in batch["index"]}
        assert indices == set(range(rank, COUNT, 2))  # Lightning's unrepeated sampler's


def test_every_batch_holds_every_key(ranks: list) -> None:
    """Also the batches of a process whose inputs ran out while the other's had not (no
    rows, the same keys): an SAEModule reads ``batch[key]``."""
    for rank, (seen, _) in enumerate(ranks):
        for batch in seen:
            assert batch["keys"] == sorted([KEY, "index", "position"]), (rank, batch["batch_idx"])
    assert any(len(batch["index"]) == 0 for batch in ranks[1][0])  # the case arose


def start(*args: str) -> subprocess.Popen[str]:
    """The script in a session of its own (it kills its process group)."""
    return start_script(SCRIPT, *args)


def finish(process: subprocess.Popen[str], code: int = 0) -> str:
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == code, stderr[-4000:]
    return stderr


@pytest.mark.soak
def test_an_sae_trains_under_ddp_on_uneven_shares(tmp_path: Path) -> None:
    finish(start("sae-ddp", str(tmp_path)))
    assert (tmp_path / "sae0.txt").read_text() == (tmp_path / "sae1.txt").read_text()


@pytest.mark.soak
def test_a_forward_failing_on_one_process_ends_both() -> None:
    """Rank 1's frozen model raises while rank 0 waits for it in the fill's agreement (a
    collective): both processes end with the error (gloo raises in rank 0 once rank 1 has
    gone), well before the script's own 240 s hang guard."""
    process = start("fails")
    try:
        _, stderr = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError("a failed forward on one process left the other waiting") from None
    assert process.returncode != 0
    assert "the frozen model failed on rank 1" in stderr
    assert "Timeout" not in stderr  # not ended by the hang guard


KILL_AFTER, CKPT = 7, "step=6.ckpt"  # killed after batch 7 of epoch 0; checkpoints every 3


def log(path: Path) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(epoch, batch_idx, pairs)`` of each line the run appended to batches.txt."""
    found = []
    for line in path.read_text().splitlines():
        epoch, batch_idx, *rest = line.split(" ")
        pairs = [tuple(map(int, pair.split(":"))) for pair in rest if pair]
        found.append((int(epoch), int(batch_idx), pairs))
    return found  # type: ignore[return-value]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted and killed, then the killed one resumed (appending to its log) and a
    resume with another batch size (refused)."""
    folder = tmp_path_factory.mktemp("live-resume")
    whole = start("resume", str(folder / "whole"))
    killed = start("resume", str(folder / "killed"), "--kill-after-batch", str(KILL_AFTER))
    finish(whole)
    finish(killed, -signal.SIGKILL)
    saved = sorted(path.name for path in (folder / "killed/ckpt").iterdir())
    assert saved == ["step=3.ckpt", CKPT] and not (folder / "killed/final.pt").exists()
    ckpt = str(folder / "killed/ckpt" / CKPT)
    again = start("resume", str(folder / "killed"), "--ckpt", ckpt)
    other = start("resume", str(folder / "other"), "--ckpt", ckpt, "--batch-size", "16")
    assert "not resumable" not in finish(again)  # Lightning's warning: not on a correct resume
    assert "batch_size': 16" in finish(other, 1)
    return folder


@pytest.mark.soak
def test_killed_and_resumed_uses_every_row_once_per_epoch(resumed: Path) -> None:
    whole, joined = log(resumed / "whole/batches.txt"), log(resumed / "killed/batches.txt")
    first = next(i for i in range(1, len(joined)) if joined[i][1] <= joined[i - 1][1])
    assert [line[1] for line in joined[:first]] == list(range(KILL_AFTER + 1))
    assert joined[first][:2] == (0, 6)  # the resumed run starts after the checkpoint's 6
    assert joined[6:first] == whole[6 : KILL_AFTER + 1]  # redone the same, not counted
    counted = joined[:6] + joined[first:]
    assert counted == whole
    every = sorted(
        (index, position)
        for index, item in enumerate(texts(COUNT))
        for position in range(int(item["attention_mask"].sum()))
    )
    for number in (0, 1):
        assert sorted(p for e, _, pairs in counted if e == number for p in pairs) == every


@pytest.mark.soak
def test_killed_and_resumed_ends_bit_for_bit(resumed: Path) -> None:
    whole = torch.load(resumed / "whole/final.pt")
    again = torch.load(resumed / "killed/final.pt")
    assert whole.keys() == again.keys() and int(whole["steps"]) > 2 * KILL_AFTER
    for name, value in whole.items():
        assert torch.equal(again[name], value), name
