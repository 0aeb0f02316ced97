"""For tests/store/test_token_rows.py: a token-row dump of a tiny Llama with 2 DDP processes,
run in the shared 2-process launch (tests/ddp_scenarios.py), or alone::

    python tests/scripts/dump_tokens.py PATH

11 sentences over 2 ranks in batches of 3: the DistributedSampler pads one rank with a
repeated sample, which must not be stored twice. Rank 0 reads the store right after
predict returns and writes the number of rows it sees to PATH/rows-seen-by-rank-0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, TokenRows
from tests.store.test_token_rows import EOS, LAYER, Decoder, Sentences, pad


class SlowRank1(Decoder):
    """Rank 1 is slow on its last batch: rank 0 ends predict first."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if self.global_rank == 1 and batch_idx == 1:
            time.sleep(2.0)
        return super().predict_step(batch, batch_idx, dataloader_idx)


def main(path: Path) -> None:
    writer = FeatureWriter(path, tokens=TokenRows(drop_first=True, drop_token_ids={EOS}))
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
    trainer.predict(SlowRank1(), loader, return_predictions=False)
    if trainer.global_rank == 0:  # read at once: the other rank's shards must be committed
        (path / "rows-seen-by-rank-0").write_text(str(len(FeatureStore(path))))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
