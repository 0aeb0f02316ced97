"""lightning/datamodule.py: each rank reads the rows of its data-parallel place, as Lightning's
own samplers do (``trainer.strategy.distributed_sampler_kwargs``), not of its global rank.

Under ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)`` the two ranks
are one tensor-parallel group: they must see the same batches. The ground truth is a plain
DataLoader in the same Trainer (Lightning gives it a ``DistributedSampler`` from the
strategy's layout) over the epoch's sequence, read by one process in one batch. The two
Trainer runs (dp=1 x tp=2, then dp=2 x tp=1) are a scenario of the shared 2-process launch
(tests/ddp_scenarios.py: this module's ``main``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import StoreDataModule
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import INDEX, StoreRows
from lightning_iocatch.store.writer import ShardWriter
from tests.ddp_scenarios import ranks_of

KEY = "h/outputs"
N, BATCH, SEED = 21, 4, 5  # 21 rows: uneven over 2 ranks and batches of 4
LAYOUTS = {"tp": (1, 2), "dp": (2, 1)}  # (data_parallel_size, tensor_parallel_size)


def build_store(path: Path) -> Path:
    """N rows in stored batches of 5, each row's value its dataset index."""
    settings = {"spec": None, "stage": "predict", "dtype": None}
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", settings))
    for first in range(0, N, 5):
        index = torch.arange(first, min(first + 5, N))
        writer.write({KEY: index[:, None].float()}, indices=index.tolist())
    writer.close()
    return path


def truth(store: Path | str) -> list[int]:
    """Epoch 0's sequence, read by one process in one batch."""
    data = StoreRows(store, KEY, batch_size=N, seed=SEED, with_indices=True, rank=0, world_size=1)
    (batch,) = list(data)
    return batch[INDEX].tolist()


def rest_on(store: Path, state: dict[str, Any], world: int) -> list[int]:
    """The rest of the epoch after ``state``, read by ``world`` processes, by global step."""
    ranks = []
    for rank in range(world):
        data = StoreRows(
            store, KEY, batch_size=3, seed=SEED, with_indices=True, rank=rank, world_size=world
        )
        data.load_state_dict(state)
        ranks.append([batch[INDEX].tolist() for batch in data])
    return [i for step in zip(*ranks, strict=True) for batch in step for i in batch]


def test_tensor_parallel_ranks_read_the_same_rows_as_lightnings_sampler_gives_them(
    ddp_scenarios: Path,
) -> None:
    """Before the fix, the two ranks of one tensor-parallel group (dp=1) read different halves
    of the epoch (split by global rank), where the plain loader gave both the whole sequence;
    and the state saved mid-epoch counted 8 rows a step (2 x 4) where 4 were consumed, so a
    resume skipped rows."""
    out = ranks_of(ddp_scenarios, "training_layout")
    store = out / "store"
    sequence = truth(store)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Lightning's own layout: one replica under tp, two under dp
    assert [rank["tp"]["sampler"] for rank in ranks] == [{"num_replicas": 1, "rank": 0}] * 2
    assert [rank["dp"]["sampler"] for rank in ranks] == [
        {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1},
    ]
    # dp=1 x tp=2: Lightning's sampler gives both ranks the same (shuffled) rows; so must we:
    # the whole sequence on each, batch for batch
    whole = [sequence[i : i + BATCH] for i in range(0, N, BATCH)]
    assert [rank["tp"]["store"] for rank in ranks] == [whole, whole]
    plain = [[i for batch in rank["tp"]["plain"] for i in batch] for rank in ranks]
    assert plain[0] == plain[1] and sorted(plain[0]) == list(range(N))
    # dp=2 x tp=1: Lightning's sampler splits the rows between the ranks; we read each once
    plain = [[i for batch in rank["dp"]["plain"] for i in batch] for rank in ranks]
    assert len(set(plain[0]) & set(plain[1])) <= 1  # DistributedSampler repeats one to pad
    by_step = zip(ranks[0]["dp"]["store"], ranks[1]["dp"]["store"], strict=True)
    assert [i for step in by_step for batch in step for i in batch] == sequence
    # the state after 2 batches: the rows of 2 data-parallel steps, the same on every rank
    for layout, world in (("tp", 1), ("dp", 2)):
        states = [rank[layout]["state"] for rank in ranks]
        assert states[0] == states[1] and states[0]["batches"] == 2
        assert states[0]["rows"] == 2 * world * BATCH, (layout, states[0])
        consumed = sequence[: states[0]["rows"]]
        for other in (1, 2):  # resumed on another layout: the rest, each row once
            assert consumed + rest_on(store, states[0], other) == sequence, (layout, other)


# Both runs, in the shared 2-process launch


class Both(StoreDataModule):
    """The store's loader beside a plain one over the same sequence (Lightning samples it)."""

    def __init__(self, store: str, sequence: list[int]) -> None:
        super().__init__(store, KEY, batch_size=BATCH, seed=SEED, with_indices=True)
        self.sequence = sequence

    def train_dataloader(self) -> Any:
        plain = DataLoader(TensorDataset(torch.tensor(self.sequence)), batch_size=BATCH)
        return CombinedLoader({"store": super().train_dataloader(), "plain": plain}, "min_size")


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: dict[str, list[list[int]]] = {"store": [], "plain": []}
        self.state: dict[str, Any] = {}

    def configure_model(self) -> None:
        """ModelParallelStrategy requires it; nothing here is parallelised."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        rows = batch["store"]
        assert torch.equal(rows[KEY][:, 0].long(), rows[INDEX]), "rows not their indices"
        self.seen["store"].append(rows[INDEX].tolist())
        self.seen["plain"].append(batch["plain"][0].tolist())
        return self.layer(rows[KEY]).sum() * 0.0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:  # what a checkpoint would hold after 2 batches
            self.state = self.trainer.datamodule.state_dict()["store_rows"]  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path) -> None:
    """The scenario: rank 0 writes the store, then both processes run both layouts."""
    import torch.distributed as dist

    store = out / "store"
    if not dist.is_initialized():
        raise RuntimeError("the training_layout scenario runs after one that made the group")
    if dist.get_rank() == 0:
        build_store(store)
    dist.barrier()
    sequence = truth(store)
    facts: dict[str, Any] = {}
    for name, (dp, tp) in LAYOUTS.items():
        module = Recorder()
        run = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        run.fit(module, datamodule=Both(str(store), sequence))
        sampler = run.strategy.distributed_sampler_kwargs  # type: ignore[attr-defined]
        facts[name] = {**module.seen, "state": module.state, "sampler": sampler}
        rank = run.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
