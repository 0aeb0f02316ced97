"""Edits through IOCaptureCallback: a predict dump under an edit, recorded by its store.

The truth is a forward of the same model with a hand-written forward hook adding the steering
vector, read at the captured layer by another hand-written hook, over the same rows.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.capture import Edit, Replace, Steer, Zero
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
    digest = hashlib.blake2b(vector.numpy().tobytes(), digest_size=16).hexdigest()
    assert recorded[0]["vector"] == {"shape": [WIDTH], "dtype": "float32", "blake2b": digest}
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


def interrupted(path: Path, edits: list[Any]) -> TinyModule:
    """A dump of 16 rows in batches of 8 killed at its second batch: rows 0-7 committed."""
    torch.manual_seed(0)
    module = TinyModule(fail_at_batch=1)
    callback = IOCaptureCallback("outputs[model.layers.2]", writer=FeatureWriter(path), edits=edits)
    with pytest.raises(RuntimeError, match="boom"):
        trainer([callback]).predict(module, loader(16, 8), return_predictions=False)
    module.fail_at_batch = None
    return module


def resume(module: TinyModule, path: Path, edits: list[Any]) -> None:
    writer = FeatureWriter(path, mode="resume")
    callback = IOCaptureCallback("outputs[model.layers.2]", writer=writer, edits=edits)
    trainer([callback]).predict(module, loader(16, 8), return_predictions=False)


class Scale(nn.Module):
    """Multiplies by its one weight."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(factor))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.factor


def scale_by(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda h: h * factor


FUNCTIONS: dict[str, Callable[[float], Callable[[torch.Tensor], torch.Tensor]]] = {
    "lambda": lambda factor: (lambda h: h * 2.0) if factor == 2.0 else (lambda h: h * 3.0),
    "partial": lambda factor: functools.partial(torch.mul, other=factor),
    "closure": scale_by,
    "module weights": lambda factor: Scale(factor).forward,
}


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_a_resume_under_another_function_is_refused_and_rows_are_never_mixed(
    tmp_path: Path, kind: str
) -> None:
    """Before: the store recorded a function by its name only; rows 0-7 were written under
    ``h * 2``, the resume under ``h * 3`` was accepted and wrote rows 8-15 under it."""
    path, make = tmp_path / "store", FUNCTIONS[kind]
    module = interrupted(path, [Replace("model.layers.0", make(2.0))])
    with pytest.raises(StoreError, match="holds captures with edits"):
        resume(module, path, [Replace("model.layers.0", make(3.0))])
    resume(module, path, [Replace("model.layers.0", make(2.0))])  # made again: the same
    assert torch.equal(FeatureStore(path)[KEY], scaled_truth(module, 2.0))


class Opaque:
    """A callable object of a type the store cannot read: it scales by a hidden factor."""

    def __init__(self, factor: float) -> None:
        self._factor = factor

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h * self._factor


def test_a_function_that_cannot_be_read_warns_on_a_fresh_dump_and_refuses_a_resume(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store"
    with pytest.warns(UserWarning, match=r"cannot be resumed: .*Opaque object"):
        module = interrupted(path, [Replace("model.layers.0", Opaque(2.0))])
    with pytest.raises(
        StoreError, match=r"cannot resume .*edits: .*Opaque .*__fingerprint__.*mode='overwrite'"
    ):
        resume(module, path, [Replace("model.layers.0", Opaque(3.0))])
    same = Opaque(2.0)  # the user's word that it is the same: taken, and recorded
    same.__fingerprint__ = "double"  # type: ignore[attr-defined]
    resume(module, path, [Replace("model.layers.0", same)])
    assert torch.equal(FeatureStore(path)[KEY], scaled_truth(module, 2.0))
    assert FeatureStore(path).metadata["edits"][0]["function"]["fingerprint"] == "double"
    named = Opaque(2.0)
    named.__fingerprint__ = "double"  # type: ignore[attr-defined]
    module = interrupted(tmp_path / "named", [Replace("model.layers.0", named)])
    with pytest.raises(StoreError, match="holds captures with edits"):
        other = Opaque(3.0)
        other.__fingerprint__ = "triple"  # type: ignore[attr-defined]
        resume(module, tmp_path / "named", [Replace("model.layers.0", other)])
    resume(module, tmp_path / "named", [Replace("model.layers.0", named)])
    assert torch.equal(FeatureStore(tmp_path / "named")[KEY], scaled_truth(module, 2.0))
    recorded = FeatureStore(tmp_path / "named").metadata["edits"][0]["function"]
    assert recorded == {"function": f"{__name__}.Opaque", "fingerprint": "double"}


def scaled_truth(module: TinyModule, factor: float) -> torch.Tensor:
    """Layer 2's outputs over the 16 rows with layer 0's output scaled by a hand hook."""
    seen: list[torch.Tensor] = []
    scale = module.model.layers[0].register_forward_hook(lambda m, a, out: out * factor)
    read = module.model.layers[2].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            module(dataset(16).tensors[0])
    finally:
        scale.remove()
        read.remove()
    return seen[0]
