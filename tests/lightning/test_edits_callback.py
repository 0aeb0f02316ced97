"""Edits through IOCaptureCallback: a predict dump under an edit, recorded by its store.

The truth is a forward of the same model with a hand-written forward hook adding the steering
vector, read at the captured layer by another hand-written hook, over the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.capture import Edit, Steer, Zero
from tests.lightning_models import WIDTH, TinyModule, dataset, loader, trainer

KEY = "model.layers.2/outputs"


def truth(module: TinyModule, vector: torch.Tensor) -> torch.Tensor:
    """Layer 2's outputs over the dataset's rows with layer 0's output steered by hand."""
    seen: list[torch.Tensor] = []
    steer = module.model.layers[0].register_forward_hook(lambda m, a, out: out + vector)
    read = module.model.layers[2].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            module(dataset().tensors[0])
    finally:
        steer.remove()
        read.remove()
    return seen[0]


def dump(module: TinyModule, path: Path, edits: list[Any], mode: str = "create") -> None:
    writer = FeatureWriter(path, mode=mode)
    callback = IOCaptureCallback("outputs[model.layers.2]", writer=writer, edits=edits)
    trainer([callback]).predict(module, loader(), return_predictions=False)


def test_a_dump_under_an_edit_holds_the_edited_rows_and_its_store_records_the_edit(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    vector = torch.randn(WIDTH)
    dump(module, tmp_path / "steered", [Steer("model.layers.0", vector)])
    dump(module, tmp_path / "clean", [])
    steered, clean = FeatureStore(tmp_path / "steered"), FeatureStore(tmp_path / "clean")
    assert torch.equal(steered[KEY], truth(module, vector))
    assert not torch.equal(steered[KEY], clean[KEY])
    recorded = json.loads((tmp_path / "steered" / "store.json").read_text())["edits"]
    assert [(e["edit"], e["module"], e["vector"]["shape"]) for e in recorded] == [
        ("Steer", "model.layers.0", [WIDTH])
    ]
    assert "edits" not in json.loads((tmp_path / "clean" / "store.json").read_text())
    # a resume under other edits is refused; under the same ones it goes on
    with pytest.raises(StoreError, match="holds captures with edits"):
        dump(module, tmp_path / "steered", [Steer("model.layers.0", vector * 2)], "resume")
    with pytest.raises(StoreError, match="holds captures with edits"):
        dump(module, tmp_path / "clean", [Zero("model.layers.1")], "resume")
    dump(module, tmp_path / "steered", [Steer("model.layers.0", vector.clone())], "resume")
    assert torch.equal(FeatureStore(tmp_path / "steered")[KEY], steered[KEY])


def test_an_edit_naming_no_module_is_refused_before_the_loop() -> None:
    callback = IOCaptureCallback("outputs[model.layers.2]", edits=[Zero("model.layer.0")])
    with pytest.raises(KeyError, match="did you mean 'model.layers.0'"):
        trainer([callback]).predict(TinyModule(), loader(), return_predictions=False)
    with pytest.raises(TypeError, match="takes Edit objects"):
        IOCaptureCallback("outputs[model.layers.2]", edits=["model.layers.0"])  # type: ignore[list-item]


def test_a_store_mean_for_mean_ablation_and_a_steering_vector_between_two_stores(
    tmp_path: Path,
) -> None:
    """``store.mean(key)`` against NumPy in float64; then a dump steered by the difference
    of two dumps' means at layer 0 equals the hand-written hook adding that difference."""
    torch.manual_seed(0)
    module = TinyModule()
    dump(module, tmp_path / "clean", [])
    dump(module, tmp_path / "zeroed", [Zero("model.layers.0")])
    clean, zeroed = FeatureStore(tmp_path / "clean"), FeatureStore(tmp_path / "zeroed")
    mean = clean.mean(KEY)
    assert mean.dtype == torch.float64
    expected = clean[KEY].numpy().astype(np.float64).mean(0)
    np.testing.assert_allclose(mean.numpy(), expected, rtol=1e-13, atol=0)
    vector = (clean.mean(KEY) - zeroed.mean(KEY)).float()
    dump(module, tmp_path / "steered", [Steer("model.layers.0", vector)])
    assert torch.equal(FeatureStore(tmp_path / "steered")[KEY], truth(module, vector))


class Scaled(Edit):
    """An edit of the user's own, with a tuple attribute (JSON gives it back as a list)."""

    def __init__(self, module: str, factors: tuple[float, ...]) -> None:
        super().__init__(module)
        self.factors = factors

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        return value * self.factors[0]


def test_the_same_edits_resume_after_their_json_round_trip_and_unwritable_ones_are_refused(
    tmp_path: Path,
) -> None:
    module = TinyModule()
    dump(module, tmp_path / "s", [Scaled("model.layers.0", (2.0, 3.0))])
    dump(module, tmp_path / "s", [Scaled("model.layers.0", (2.0, 3.0))], "resume")  # accepted
    with pytest.raises(StoreError, match="holds captures with edits"):
        dump(module, tmp_path / "s", [Scaled("model.layers.0", (2.0, 4.0))], "resume")
    with pytest.raises(TypeError, match="must describe themselves as JSON"):
        IOCaptureCallback(
            "outputs[model.layers.2]",
            edits=[Steer("model.layers.0", torch.ones(WIDTH), alpha=float("nan"))],
        )
