"""A forward run elsewhere reused as the clean one (:meth:`Variants.record`, as
``InterventionEffects`` reuses the validation step's): reused only where it computes what
``forward()`` computes. The truth: ``forward()`` itself, run again by the test.

As the callback does it: ``record()`` at the batch's start, the step's forward, then
``runner(forward, None, recorded)``, all under inference mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher, Zero
from lightning_iocatch.capture.variants import Variants


class Batch:
    """A plain container without value equality (compared by type only)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.drop, self.head = nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 3)

    def forward(self, b: Batch | torch.Tensor) -> torch.Tensor:
        x = b.x if isinstance(b, Batch) else b
        scale = torch.tensor([1.0, 0.5, 0.25])  # in the default dtype
        return self.head(self.drop(torch.relu(self.enc(x)))) * scale


class Root(nn.Module):  # the LightningModule's place
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, b: Any) -> torch.Tensor:
        return self.model(b)


def reused(step: Callable[[], Any], forward: Callable[[], Any], root: Root) -> tuple[Any, ...]:
    """The clean output of ``forward`` after ``step`` was recorded, whether it was reused,
    what was said, and ``forward()`` run again (the truth)."""
    said: list[str] = []
    runner = Variants(ModelIOCatcher(root, None), {"zero": [Zero("model.head")]}, say=said.append)
    with torch.inference_mode():
        recorded = runner.record()
        step()
        out = runner(forward, None, recorded)
        truth = forward()
    return out["clean"], runner.reused, said, truth


def test_an_object_compared_by_type_only_is_reused_only_where_it_is_the_very_object():
    root = Root().eval()
    real, other = Batch(torch.randn(2, 4)), Batch(torch.randn(2, 4))
    clean, was, said, truth = reused(lambda: root(other), lambda: root(real), root)
    assert not was and torch.equal(clean, truth)
    assert any("could not be reused" in s and "very object" in s for s in said), said
    clean, was, said, truth = reused(lambda: root(real), lambda: root(real), root)
    assert was and torch.equal(clean, truth)


def autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_context_is_compared_at_the_forwards_own_calls():
    root, x = Root().eval(), torch.randn(4, 4)

    def cast() -> torch.Tensor:  # a forward= that enters autocast itself
        with autocast():
            return root(x)

    clean, was, said, truth = reused(lambda: root(x), cast, root)
    assert not was and torch.equal(clean, truth) and not torch.equal(clean, root(x))
    assert any("another context" in s for s in said), said
    clean, was, _, truth = reused(cast, cast, root)  # the step enters it too: the same
    assert was and torch.equal(clean, truth)


def test_a_module_mode_changed_inside_the_forward_is_seen():
    root, x = Root().eval(), torch.randn(4, 4)

    def dropping() -> torch.Tensor:  # a forward= that puts dropout in training mode
        torch.manual_seed(1)
        root.model.drop.train()
        try:
            return root(x)
        finally:
            root.model.drop.eval()

    clean, was, _, truth = reused(lambda: root(x), dropping, root)
    assert not was and torch.equal(clean, truth) and not torch.equal(clean, root(x))


@pytest.mark.parametrize("flag", ["dtype", "tf32"])
def test_the_default_dtype_and_tf32_flags_set_in_the_step_are_seen(flag: str):
    root, x = Root().eval(), torch.randn(4, 4)

    def step() -> None:
        if flag == "dtype":
            saved = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                root(x)
            finally:
                torch.set_default_dtype(saved)
            return
        saved_flag = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = not saved_flag
        try:
            root(x)
        finally:
            torch.backends.cudnn.allow_tf32 = saved_flag

    clean, was, _, truth = reused(step, lambda: root(x), root)
    assert not was and clean.dtype == truth.dtype == torch.float32 and torch.equal(clean, truth)
