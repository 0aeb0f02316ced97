"""Run by `make test-install` in a fresh virtual environment holding only the built wheel
and its dependencies: the package is imported from that environment, not the checkout, its
command answers, and one dump inside `trainer.predict` is read back equal to a forward
computed by hand.

    .venv-like/bin/python tests/scripts/installed_wheel.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_iocatch
from lightning_iocatch import FeatureStore, IOCaptureCallback


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch)


def main() -> None:
    where = Path(lightning_iocatch.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        sys.exit(f"lightning_iocatch imported from {where}, not from {sys.prefix}")
    command = Path(sys.executable).parent / "lightning-iocatch"
    subprocess.run([str(command), "--help"], check=True, capture_output=True)

    torch.manual_seed(0)
    net, data = Net(), torch.randn(10, 4)
    with tempfile.TemporaryDirectory() as out:
        dump = IOCaptureCallback("outputs[layer]", writer=f"{out}/features")
        trainer = pl.Trainer(
            accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[dump]
        )
        trainer.predict(net, DataLoader(data, batch_size=4), return_predictions=False)
        rows = FeatureStore(f"{out}/features")["layer/outputs"]
    with torch.no_grad():
        expected = data @ net.layer.weight.T + net.layer.bias
    torch.testing.assert_close(rows, expected)
    print(f"lightning-iocatch {version('lightning-iocatch')} from {where.parent}: "
          f"a dump of {len(rows)} rows read back")  # fmt: skip


if __name__ == "__main__":
    main()
