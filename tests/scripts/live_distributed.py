"""LiveActivations on a tiny Llama, for tests/live/*: the shared inputs and recorders, the
2-process run of the shared launch, and a 1-process SAE run to SIGKILL and resume.

Ways in:

- ``main(out)``: DDP on 2 processes (gloo), in the shared launch of tests/ddp_scenarios.py:
  :data:`COUNT` sequences (an odd number: the shares are uneven, 21 and 20) as token rows,
  2 epochs of a :class:`Recorder`; each rank writes ``out/rank{r}.pt`` (per batch: epoch,
  batch index, keys, dataset indices, positions, rows) and ``out/steps{r}.txt``.
- ``python tests/scripts/live_distributed.py resume OUT [--kill-after-batch K] [--ckpt PATH]
  [--batch-size B]``: an ``SAEModule`` on 1 process, 2 epochs, ``ModelCheckpoint`` every
  :data:`EVERY` steps in ``OUT/ckpt``; every batch's ``epoch batch_idx index:position ...``
  appended (flushed) to ``OUT/batches.txt``; ``--kill-after-batch K`` SIGKILLs the process
  group once batch K of epoch 0 has ended (after the checkpoint callbacks ran);
  ``OUT/final.pt`` (the SAE's state) at the end.
- ``python tests/scripts/live_distributed.py sae-ddp OUT``: an ``SAEModule`` under DDP on 2
  processes, 2 epochs of the uneven shares (one process runs out of inputs a fill before
  the other); each rank writes ``OUT/sae{r}.txt``, its steps, at the end.
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

from lightning_iocatch import TokenRows
from lightning_iocatch.lightning.live import LiveActivations

COUNT, SEQ, PAD = 41, 12, 0
SPEC, KEY = "outputs[model.layers.1]", "model.layers.1/outputs"
BATCH, BUFFER, INPUT_BATCH = 24, 60, 5  # rows per batch, mixing buffer, sequences per forward
EVERY = 3  # checkpoint every EVERY optimizer steps (resume)


def texts(count: int = COUNT, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` left-padded sequences of ``SEQ`` tokens: 0 to 6 padding columns (id ``PAD``,
    mask 0), then token ids 3..63."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (count, SEQ), generator=generator)
    pads = torch.randint(0, 7, (count,), generator=generator)
    mask = (torch.arange(SEQ)[None, :] >= pads[:, None]).long()
    ids = torch.where(mask.bool(), ids, PAD)
    return [{"input_ids": ids[i], "attention_mask": mask[i]} for i in range(count)]


def language_model() -> nn.Module:
    from tests.lightning_models import tiny_llama

    return tiny_llama(num_hidden_layers=3)


def live(count: int = COUNT, inputs_batch: int = INPUT_BATCH, **options: Any) -> LiveActivations:
    settings = {"batch_size": BATCH, "buffer_rows": BUFFER, "tokens": TokenRows(), **options}
    inputs = DataLoader(texts(count), batch_size=inputs_batch)  # type: ignore[arg-type]
    return LiveActivations(language_model(), SPEC, inputs, **settings)


class Recorder(pl.LightningModule):
    """Trains a Linear on nothing useful; records every batch it gets: epoch, batch_idx,
    sorted keys, index, position, rows (in float32) and their dtype (``batch.get``: a batch
    missing a key is recorded, not a crash, so a DDP run never hangs on one rank's error)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        position = batch.get("position")
        rows = batch.get(KEY)
        self.seen.append({
            "epoch": self.current_epoch, "batch_idx": batch_idx, "keys": sorted(batch),
            "index": batch["index"].tolist(),
            "position": None if position is None else position.tolist(),
            "rows": None if rows is None else rows.detach().float().clone(),
            "dtype": None if rows is None else rows.dtype,
            "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
        })  # fmt: skip
        return self.layer.weight.sum() * 0.0 + self.layer.bias.sum() * 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def trainer(devices: int = 1, **options: Any) -> pl.Trainer:
    settings = {"max_epochs": 2, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False,
                "num_sanity_val_steps": 0, **options}  # fmt: skip
    strategy = "ddp" if devices > 1 else "auto"
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **settings)


def main(out: Path) -> None:
    """One process of the 2-process run (in the shared launch of tests/ddp_scenarios.py)."""
    recorder = Recorder()
    run = trainer(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(recorder, datamodule=live())
    rank = run.global_rank
    torch.save(recorder.seen, out / f"rank{rank}.pt")
    (out / f"steps{rank}.txt").write_text(str(run.global_step))


class Logged(pl.Callback):
    """Appends each batch's ``epoch batch_idx index:position ...`` to ``path``, flushed."""

    def __init__(self, path: Path, kill_after_batch: int = -1) -> None:
        self.path, self.kill_after_batch = path, kill_after_batch

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        pairs = zip(batch["index"].tolist(), batch["position"].tolist(), strict=True)
        line = " ".join(f"{i}:{p}" for i, p in pairs)
        with open(self.path, "a") as file:
            file.write(f"{trainer.current_epoch} {batch_idx} {line}\n")
            file.flush()
            os.fsync(file.fileno())


def sae_module(kill_after_batch: int = -1) -> Any:
    from lightning_iocatch.lightning.sae import SAEModule

    class KilledSAE(SAEModule):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.current_epoch == 0 and batch_idx == kill_after_batch:
                os.killpg(os.getpgid(0), signal.SIGKILL)  # after the checkpoint callbacks ran

    torch.manual_seed(0)
    return KilledSAE(32, 64, "topk", k=4, key=KEY, lr=3e-3, seed=1)


def resume(argv: list[str]) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the run, with stacks
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--kill-after-batch", type=int, default=-1)
    parser.add_argument("--ckpt")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trained = sae_module(args.kill_after_batch)
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", filename="{step}",
                                  every_n_train_steps=EVERY, save_top_k=-1)  # fmt: skip
    run = trainer(enable_checkpointing=True, callbacks=[Logged(args.out / "batches.txt"),
                                                        checkpoints])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(trained, datamodule=live(batch_size=args.batch_size), ckpt_path=args.ckpt)
    state = {name: value.detach().clone() for name, value in trained.sae.state_dict().items()}
    torch.save({**state, "steps": torch.tensor(run.global_step)}, args.out / "final.pt")


def sae_ddp(out: Path) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the run, with stacks
    run = trainer(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(sae_module(), datamodule=live())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sae{run.global_rank}.txt").write_text(str(run.global_step))


def fails() -> None:
    """A 2-process fit whose rank 1 forward raises in its third input batch (the second
    fill), while rank 0 waits in the fill's agreement: both processes must end, not hang."""
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the run, with stacks
    data = live()
    calls = [0]

    def fail_on_rank_1(module: nn.Module, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if data.trainer.global_rank == 1 and calls[0] == 3:
            raise RuntimeError("the frozen model failed on rank 1")

    data.model.register_forward_pre_hook(fail_on_rank_1, with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(2).fit(sae_module(), datamodule=data)


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume(sys.argv[2:])
    elif sys.argv[1] == "sae-ddp":
        sae_ddp(Path(sys.argv[2]))
    elif sys.argv[1] == "fails":
        fails()
    else:
        main(Path(sys.argv[1]))
