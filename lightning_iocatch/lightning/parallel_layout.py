"""Who writes and who counts: the data-parallel layout of a run, from Lightning's strategy.

Under tensor parallelism (Lightning's ``ModelParallelStrategy``, or any strategy whose
sampler splits the data over fewer replicas than there are processes) the processes of a
tensor-parallel group run the same samples: the capture engine gives each of them the
whole values (:mod:`~lightning_iocatch.capture.sharded`), and one of them, the first of
its group, writes them to a store and counts them in probes, the health monitor,
intervention effects and attribution patching. A store's shards are named by
data-parallel rank, and its ``world_size`` is the number of data-parallel ranks.

The layout comes from the strategy's sampler settings (``distributed_sampler_kwargs``:
``num_replicas`` and ``rank``), as Lightning gives each process its share of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_iocatch.probes.base import _gather_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DataParallelLayout", "forwards_gather_parameters"]


@dataclass(frozen=True)
class DataParallelLayout:
    """The data-parallel place of this process.

    Attributes:
        rank: its data-parallel rank (its share of the samples; the store's shard rank).
        size: the number of data-parallel ranks.
        counts: whether this process writes and counts its samples (the first process
            of its tensor-parallel group; every process without tensor parallelism).
        counting: per global rank, whether that process counts.
    """

    rank: int
    size: int
    counts: bool
    counting: tuple[bool, ...]

    @classmethod
    def of(cls, trainer: pl.Trainer) -> DataParallelLayout:
        """The layout of ``trainer``'s run. Makes one collective where the processes are more
        than the data-parallel ranks (every process must call it at the same point)."""
        world, global_rank = trainer.world_size, trainer.global_rank
        settings = _sampler_settings(trainer)
        size = int(settings.get("num_replicas", world))
        rank = int(settings.get("rank", global_rank))
        if size >= world:
            return cls(rank, size, True, (True,) * world)
        mine = torch.tensor([rank], device=trainer.strategy.root_device)
        every = _gather_tensors(mine).reshape(-1).tolist()
        counting = tuple(every.index(r) == g for g, r in enumerate(every))
        return cls(rank, size, counting[global_rank], counting)


def _sampler_settings(trainer: pl.Trainer) -> dict[str, int]:
    """The strategy's sampler settings; none for a strategy of one process (every process
    its own samples where a strategy has none, as Lightning's samplers then do)."""
    strategy = getattr(trainer, "strategy", None)
    return dict(getattr(strategy, "distributed_sampler_kwargs", None) or {})


def forwards_gather_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether each forward gathers parameters from every data-parallel process (FSDP,
    FSDP2's ``fully_shard``, DeepSpeed): a process that skips a forward makes the others
    wait for it."""
    if trainer.world_size < 2:
        return False
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, DeepSpeedStrategy)):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(module, FSDPModule) for module in pl_module.modules())
