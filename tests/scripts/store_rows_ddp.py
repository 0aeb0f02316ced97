"""Run by tests/store/test_training_data.py: one rank of a 2-process DDP fit on a store,
its DataLoader workers started by a given start method, then a DataLoader of StoreRows
built by hand; each rank writes what it read to ``OUT/{START_METHOD}-rank{rank}.json``.
Each start method in turn, in the same two processes (one launch, one process group)::

    python tests/scripts/store_rows_ddp.py STORE OUT START_METHOD [START_METHOD ...]

The top of this file imports nothing heavy on purpose: a worker started by ``spawn`` or
``forkserver`` imports this script again as its ``__main__`` (8 workers a run), and needs
only what unpickles the dataset. Lightning is imported in ``main``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ["model.layers.1/outputs", "head/inputs/args/0"]


def main(store: Path, out: Path, start_method: str) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_iocatch.lightning.datamodule import StoreDataModule
    from lightning_iocatch.store.training import INDEX, StoreRows
    from tests.lightning_models import IndexRecorder

    pl.seed_everything(0)
    data = StoreDataModule(
        store,
        KEYS,
        batch_size=11,
        num_workers=2,
        persistent_workers=start_method != "fork",  # each epoch in the same workers
        multiprocessing_context=start_method,
        seed=7,
        with_indices=True,
    )
    module = IndexRecorder(KEYS[0])
    run = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    run.fit(module, datamodule=data)
    rows = StoreRows(store, KEYS, batch_size=11, seed=7, with_indices=True)
    loader = DataLoader(rows, batch_size=None, num_workers=2, multiprocessing_context=start_method)
    facts = {
        "seen": module.seen,
        "sampler": type(run.train_dataloader.sampler).__name__,
        "batches": len(run.train_dataloader),
        "by_hand": [batch[INDEX].tolist() for batch in loader],
    }
    (out / f"{start_method}-rank{run.global_rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    for method in sys.argv[3:]:
        main(Path(sys.argv[1]), Path(sys.argv[2]), method)
