"""InterventionEffects reuses the validation step's own forward as the clean one where the
step calls the model as ``forward=`` does, and runs its own where it does not.

The truth: the logged values against hand-written hooks and NumPy in float64
(:func:`tests.lightning.test_effects.truth`), and the blocks' calls counted by a hook of the
test's own.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch.capture import Zero
from lightning_iocatch.lightning.effects import InterventionEffects
from tests.capture.test_variants_reuse import Batch, Net, autocast
from tests.lightning.test_effects import LM, forward, samples, truth, variants


def counted(module: LM) -> dict[str, int]:
    """Blocks 0 (before every edit) and 3 (after them) computed, counted by their attention
    (a replayed block's own hooks run; what is inside it does not)."""
    calls = {"h.0": 0, "h.3": 0}
    for name in calls:
        block: nn.Module = module.model.transformer.get_submodule(f"{name}.attn")
        block.register_forward_pre_hook(lambda m, a, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def validate(module: LM, precision: str = "32-true", **options: Any) -> InterventionEffects:
    effects = InterventionEffects(variants(), recovered={"splice": "zero"}, forward=forward,
                                  **options)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[effects],
        precision=precision,
    )
    trainer.validate(module, DataLoader(samples(5), batch_size=2), verbose=False)
    return effects


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_steps_forward_is_the_clean_forward(precision: str):
    module = LM()
    calls = counted(module)
    effects = validate(module, precision)
    # 3 batches: block 0 ran in the step's forwards only; block 3 there and in 3 variants
    assert calls == {"h.0": 3, "h.3": 3 + 3 * 3}
    assert effects._runner is not None and effects._runner.reused
    expected = truth(5, 2, bf16=precision == "bf16-mixed")
    for name, value in expected.items():
        assert effects.last_values[name] == pytest.approx(value, rel=1e-10), name
    if precision != "32-true":
        return
    again = LM()
    calls = counted(again)
    validate(again, precision, reuse=False)
    assert calls == {"h.0": 3 + 3, "h.3": 3 + 3 + 3 * 3}  # the clean forward apart


class OtherCall(LM):
    """A step that calls the model otherwise than `forward=` (without a cache)."""

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)


def test_a_step_calling_the_model_otherwise_falls_back_to_its_own_clean_forward():
    module = OtherCall()
    calls = counted(module)
    with pytest.warns(UserWarning, match="could not be reused.*other arguments") as said:
        effects = validate(module)
    assert len([w for w in said if "could not be reused" in str(w.message)]) == 1
    # the first batch's clean forward once more (the one that found the arguments differ)
    assert calls == {"h.0": 3 + 3 + 1, "h.3": 3 + 3 + 1 + 3 * 3}
    expected = truth(5, 2)
    for name, value in expected.items():
        assert effects.last_values[name] == pytest.approx(value, rel=1e-10), name


class Viewed(pl.LightningModule):
    """A step that calls the model on another view of the batch (a plain object, compared by
    type only), or on the batch as ``forward=`` does; in float32."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.model, self.view = Net().eval(), view

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.model(Batch(batch.x * 2.0) if self.view else batch)


def run_viewed(case: str, reuse: bool) -> InterventionEffects:
    def wrapped(module: pl.LightningModule, batch: Batch) -> Any:
        if case == "autocast":  # a forward= that enters autocast itself
            with autocast():
                return module.model(batch)
        return module.model(batch)

    effects = InterventionEffects(
        {"zero": [Zero("model.head")]}, forward=wrapped, output=lambda out: out.float(),
        loss=lambda logits, batch: logits.double().pow(2).mean(-1), reuse=reuse,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[effects],
    )  # fmt: skip
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    data = DataLoader(x, batch_size=3, collate_fn=lambda rows: Batch(torch.stack(rows)))
    trainer.validate(Viewed(view=case == "view"), data, verbose=False)
    return effects


@pytest.mark.parametrize("case", ["view", "autocast"])
def test_a_step_on_another_object_or_context_is_not_reused(case: str):
    """The truth: the callback's own clean forward (``reuse=False``)."""
    with pytest.warns(UserWarning, match="could not be reused"):
        effects = run_viewed(case, reuse=True)
    assert effects._runner is not None and not effects._runner.reused
    assert effects.last_values == run_viewed(case, reuse=False).last_values


def test_a_step_on_the_same_object_in_the_same_context_is_reused():
    effects = run_viewed("same", reuse=True)
    assert effects._runner is not None and effects._runner.reused
    assert effects.last_values == run_viewed("same", reuse=False).last_values
