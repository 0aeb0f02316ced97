"""SAEModule trained by several processes, for tests/sae/test_sae_distributed.py.

The same global batches are fed to 1 process and to 2, each process of the 2 getting its
share of every global batch (its slice; ``SHARES`` holds an even and an uneven split); the
test compares the weights, the dead-latent counts, the input normalisation and BatchTopK's
threshold the runs end with. Ways in:

- ``main(out)``: DDP, in the shared 2-process launch of tests/ddp_scenarios.py; rank 0 saves
  ``out/ddp.pt``, the final state of each (architecture, split).
- ``python tests/scripts/sae_distributed.py fsdp OUT``: the same under
  ``ModelParallelStrategy`` (FSDP2 over 2 data-parallel processes); ``OUT/fsdp.pt``.
- ``python tests/scripts/sae_distributed.py resume STORE OUT --devices N --batch-size B
  [--dtype float64] [--kill-after-batch K] [--ckpt PATH]``: BatchTopK on a store
  (StoreDataModule), 2 epochs, ``ModelCheckpoint`` every ``EVERY`` steps in ``OUT/ckpt``;
  ``--kill-after-batch K`` SIGKILLs the run's process group once batch K of epoch 0 has
  ended (after the checkpoint callbacks ran); ``OUT/final.pt`` at the end.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.sae import SAEModule
from lightning_iocatch.sae import SparseAutoencoder

D_IN, D_SAE, K, BATCH, STEPS = 16, 64, 4, 64, 30
ARCHITECTURES = ("topk", "batchtopk", "jumprelu", "relu")
SHARES = {"even": (32, 32), "uneven": (40, 24)}
CASES = [("ddp", architecture, split) for architecture in ARCHITECTURES for split in SHARES]
CASES += [("fsdp", architecture, "uneven") for architecture in ARCHITECTURES]
CASES += [("fsdp", "batchtopk", "even")]
EVERY = 3  # checkpoint every EVERY optimizer steps (resume)
KEY = "h/outputs"


def rows(count: int, seed: int = 0) -> torch.Tensor:
    """``count`` float64 rows of a fixed low-rank mixture: few directions for 64 latents,
    so latents die and the auxiliary loss works. Four of the ten directions appear only
    in the last 24 rows of every 64, one process's share in either split: latents that
    fire on one process only, which only a count over both keeps alive."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(10, D_IN, generator=generator, dtype=torch.float64)
    codes = torch.relu(torch.randn(count, 10, generator=generator, dtype=torch.float64))
    codes[:, 6:] *= (torch.arange(count) % BATCH >= BATCH - 24)[:, None]
    noise = 0.05 * torch.randn(count, D_IN, generator=generator, dtype=torch.float64)
    return codes @ basis + noise


def write_store(path: Path, count: int) -> None:
    """A store of ``count`` float32 rows of :func:`rows` under ``KEY``, in stored batches of
    100 rows."""
    from lightning_iocatch.store.plan import prepare_store
    from lightning_iocatch.store.writer import ShardWriter

    settings = {"spec": None, "stage": "predict", "dtype": None}
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", settings))
    values = rows(count, seed=2).float()
    for first in range(0, count, 100):
        index = list(range(first, min(first + 100, count)))
        writer.write({KEY: values[index]}, indices=index)
    writer.close()


def global_batches() -> list[torch.Tensor]:
    return list(rows(STEPS * BATCH).split(BATCH))


def module(architecture: str, dtype: torch.dtype = torch.float64, kind: type[SAEModule] = SAEModule,
           **options: Any) -> SAEModule:  # fmt: skip
    """A seeded SAEModule; in float64 every parameter is float64 (JumpReLU's threshold too,
    which the SAE keeps in float32), so that only the order of sums differs between runs."""
    k = K if "topk" in architecture else None
    sae = SparseAutoencoder(D_IN, D_SAE, architecture, k, dtype=dtype,  # type: ignore[arg-type]
                            generator=torch.Generator().manual_seed(1))  # fmt: skip
    if architecture == "jumprelu":
        sae.threshold = nn.Parameter(sae.threshold.detach().to(dtype))
    sparsity = {"jumprelu": 0.01, "relu": 0.05}.get(architecture, 1.0)
    settings = {"lr": 3e-3, "lr_warmup_steps": 4, "lr_decay_steps": 8, "lr_end": 3e-4,
                "total_steps": STEPS - 2, "sparsity_coefficient": sparsity,
                "sparsity_warmup_steps": 5, "dead_after_tokens": 4 * BATCH,
                "normalize_batches": 2, **options}  # fmt: skip
    return kind(sae=sae, **settings)


def state(module: SAEModule) -> dict[str, torch.Tensor]:
    """What the runs must agree on: the SAE's parameters and buffers (whole, also where
    FSDP2 shards them) and the module's counts."""
    found = {}
    for name, value in [*module.sae.named_parameters(), *module.sae.named_buffers()]:
        value = value.detach()
        found[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    for name in ("tokens_since_fired", "norm_sum", "norm_rows", "norm_batches"):
        found[name] = getattr(module, name).detach().clone()
    sharded = [hasattr(value, "full_tensor") for value in module.sae.parameters()]
    return {**found, "sharded": torch.tensor(sharded)}


class Shares(pl.LightningDataModule):
    """Global batch ``s`` of ``batches``: a process's slice of it (``shares[rank]`` rows,
    after those of lower ranks), or the whole of it in a 1-process run."""

    def __init__(self, batches: list[torch.Tensor], shares: tuple[int, ...]) -> None:
        super().__init__()
        self.batches, self.shares = batches, shares

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        mine = self.batches
        if world > 1:
            assert len(self.shares) == world and sum(self.shares) == BATCH
            start = sum(self.shares[:rank])
            mine = [batch[start : start + self.shares[rank]] for batch in self.batches]
        return DataLoader(mine, batch_size=None, shuffle=False)  # type: ignore[arg-type]


def trainer(devices: int = 1, strategy: Any = "auto", **options: Any) -> pl.Trainer:
    settings = {"max_epochs": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False,
                "num_sanity_val_steps": 0, "use_distributed_sampler": False, **options}  # fmt: skip
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **settings)


def fit_shares(architecture: str, shares: tuple[int, ...], devices: int = 1,
               strategy: Any = "auto") -> dict[str, torch.Tensor]:  # fmt: skip
    """The state after ``STEPS`` global batches (2 of them estimating the normalisation)."""
    trained = module(architecture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and log intervals
        trainer(devices, strategy).fit(trained, datamodule=Shares(global_batches(), shares))
    return state(trained)


def main(out: Path) -> None:
    """One process of the 2-process run (in the shared launch of tests/ddp_scenarios.py):
    every (architecture, split) under DDP, then under FSDP2 (``ModelParallelStrategy``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    found = {}
    for architecture in ARCHITECTURES:
        for split, shares in SHARES.items():
            found["ddp", architecture, split] = fit_shares(architecture, shares, 2, "ddp")
            if ("fsdp", architecture, split) in CASES:
                strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
                found["fsdp", architecture, split] = fit_shares(architecture, shares, 2, strategy)
    found["validate"] = validate_figures(devices=2)
    if torch.distributed.get_rank() == 0:
        torch.save(found, out / "states.pt")


def validate_figures(devices: int = 1) -> dict[str, dict[str, float]]:
    """``val/...`` of a trained-looking SAE over a loader of 3 whole batches (``batch_size=
    None``: Lightning's DistributedSampler repeats one of them on 2 processes) and over 9
    rows in batches of 4 (it repeats one row), each counted once."""
    validated = module("topk", dtype=torch.float32)
    with torch.no_grad():
        validated.sae.b_enc.add_(0.05)
    loaders = {"items": DataLoader(list(rows(3 * BATCH, seed=3).float().split(BATCH)),
                                   batch_size=None),
               "samples": DataLoader(rows(9, seed=4).float(), batch_size=4)}  # fmt: skip
    found = {}
    for name, loader in loaders.items():
        run = trainer(devices, "ddp" if devices > 1 else "auto", use_distributed_sampler=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.validate(validated, loader, verbose=False)
        found[name] = {key: float(value) for key, value in run.callback_metrics.items()}
    return found


class Killed(SAEModule):
    """SIGKILLs its process group after batch ``kill_after_batch`` of epoch 0."""

    kill_after_batch = -1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 0 and batch_idx == self.kill_after_batch:
            os.killpg(os.getpgid(0), signal.SIGKILL)  # after the checkpoint callbacks ran


def resume(argv: list[str]) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_iocatch import StoreDataModule

    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the run, with stacks
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kill-after-batch", type=int, default=-1)
    parser.add_argument("--ckpt")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    trained = module("batchtopk", getattr(torch, args.dtype), Killed, total_steps=24)
    trained.kill_after_batch = args.kill_after_batch  # type: ignore[attr-defined]
    data = StoreDataModule(args.store, KEY, batch_size=args.batch_size, seed=5, shuffle_rows=256)
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", filename="{step}",
                                  every_n_train_steps=EVERY, save_top_k=-1)  # fmt: skip
    run = trainer(args.devices, "ddp" if args.devices > 1 else "auto", max_epochs=2,
                  enable_checkpointing=True, callbacks=[checkpoints])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(trained, datamodule=data, ckpt_path=args.ckpt)
    if run.global_rank == 0:
        torch.save(
            {**state(trained), "steps": torch.tensor(run.global_step)}, args.out / "final.pt"
        )


if __name__ == "__main__":
    resume(sys.argv[1:])
