"""For tests/lightning/test_ddp.py: 2-process CPU DDP predict and validate, captured; run
in the shared 2-process launch (tests/ddp_scenarios.py), or alone::

    python tests/scripts/ddp_capture.py OUT_DIR

Each rank saves what it captured to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_iocatch import IOCaptureCallback
from tests.conftest import hook_count
from tests.lightning_models import TinyModule, loader
from tests.lightning_models import trainer as quiet_trainer


def main(out_dir: Path) -> None:
    pl.seed_everything(0)
    module = TinyModule()
    callback = IOCaptureCallback("outputs[model.layers.1]", early_exit=True)
    trainer = quiet_trainer([callback], devices=2, strategy="ddp")
    batches = trainer.predict(module, loader(21, 4))
    tail_calls_in_predict = module.model.tail.calls
    trainer.validate(module, loader(20, 4), verbose=False)
    rank = trainer.global_rank
    torch.save(
        {
            "state_dict": module.state_dict(),
            "predict_indices": callback.batch_indices["predict"][0],
            "predict_outputs": [b["model.layers.1"]["outputs"][0] for b in batches],
            "validate_outputs": callback.captures["validate"][0]["model.layers.1"]["outputs"],
            "hooks_left": hook_count(module),
            "predict_step_restored": "predict_step" not in vars(module),
            "tail_calls_in_predict": tail_calls_in_predict,
            "tail_calls": module.model.tail.calls,
        },
        out_dir / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
