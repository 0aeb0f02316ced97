"""Run by tests/store/test_store.py: a predict dump through FeatureWriter, in its own process.

    python tests/scripts/dump_features.py PATH [--mode M] [--kill-at-batch K] [--devices 2] ...

PATH may be a URL (``s3://bucket/run``) with ``--storage-options JSON``.

``--kill-at-batch K`` SIGKILLs the process inside predict_step of batch K (after the
writer thread had time to commit earlier shards); ``--log FILE`` appends the dataset
indices of every batch actually computed; ``--fsize-limit BYTES`` sets RLIMIT_FSIZE (a
full disk) when batch ``--fsize-limit-at-batch`` starts; ``--document-ids`` keys the samples
by ids ``10**12`` apart (``tests.lightning_models.DocumentIds``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_iocatch import FeatureWriter, IOCaptureCallback
from tests.lightning_models import TinyModule, TinyNet, document_loader, loader


class DumpModule(TinyModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(model=TinyNet(3))
        self.kill_at_batch = args.kill_at_batch
        self.log_path = args.log
        self.fsize_limit = args.fsize_limit
        self.fsize_limit_at_batch = args.fsize_limit_at_batch

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if batch_idx == self.fsize_limit_at_batch:
            time.sleep(1.0)  # let the writer thread commit what it holds
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past it fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.fsize_limit, self.fsize_limit))
        if batch_idx == self.kill_at_batch:
            time.sleep(1.0)  # let the writer thread commit what it holds
            os.kill(os.getpid(), signal.SIGKILL)
        if self.log_path:
            indices = self.trainer.predict_loop._combined_loader.flattened[0].batch_sampler
            with open(self.log_path, "a") as handle:
                handle.write(json.dumps(indices.seen_batch_indices[batch_idx]) + "\n")
        return self(batch[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--mode", default="create")
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-shard-bytes", type=int, default=600)
    parser.add_argument("--kill-at-batch", type=int, default=None)
    parser.add_argument("--log", default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--fsize-limit", type=int, default=None)
    parser.add_argument("--fsize-limit-at-batch", type=int, default=None)
    parser.add_argument("--storage-options", type=json.loads, default=None)  # for a URL path
    parser.add_argument("--document-ids", action="store_true")  # ids 10**12 apart
    args = parser.parse_args()
    torch.manual_seed(0)
    module = DumpModule(args)
    module.load_state_dict(torch.load(os.environ["DUMP_WEIGHTS"]), strict=True)
    writer = FeatureWriter(
        args.path,
        mode=args.mode,
        max_shard_bytes=args.max_shard_bytes,
        storage_options=args.storage_options,
    )
    callback = IOCaptureCallback("outputs[model.layers.1]|inputs[head]", writer=writer)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    data = (document_loader if args.document_ids else loader)(args.n, args.batch_size)
    trainer.predict(module, data, return_predictions=False)


if __name__ == "__main__":
    main()
