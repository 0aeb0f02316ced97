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
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_iocatch.store.training as training
from lightning_iocatch import StoreDataModule, StoreError
from lightning_iocatch.lightning.epoch_loader import EpochLoader, EpochTracker
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


def lightning(epoch: int, done: int, sized: int, limit: float | int = 1.0) -> Any:
    """What EpochLoader reads of a Trainer at the first batch of an epoch."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=done))
    return SimpleNamespace(
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        num_training_batches=sized,
        limit_train_batches=limit,
        reload_dataloaders_every_n_epochs=0,
    )


def test_the_loader_tells_lightning_the_resumed_epoch_and_refuses_what_would_lose_rows(
    store: Path,
) -> None:
    (first,) = ranks(store, 1, 1000)
    state = first.state_dict(batches=50)  # 50,000 rows in 50 batches
    data = StoreDataModule(store, KEY, batch_size=2000, **ORDER)  # the global batch doubled
    tracker = EpochTracker()
    loader = EpochLoader(data.dataset, lightning(0, 50, 76), tracker)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="this data module holds no position in it"):
        iter(loader).__next__()  # Lightning resumed, but the checkpoint had no state for it
    data.dataset.load_state_dict(state)
    assert len(loader) == 50 + 26 and data.dataset.epoch_length() == 51
    stale = EpochLoader(data.dataset, lightning(0, 50, 51), tracker)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="sized this epoch at 51 batches, but it has 76"):
        next(iter(stale))  # sized before the restore (estimated_stepping_batches in setup)
    limited = EpochLoader(data.dataset, lightning(0, 50, 30, 30), EpochTracker())  # type: ignore[arg-type]
    next(iter(limited))  # a limit the user set is not a stale size
    trainer = lightning(0, 50, 76)
    first_batch = next(iter(EpochLoader(data.dataset, trainer, tracker)))  # type: ignore[arg-type]
    assert len(first_batch[KEY]) == 2000 and trainer.reload_dataloaders_every_n_epochs == 1
    trainer.current_epoch, trainer.num_training_batches = 1, 51  # reloaded for epoch 1
    trainer.fit_loop.epoch_loop.batch_progress.current.ready = 0
    reloaded = EpochLoader(data.dataset, trainer, tracker)  # type: ignore[arg-type]
    assert len(reloaded) == 51
    next(iter(reloaded))
    assert trainer.reload_dataloaders_every_n_epochs == 0  # the user's setting again
    assert data.dataset.resumed_epoch is None and data.dataset.batches_done == 0


# Lightning's warning on a mid-epoch resume: not for this loader, still for a plain one


class Rows(pl.LightningModule):
    """Keeps the dataset index of each row it trains on (a store's batch or a plain one)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[KEY] if isinstance(batch, dict) else batch[0]
        self.seen += x[:, 0].long().tolist()  # each row's value is its index
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def stopped_and_resumed(out: Path, source: Any) -> tuple[list[int], list[int], list[str]]:
    """Fit on ``source()`` stopped after 3 of 6 batches (its checkpoint then), and fit again
    from that checkpoint: each run's rows, and the resumed run's warnings."""
    options: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False)
    options.update(enable_progress_bar=False, enable_model_summary=False)
    every = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    first, resumed = Rows(), Rows()
    pl.Trainer(max_steps=3, callbacks=[every], **options).fit(first, **source())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = pl.Trainer(max_epochs=1, enable_checkpointing=False, **options)
        run.fit(resumed, ckpt_path=out / "step=3.ckpt", **source())
    return first.seen, resumed.seen, [str(warning.message) for warning in caught]


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_a_resume_mid_epoch_is_not_warned_about_but_a_plain_loaders_still_is(
    tmp_path: Path,
) -> None:
    """Before, Lightning warned on the correct resume of StoreDataModule that the loader "is not
    resumable ... unreliable results"; a plain DataLoader, which does start the epoch again,
    must keep the warning."""
    path = tmp_path / "store"
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS))
    writer.write({KEY: torch.arange(60.0)[:, None]}, indices=list(range(60)))
    writer.close()
    sequence = StoreRows(path, KEY, batch_size=60, with_indices=True, **ORDER)
    expected = next(iter(sequence))[INDEX].tolist()

    def store() -> dict[str, Any]:
        return {"datamodule": StoreDataModule(path, KEY, batch_size=10, **ORDER)}

    before, after, warned = stopped_and_resumed(tmp_path / "store-ckpt", store)
    assert before + after == expected  # the rest of the epoch, each row once
    assert not [message for message in warned if "not resumable" in message], warned

    def plain() -> dict[str, Any]:
        rows = TensorDataset(torch.arange(60.0)[:, None])
        return {"train_dataloaders": DataLoader(rows, batch_size=10)}

    before, after, warned = stopped_and_resumed(tmp_path / "plain-ckpt", plain)
    assert before == after == list(range(30))  # read again from the start; 30.. never
    assert [message for message in warned if "not resumable" in message]


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
    assert "not resumable" not in result.stderr  # Lightning's warning: not on a correct resume
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


LIMITED = [
    "--devices",
    "1",
    "--batch-size",
    "2000",
    "--limit",
    "30",
    "--accumulate",
    "2",
    "--every",
    "1",
]
TWO_PERSISTENT = ["--devices", "2", "--workers", "2", "--batch-size", "2000", "--persistent"]
# (first run, kill after batch, resumed run): 37 %, 10 % and 87 % of an epoch. The first in
# `make test`; the other two, 2 processes resumed by 1 the other way round and a limited
# fit, in `make test-slow` (CI runs both).
KILLS = [
    (
        ["--devices", "2", "--workers", "2", "--batch-size", "1250", "--persistent"],
        16,  # of 41 batches; checkpoint after 15 (37 %)
        ["--devices", "1", "--workers", "1", "--batch-size", "1999"],
    ),
    pytest.param(
        ["--devices", "1", "--workers", "0", "--batch-size", "2500"],
        4,  # of 41 batches; checkpoint after 3
        [*TWO_PERSISTENT, "--steps-in-configure"],  # sized after the restore, batch changed
        marks=pytest.mark.soak,
    ),
    pytest.param(
        [*LIMITED, "--workers", "2"],
        26,  # of 30 batches (the limit); checkpoint after 26 (step 13, 87 %)
        [*LIMITED, "--workers", "1", "--steps-in-setup"],  # sized before the restore
        marks=pytest.mark.soak,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("first", "kill", "then"), KILLS)
def test_fit_killed_mid_epoch_and_resumed_reads_every_row_once(
    store: Path, tmp_path: Path, first: list[str], kill: int, then: list[str]
) -> None:
    """The killed run's batches before its checkpoint and the resumed run's are the epoch's
    sequence, every row once; the resumed epoch ends as Lightning ends an epoch (validation,
    the epoch-interval scheduler), and the next epoch is whole."""
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    assert fit(store, killed, *first, "--kill-after-batch", str(kill)) == -signal.SIGKILL
    checkpoint = max((killed / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    loops = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]
    saved = loops["epoch_loop.batch_progress"]["current"]["processed"]  # Lightning's count
    assert 0 < saved <= kill + 1
    assert fit(store, resumed, *then, "--ckpt", str(checkpoint)) == 0
    before, after = seen(killed), seen(resumed)
    assert max(batch for batch, _ in before[0]) >= saved - 1  # read up to the kill
    assert after[0][0][0] == saved  # Lightning counts the resumed epoch's batches on
    limit = int(then[then.index("--limit") + 1]) if "--limit" in then else None
    for epoch in (0, 1):
        expected = truth(store, epoch)
        if limit is not None:  # the limit in batches of the unchanged global batch
            expected = expected[: limit * 2000]
        consumed = [rows for batch, rows in before.get(epoch, []) if batch < saved]
        consumed += [rows for _, rows in after[epoch]]
        assert flat(consumed) == expected, epoch  # every row once, in the sequence's order
    events = (resumed / "events.txt").read_text().split("\n")
    ends = [line.split() for line in events if line.startswith("end")]
    assert [(int(e[1]), int(e[3])) for e in ends] == [
        (0, after[0][-1][0] + 1),  # the resumed epoch reached its length
        (1, len(after[1])),
    ]
    assert float(ends[1][2]) == float(ends[0][2]) / 2  # the scheduler stepped at epoch 0's end
    assert [line for line in events if line.startswith("val")] == ["val 0", "val 1"]
