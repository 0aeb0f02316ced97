"""Patching from a store through IOCaptureCallback, in real predict, validate and test loops.

Clean activations of layer 0 are dumped by a predict run; a run over corrupted versions of
the same samples (batches of 6 over 20: the last one short) patches them back by dataset
index. The truth is one forward of the corrupted inputs with a hand-written forward hook
returning the clean rows (computed by a manual forward of the clean inputs), and another
hook reading layer 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.capture.store_patch import StorePatch
from lightning_iocatch.errors import CaptureError
from lightning_iocatch.lightning.batch_indices import BatchIndexer
from tests.conftest import hook_count
from tests.lightning.test_indices import Stream
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer

LAYER = "model.layers.0"
KEY = f"{LAYER}/outputs"
N, BATCH = 20, 6
BATCHES = [tuple(range(start, min(start + BATCH, N))) for start in range(0, N, BATCH)]


def clean_store(module: TinyModule, path: Path) -> FeatureStore:
    callback = IOCaptureCallback(f"outputs[{LAYER}]", writer=FeatureWriter(path))
    trainer([callback]).predict(module, loader(N, BATCH, seed=0), return_predictions=False)
    return FeatureStore(path)


def truth(module: TinyModule) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 2's outputs and the model's, over the corrupted rows with layer 0 patched."""
    clean = manual_outputs(module, dataset(N, seed=0).tensors[0])[0]
    seen: list[torch.Tensor] = []
    patch = module.model.layers[0].register_forward_hook(lambda m, a, out: clean)
    read = module.model.layers[2].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            out = module(dataset(N, seed=1).tensors[0])
    finally:
        patch.remove()
        read.remove()
    return seen[0], out


def test_predict_patches_each_sample_with_its_clean_row_and_a_dump_records_the_store(
    tmp_path: Path,
) -> None:
    module = TinyModule()
    store = clean_store(module, tmp_path / "clean")
    layer2, out = truth(module)
    with torch.no_grad():
        corrupted = module(dataset(N, seed=1).tensors[0])
    assert not torch.equal(corrupted, out)
    callback = IOCaptureCallback(
        "outputs[model.layers.2]",
        writer=FeatureWriter(tmp_path / "patched"),
        keep_in_memory=True,
        edits=[StorePatch(LAYER, store, KEY)],
    )
    predictions = trainer([callback]).predict(module, loader(N, BATCH, seed=1))
    assert torch.equal(torch.cat(predictions), out)  # type: ignore[arg-type]
    captured = callback.captures["predict"][0]["model.layers.2"]["outputs"]
    assert torch.equal(torch.cat(captured), layer2)
    assert callback.batch_indices["predict"][0] == BATCHES
    assert torch.equal(FeatureStore(tmp_path / "patched")["model.layers.2/outputs"], layer2)
    recorded = json.loads((tmp_path / "patched" / "store.json").read_text())["edits"]
    assert [(e["edit"], e["module"], e["store"], e["key"]) for e in recorded] == [
        ("StorePatch", LAYER, str(tmp_path / "clean"), KEY)
    ]
    assert hook_count(module) == 0


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_validation_and_test_patch_by_the_indices_looked_up_once_per_batch(
    tmp_path: Path, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = TinyModule()
    store = clean_store(module, tmp_path / "clean")
    layer2, out = truth(module)
    asked: list[tuple[int, int]] = []
    original = BatchIndexer.__call__

    def counted(self: BatchIndexer, trainer: Any, batch_idx: int, dataloader_idx: int) -> Any:
        asked.append((batch_idx, dataloader_idx))
        return original(self, trainer, batch_idx, dataloader_idx)

    monkeypatch.setattr(BatchIndexer, "__call__", counted)
    callback = IOCaptureCallback(
        "outputs[model.layers.2]", stages=[stage], edits=[StorePatch(LAYER, store, KEY)]
    )
    module.val_losses.clear()
    run = trainer([callback])
    getattr(run, stage)(module, loader(N, BATCH, seed=1), verbose=False)
    assert asked == [(batch, 0) for batch in range(len(BATCHES))]  # once per batch
    assert callback.batch_indices[stage][0] == BATCHES
    captured = callback.captures[stage][0]["model.layers.2"]["outputs"]
    assert torch.equal(torch.cat(captured), layer2)
    targets = dataset(N, seed=1).tensors[1]
    expected = [
        nn.functional.mse_loss(out[list(b)].squeeze(-1), targets[list(b)]).item() for b in BATCHES
    ]
    assert module.val_losses == expected  # the step's own loss saw the patched forward
    assert hook_count(module) == 0


def test_a_loader_without_dataset_indices_is_refused_naming_the_fix(tmp_path: Path) -> None:
    module = TinyModule()
    store = clean_store(module, tmp_path / "clean")
    patch = StorePatch(LAYER, store, KEY)
    shuffled = DataLoader(dataset(N, seed=1), batch_size=BATCH, shuffle=True)
    callback = IOCaptureCallback("outputs[model.layers.2]", stages=["validate"], edits=[patch])
    with pytest.raises(CaptureError, match="dataset indices are unknown.*no shuffling"):
        trainer([callback]).validate(module, shuffled, verbose=False)
    assert hook_count(module) == 0
    module.predict_step = lambda batch, batch_idx: module(batch[0])  # type: ignore[method-assign]
    callback = IOCaptureCallback("outputs[model.layers.2]", stages=["predict"], edits=[patch])
    with pytest.raises(CaptureError, match="dataset indices are unknown.*IterableDataset"):
        trainer([callback]).predict(module, DataLoader(Stream(), batch_size=2))
    assert hook_count(module) == 0
    short = IOCaptureCallback("outputs[model.layers.2]", stages=["validate"], edits=[patch])
    with pytest.raises(StoreError, match="holds no sample of dataset index 20, 21"):
        trainer([short]).validate(module, loader(N + 2, BATCH, seed=1), verbose=False)
    assert hook_count(module) == 0
