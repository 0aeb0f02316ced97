"""The callback configured from a LightningCLI YAML file, run by a real LightningCLI."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from lightning_iocatch import IOCaptureCallback
from tests.lightning_models import TinyModule, TinyNet, dataset, manual_outputs


class CLIModule(TinyModule):
    def __init__(self, depth: int = 3) -> None:
        super().__init__(model=TinyNet(depth))


class CLIData(pl.LightningDataModule):
    def __init__(self, size: int = 12, batch_size: int = 4) -> None:
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.size), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self.predict_dataloader()


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_iocatch.IOCaptureCallback
      init_args:
        spec: outputs[model.layers.1]
        early_exit: true
        dtype: float16
model:
  depth: 4
data:
  size: 12
  batch_size: 4
"""


def test_callback_from_a_lightning_cli_yaml(tmp_path: Path) -> None:
    config = tmp_path / "capture.yaml"
    config.write_text(CONFIG)
    args = ["predict", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)]
    cli = LightningCLI(CLIModule, CLIData, args=args)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, IOCaptureCallback)]
    assert callback.early_exit and callback.dtype == torch.float16
    captured = torch.cat(callback.captures["predict"][0]["model.layers.1"]["outputs"])
    expected = manual_outputs(cli.model, dataset(12).tensors[0])[1]
    assert captured.dtype == torch.float16
    assert torch.equal(captured, expected.to(torch.float16))
    assert cli.model.model.tail.calls == 0  # early exit cut every forward short
