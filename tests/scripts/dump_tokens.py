"""Run by tests/test_token_rows.py: a token-row dump of a tiny Llama with 2 DDP processes.

    python tests/scripts/dump_tokens.py PATH

11 sentences over 2 ranks in batches of 3: the DistributedSampler pads one rank with a
repeated sample, which must not be stored twice.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows
from tests.test_token_rows import EOS, LAYER, Decoder, Sentences, pad


def main() -> None:
    writer = FeatureWriter(sys.argv[1], tokens=TokenRows(drop_first=True, drop_token_ids={EOS}))
    callback = IOCaptureCallback(f"outputs[{LAYER}]", early_exit=True, writer=writer)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    loader = DataLoader(Sentences(), batch_size=3, collate_fn=pad())
    trainer.predict(Decoder(), loader, return_predictions=False)


if __name__ == "__main__":
    main()
