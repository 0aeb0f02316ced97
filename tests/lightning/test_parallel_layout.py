"""DataParallelLayout: which process writes and counts under each parallel layout.

One process per call here, the collective replaced by the list every process would
contribute; the layouts are Lightning's (``ModelParallelStrategy`` puts global rank ``g``
at data-parallel rank ``g // tp`` of its device mesh), and the truth is written by hand:
the first process of each tensor-parallel group counts. The 2 x 2 layout also runs for
real, on 4 processes, in tests/lightning/test_sharded.py (``make test-slow``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lightning_iocatch.lightning.parallel_layout as parallel_layout
from lightning_iocatch.lightning.parallel_layout import DataParallelLayout


def trainer(world: int, rank: int, sampler: dict[str, int] | None) -> Any:
    strategy = SimpleNamespace(distributed_sampler_kwargs=sampler, root_device=torch.device("cpu"))
    return SimpleNamespace(world_size=world, global_rank=rank, strategy=strategy)


@pytest.mark.parametrize(
    ("dp", "tp", "counting"),
    [
        (2, 2, (True, False, True, False)),
        (1, 2, (True, False)),
        (1, 4, (True, False, False, False)),
        (2, 1, (True, True)),
    ],
)
def test_the_first_process_of_each_tensor_parallel_group_counts(
    monkeypatch: pytest.MonkeyPatch, dp: int, tp: int, counting: tuple[bool, ...]
) -> None:
    world = dp * tp
    every = torch.tensor([g // tp for g in range(world)])  # each process's data-parallel rank
    gathered: list[int] = []

    def gather(mine: torch.Tensor) -> torch.Tensor:
        gathered.append(int(mine))
        return every

    monkeypatch.setattr(parallel_layout, "_gather_tensors", gather)
    for g in range(world):
        layout = DataParallelLayout.of(trainer(world, g, {"num_replicas": dp, "rank": g // tp}))
        assert (layout.rank, layout.size) == (g // tp, dp)
        assert layout.counting == counting and layout.counts is counting[g]
    assert gathered == ([g // tp for g in range(world)] if tp > 1 else [])  # no collective


def test_one_process_or_a_strategy_without_sampler_settings_counts_alone() -> None:
    assert DataParallelLayout.of(trainer(1, 0, None)) == DataParallelLayout(0, 1, True, (True,))
    two = DataParallelLayout.of(trainer(2, 1, {"num_replicas": 2, "rank": 1}))
    assert two == DataParallelLayout(1, 2, True, (True, True))
