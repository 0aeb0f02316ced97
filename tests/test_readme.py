"""Every Python block of README.md and of the docs runs, as written, so they cannot drift
from the code.

Each block runs in a fresh directory with the fixtures it uses but does not define (and
nothing else: a block imports every name of the library it uses): a small
LightningModule ``model`` (``model.layers.0..5``, ``model.head``) on 10-class data
(``loader``, ``train_loader``, ``val_loader``), a sparse autoencoder ``sae``, an offline
GPT-2 ``gpt2`` with ``ids``, and for token rows a Llama-style ``model`` with a
``tokenized_loader`` and ``eos_id``. ``Trainer`` is Lightning's, fixed to one CPU process,
one epoch and no logger or progress bar (a block asking for 8 GPUs runs on this machine);
the S3 block talks to the tests' own S3 server instead of ``127.0.0.1:9000``;
``from lightning.pytorch import Trainer`` in a block gets the same Trainer. A page whose
blocks share their state says so with ``SEQUENCE``: its blocks run in order, as one.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import RowLinear

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SEQUENCE = "<!-- test_readme: the blocks of this page run in sequence -->"


def blocks_of(page: Path) -> dict[str, str]:
    """A page's Python blocks by name; a page marked with ``SEQUENCE`` (its blocks share
    their state) is one entry, its blocks in order."""
    text = page.read_text()
    codes = re.findall(r"```python\n(.*?)```", text, re.S)
    name = page.relative_to(ROOT)
    if SEQUENCE in text and codes:
        return {f"{name}:0-{len(codes) - 1}": "\n".join(codes)}
    return {f"{name}:{number}": code for number, code in enumerate(codes)}


BLOCKS = {name: code for page in PAGES for name, code in blocks_of(page).items()}

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers", "ignore:The number of training batches"
)


LightningTrainer = pl.Trainer


def Trainer(**options: Any) -> pl.Trainer:
    """Lightning's Trainer on one CPU process for one epoch, quiet."""
    options.update(accelerator="cpu", devices=1, strategy="auto", max_epochs=1)
    options.setdefault("logger", False)
    options.setdefault("enable_progress_bar", False)
    options.setdefault("enable_model_summary", False)
    return LightningTrainer(**options)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(RowLinear(16, 16), nn.ReLU()) for _ in range(6))
        self.head = RowLinear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SparseAutoencoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(16, 64), nn.Linear(64, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch["model.layers.5/outputs"]
        codes = torch.relu(self.encode(x))
        return (self.decode(codes) - x).pow(2).mean() + 1e-3 * codes.abs().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from tests.lightning_models import tiny_llama

        self.model = tiny_llama(num_hidden_layers=6)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(**batch)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def digits(n: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 16, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def tokenized() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in (5, 8, 3, 8):
        ids = torch.randint(3, 64, (8,), generator=generator)
        ids[0], ids[length - 1] = 1, 2  # BOS ... EOS, then padding
        mask = (torch.arange(8) < length).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask})
    return DataLoader(rows, batch_size=2)


def namespace(code: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The fixtures ``code`` uses and does not define."""
    names: dict[str, Any] = {"Trainer": Trainer, "ModelCheckpoint": ModelCheckpoint}
    torch.manual_seed(0)
    if "tokenized_loader" in code:
        names.update(model=LanguageModel(), tokenized_loader=tokenized(), eos_id=2)
    else:
        names.update(model=Classifier(), loader=digits(64, 0), sae=SparseAutoencoder())
        names.update(train_loader=digits(64, 1), val_loader=digits(48, 2))
    if "gpt2" in code:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
        names.update(gpt2=GPT2LMHeadModel(config).eval(), ids=torch.randint(0, 50, (2, 8)))
    return names


@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_python_block_of_the_readme_or_the_docs_runs(
    block: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    code = BLOCKS[block]
    if "s3://" in code:
        server = request.getfixturevalue("server")
        with contextlib.suppress(FileExistsError):  # made by an earlier S3 block
            server.make_bucket("bucket")
        written = 'options = {"endpoint_url": "http://127.0.0.1:9000"}'
        assert written in code
        code = code.replace(written, f"options = {server.storage_options()!r}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pl, "Trainer", Trainer)  # also for `from lightning.pytorch import`
    exec(compile(code, block, "exec"), namespace(code, request))


def test_the_readme_and_the_docs_have_the_blocks_this_test_runs() -> None:
    assert sum(name.startswith("README.md") for name in BLOCKS) >= 3
    assert len(BLOCKS) >= 16 and any("FeatureWriter(" in code for code in BLOCKS.values())
