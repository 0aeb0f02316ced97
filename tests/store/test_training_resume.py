"""StoreRows resumed mid-epoch: every row once over the runs, on any processes, workers and
batch size.

The truth of an epoch is its sequence read by one process in one batch (no Lightning, no
workers): every run, whatever its processes, workers and batch size, must consume exactly
that sequence, global step by global step (rank 0's batch, then rank 1's, ...), and a run
resumed from a state must consume the rest of it. Each row's value is its dataset index, so
a row read from the wrong place is caught too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lightning_iocatch.store.training as training
from lightning_iocatch import StoreDataModule, StoreError
from lightning_iocatch.lightning.datamodule import _check_sized_after_restore
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import INDEX, StoreRows
from lightning_iocatch.store.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[2]
KEY = "h/outputs"
N = 100_003  # rows: uneven for every world size and batch size used here
SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
ORDER = {"seed": 11, "shuffle_rows": 8192}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N rows in stored batches of 997 (the last shorter), each row's value its index."""
    path = tmp_path_factory.mktemp("resume") / "store"
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS))
    for first in range(0, N, 997):
        index = torch.arange(first, min(first + 997, N))
        writer.write({KEY: index[:, None].float()}, indices=index.tolist())
    writer.close()
    return path


def flat(lists: Any) -> list[int]:
    return [item for part in lists for item in part]


def truth(store: Path, epoch: int) -> list[int]:
    """The sequence of ``epoch``: read by one process, in one batch."""
    data = StoreRows(store, KEY, batch_size=N, with_indices=True, **ORDER)
    data.set_epoch(epoch)
    (batch,) = list(data)
    assert torch.equal(batch[KEY][:, 0].long(), batch[INDEX])
    return batch[INDEX].tolist()


def ranks(store: Path, world: int, batch_size: int, **options: Any) -> list[StoreRows]:
    return [
        StoreRows(
            store,
            KEY,
            batch_size=batch_size,
            with_indices=True,
            rank=rank,
            world_size=world,
            **{**ORDER, **options},
        )
        for rank in range(world)
    ]


def steps(datasets: list[StoreRows], workers: int, patch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each global step's rows (rank 0's batch, then rank 1's, ...), every rank's batches
    made by ``workers`` DataLoader workers and collected from them in turn."""
    per_rank = []
    for data in datasets:
        made = []
        for worker in range(workers):
            info = SimpleNamespace(id=worker, num_workers=workers)
            with patch.context() as patched:
                patched.setattr(training, "get_worker_info", lambda info=info: info)
                made.append(list(data))
        batches = [made[i % workers][i // workers] for i in range(sum(map(len, made)))]
        for batch in batches:
            assert torch.equal(batch[KEY][:, 0].long(), batch[INDEX])
        per_rank.append([batch[INDEX].tolist() for batch in batches])
        assert len(batches) == len(data) == len(per_rank[0])  # the same on every rank
    return [flat(rank[i] for rank in per_rank) for i in range(len(per_rank[0]))]


# The sequence does not depend on processes, workers or batch size


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_sequence_by_global_step_is_the_same_for_any_processes_workers_and_batch_size(
    store: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    expected = truth(store, 3) if shuffle else list(range(N))
    assert sorted(expected) == list(range(N)) and (expected != list(range(N))) == shuffle
    for world, batch_size, workers in ((1, 4096, 1), (2, 1000, 3), (3, 777, 2), (4, 5000, 1)):
        datasets = ranks(store, world, batch_size, shuffle=shuffle)
        for data in datasets:
            data.set_epoch(3)
        read = steps(datasets, workers, monkeypatch)
        assert flat(read) == expected, (world, batch_size, workers)


def test_a_window_mixes_rows_from_many_stored_batches(store: Path) -> None:
    """Rows of one stored batch are spread over their window, not read together."""
    first = truth(store, 0)[:1000]
    assert len({index // 997 for index in first}) > 8  # one batch of 1000 from >8 stored ones


# A state resumes the epoch on any processes, workers and batch size


RESUMES = [  # (processes, workers, batch size) before and after
    ((2, 2, 1000), (1, 1, 1500)),
    ((1, 1, 1500), (2, 2, 1000)),
    ((2, 2, 700), (2, 1, 700)),
    ((3, 1, 128), (2, 3, 2048)),
]


@pytest.mark.parametrize("fraction", [0.1, 0.37, 0.9])
@pytest.mark.parametrize(("before", "after"), RESUMES)
def test_a_state_resumes_the_epoch_with_every_row_once(
    store: Path,
    monkeypatch: pytest.MonkeyPatch,
    fraction: float,
    before: tuple[int, int, int],
    after: tuple[int, int, int],
) -> None:
    expected = [truth(store, epoch) for epoch in (0, 1)]
    (world, workers, batch_size), (world2, workers2, batch_size2) = before, after
    first_run = ranks(store, world, batch_size)
    everything = steps(first_run, workers, monkeypatch)
    done = round(fraction * len(everything))
    states = [data.state_dict(batches=done) for data in first_run]
    assert all(state == states[0] for state in states)  # every rank saves the same
    resumed = ranks(store, world2, batch_size2)
    for data in resumed:
        data.load_state_dict(states[0])
    rest = steps(resumed, workers2, monkeypatch)
    assert len(rest) == len(resumed[0]) and resumed[0].batches_done == done
    assert flat(everything[:done] + rest) == expected[0]  # each row once, in order
    for data in resumed:  # the next epoch is whole, as in an uninterrupted run
        data.set_epoch(1)
    assert flat(steps(resumed, workers2, monkeypatch)) == expected[1]


def test_a_resumed_run_resumed_again_and_drop_last(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = truth(store, 0)
    first = ranks(store, 2, 1000)
    read = steps(first, 1, monkeypatch)[:20]
    second = ranks(store, 1, 3000)
    second[0].load_state_dict(first[0].state_dict(batches=20))
    read += steps(second, 1, monkeypatch)[:5]
    third = ranks(store, 3, 500, drop_last=True)
    state = second[0].state_dict(batches=25)  # 20 batches before it, 5 of its own
    assert state["rows"] == 20 * 2000 + 5 * 3000 and state["batches"] == 25
    for data in third:
        data.load_state_dict(state)
    read += steps(third, 2, monkeypatch)
    consumed = flat(read)
    left = (N - 55_000) % 1500  # drop_last: only full steps of 3 x 500
    assert consumed == expected[: N - left] and len(set(consumed)) == len(consumed)


def test_a_state_of_another_sequence_or_out_of_range_is_refused(store: Path) -> None:
    (data,) = ranks(store, 1, 1000)
    state = data.state_dict(batches=3)
    (other,) = ranks(store, 1, 1000, seed=12)
    with pytest.raises(StoreError, match=r"another sequence of rows: seed 11 \(now 12\)"):
        other.load_state_dict(state)
    (other,) = ranks(store, 1, 1000, shuffle_rows=4096)
    with pytest.raises(StoreError, match=r"shuffle_rows 8192 \(now 4096\)"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"`batches` must be between 0 and 101"):
        data.state_dict(batches=102)


def test_a_loader_sized_before_the_restore_is_refused_where_it_would_end_the_epoch_early(
    store: Path,
) -> None:
    (first,) = ranks(store, 1, 1000)
    (data,) = ranks(store, 1, 2000)  # the global batch doubled
    data.load_state_dict(first.state_dict(batches=50))  # 50,000 rows in 50 batches
    assert data.batches_done == 50 and len(data) == 26 and data.epoch_length() == 51
    loader = StoreDataModule(store, KEY, batch_size=2000, **ORDER).train_dataloader()
    loader.dataset.load_state_dict(first.state_dict(batches=50))
    assert len(loader) == 76  # Lightning counts on from 50: 50 + 26, more than a whole epoch
    sized = SimpleNamespace(num_training_batches=51, limit_train_batches=1.0)  # before restore
    with pytest.raises(StoreError, match=r"sized \(51 batches\) before the checkpoint was"):
        _check_sized_after_restore(sized, data)  # type: ignore[arg-type]
    for fine in ((76, 1.0), (30, 30)):  # sized after the restore; a limit the user set
        trainer = SimpleNamespace(num_training_batches=fine[0], limit_train_batches=fine[1])
        _check_sized_after_restore(trainer, data)  # type: ignore[arg-type]


# Trainer.fit killed mid-epoch and resumed from its checkpoint


def fit(store: Path, out: Path, *options: str) -> int:
    """Run tests/scripts/train_resume.py in a session of its own (it kills its group)."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/scripts/train_resume.py"),
            str(store),
            str(out),
            *options,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert result.returncode in (0, -signal.SIGKILL), result.stderr[-4000:]
    return result.returncode


def seen(out: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """Each epoch's global steps (optimizer steps before it, then its rows by rank)."""
    lines = []
    for log in sorted(out.glob("seen-r*.txt")):
        for line in log.read_text().splitlines():
            epoch, step, rank, rows = line.split(" ")
            lines.append((int(epoch), int(step), int(rank), [int(i) for i in rows.split(",")]))
    epochs: dict[int, dict[int, list[int]]] = {}
    for epoch, step, _, rows in sorted(lines, key=lambda line: line[:3]):
        epochs.setdefault(epoch, {}).setdefault(step, []).extend(rows)
    return {epoch: sorted(by_step.items()) for epoch, by_step in epochs.items()}


KILLS = [  # (first run, kill after step, resumed run): 10 %, 37 % and 90 % of an epoch
    (
        ["--devices", "2", "--workers", "2", "--batch-size", "1250", "--persistent"],
        16,  # of 41 steps; checkpoint at 15
        ["--devices", "1", "--workers", "1", "--batch-size", "1999", "--steps-in-setup"],
    ),
    (
        ["--devices", "1", "--workers", "0", "--batch-size", "2500"],
        4,  # of 41 steps; checkpoint at 3
        ["--devices", "2", "--workers", "2", "--batch-size", "2000", "--persistent"],
    ),
    (
        ["--devices", "2", "--workers", "2", "--batch-size", "1000", "--limit", "30"],
        29,  # of 30 steps (the limit); checkpoint at 27
        ["--devices", "2", "--workers", "1", "--batch-size", "1000", "--limit", "30"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("first", "kill", "then"), KILLS)
def test_fit_killed_mid_epoch_and_resumed_reads_every_row_once(
    store: Path, tmp_path: Path, first: list[str], kill: int, then: list[str]
) -> None:
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    assert fit(store, killed, *first, "--kill-after-step", str(kill)) == -signal.SIGKILL
    checkpoint = max((killed / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    saved = torch.load(checkpoint, weights_only=False)["global_step"]
    assert fit(store, resumed, *then, "--ckpt", str(checkpoint)) == 0
    before, after = seen(killed), seen(resumed)
    assert max(step for step, _ in before[0]) >= saved  # it read past the checkpoint
    limit = then[then.index("--limit") + 1] if "--limit" in then else None
    for epoch in (0, 1):
        expected = truth(store, epoch)
        if limit is not None:  # the limit in steps of the unchanged global batch
            expected = expected[: int(limit) * 2000]
        consumed = [rows for step, rows in before.get(epoch, []) if step < saved]
        consumed += [rows for _, rows in after[epoch]]
        assert flat(consumed) == expected, epoch  # every row once, in the sequence's order
