"""docs/warnings.md quotes each warning as it is emitted: each one is reproduced here (the
dump that cannot be resumed is found in the source, its message built from its parts), and
every quote on the page must match one warning reproduced, whitespace aside, `<...>`
standing for what changes from run to run."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import (
    AttributionPatching,
    FeatureWriter,
    IOCaptureCallback,
    ModelIOCatcher,
    StoreDataModule,
)
from lightning_iocatch.capture import Zero
from lightning_iocatch.probes import LinearProbe

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "warnings.md"
KEY = "layer/outputs"


def quotes() -> list[str]:
    return [" ".join(q.split()) for q in re.findall(r"```text\n(.*?)```", PAGE.read_text(), re.S)]


def pattern(quote: str) -> re.Pattern[str]:
    parts = re.split(r"<[^>]+>", quote)
    return re.compile(".+?".join(re.escape(part) for part in parts), re.S)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[KEY] if isinstance(batch, dict) else batch[0]
        return self.layer(x).pow(2).mean()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Swallows(nn.Module):
    """A forward with a bare `except`, around the module early exit stops after."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:  # noqa: SIM105 - catching everything is what this warning is about
            x = self.b(self.a(x))
        except BaseException:
            pass
        return x


def lightning_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump, an SAE-like fit on it stopped and resumed, a plain loader resumed."""
    import lightning.fabric.utilities.data as fabric_data

    monkeypatch.setattr(fabric_data, "_num_cpus_available", lambda: 8)  # a larger machine
    options: dict[str, Any] = dict(accelerator="cpu", devices=1, enable_progress_bar=False)
    options.update(enable_model_summary=False)
    data = TensorDataset(torch.randn(40, 4))
    store = tmp_path / "features"
    dump = IOCaptureCallback(f"outputs[{KEY.split('/')[0]}]", writer=FeatureWriter(store))
    pl.Trainer(callbacks=[dump], logger=False, **options).predict(
        Net(), DataLoader(data, batch_size=8), return_predictions=False
    )
    rows = StoreDataModule(store, KEY, batch_size=8)
    every = ModelCheckpoint(tmp_path / "ck", "{step}", every_n_train_steps=2)
    logger = CSVLogger(tmp_path / "logs")
    pl.Trainer(max_steps=2, callbacks=[every], logger=logger, **options).fit(Net(), datamodule=rows)
    again = ModelCheckpoint(tmp_path / "ck", "{step}", every_n_train_steps=2)
    pl.Trainer(max_epochs=1, callbacks=[again], logger=False, **options).fit(
        Net(), datamodule=rows, ckpt_path=tmp_path / "ck" / "step=2.ckpt"
    )
    plain = ModelCheckpoint(tmp_path / "plain", "{step}", every_n_train_steps=2)
    pl.Trainer(max_steps=2, callbacks=[plain], logger=False, **options).fit(
        Net(), DataLoader(data, batch_size=8)
    )
    pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, **options).fit(
        Net(), DataLoader(data, batch_size=8), ckpt_path=tmp_path / "plain" / "step=2.ckpt"
    )


def our_warnings() -> None:
    net = nn.Sequential(nn.Linear(4, 4))
    with ModelIOCatcher(net, "cpu")(edits=[Zero("0", call=1)]):
        net(torch.randn(2, 4))
    with ModelIOCatcher(net, "cpu")(grad_outputs=["0"]):
        net(torch.randn(2, 4))
    LinearProbe(lambda batch: batch, num_classes=2).compute()
    catcher = ModelIOCatcher(Swallows(), "cpu")
    with catcher(outputs=["a"], early_exit=True):
        catcher.run(torch.randn(2, 4))


def left_padded_attribution() -> None:
    from tests.lightning_models import tiny_llama

    class LanguageModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.model(**batch, use_cache=False)

    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    batch = {"input_ids": ids * mask, "attention_mask": mask}

    def pair(batch: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        corrupted = batch["input_ids"].clone()
        corrupted[:, -1] = (corrupted[:, -1] + 1) % 64
        return batch, {**batch, "input_ids": corrupted}

    atp = AttributionPatching(
        "outputs[model.model.layers.*]",
        pair=pair,
        forward=lambda module, batch: module.model(**batch, use_cache=False),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, callbacks=[atp],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(LanguageModel(), DataLoader([batch], batch_size=None), verbose=False)


def unresumable_message() -> str:
    """The message of lightning/function_records.py's warning, its placeholders as `<>`."""
    tree = ast.parse((ROOT / "lightning_iocatch/lightning/function_records.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                part.value if isinstance(part, ast.Constant) else "<>" for part in node.values
            )
            if "cannot be resumed" in text:
                return text
    raise AssertionError("the warning of a dump that cannot be resumed is gone")


def test_every_quote_on_the_page_is_a_warning_as_emitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lightning_warnings(tmp_path, monkeypatch)
        our_warnings()
        left_padded_attribution()
    emitted = {" ".join(str(warning.message).split()) for warning in caught}
    emitted.add(" ".join(unresumable_message().split()))
    shown = quotes()
    assert len(shown) >= 12
    for quote in shown:
        assert any(pattern(quote).fullmatch(message) for message in emitted), quote
