"""Gradients are never silently empty, through real Trainers: AttributionPatching and
IOCaptureCallback refuse what would give no gradient or a broadcast one, naming the fix;
an 8-bit capture dtype is refused, pointing to FeatureWriter's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.lightning.attribution import AttributionPatching, corrupted_fields
from tests.lightning.test_effects import LM, VOCAB, forward, samples
from tests.lightning_models import trainer

H0, WTE = "model.transformer.h.0", "model.transformer.wte"


class PairLM(LM):
    """The GPT-2 LM whose step reads only the clean fields (batches of pairs, no index)."""

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch["input_ids"], batch["attention_mask"])


def pairs(n: int, corrupted_length: int = 12) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    data = []
    for sample in samples(n):
        corrupted = torch.randint(0, VOCAB, (corrupted_length,), generator=generator)
        data.append(
            {
                "input_ids": sample["input_ids"],
                "attention_mask": sample["attention_mask"],
                "corrupted_input_ids": corrupted,
            }
        )
    return data


def one_row(batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    clean, corrupted = corrupted_fields(batch)
    return clean, {key: value[:1] for key, value in corrupted.items()}


@pytest.mark.parametrize(
    ("corrupted_length", "pair", "corrupted_shape"),
    [(10, None, r"\(2, 10\)"), (12, one_row, r"\(1, 12\)")],
)
def test_attribution_patching_refuses_a_corrupted_batch_of_another_shape(
    corrupted_length: int, pair: Any, corrupted_shape: str
) -> None:
    atp = AttributionPatching(f"outputs[{H0}]", pair=pair)
    data = DataLoader(pairs(4, corrupted_length), batch_size=2)
    expected = rf"clean.*input_ids.*\(2, 12\).*corrupted.*{corrupted_shape}"
    with pytest.raises(ValueError, match=expected):
        trainer([atp]).validate(PairLM(), data, verbose=False)


def test_the_components_reason_is_not_wrapped_as_a_failure_of_the_default_forward() -> None:
    atp = AttributionPatching(f"inputs[{WTE}]")
    with pytest.raises(ValueError, match=rf"{WTE}/inputs.*floating") as caught:
        trainer([atp]).validate(PairLM(), DataLoader(pairs(2), batch_size=2), verbose=False)
    assert "forward=" not in str(caught.value)


def test_a_loss_that_does_not_go_through_the_sites_is_refused() -> None:
    """The loss depends on a parameter only (it has a grad_fn), not on the captured value:
    the callback ran the backward itself, so advice to call it would be wrong."""
    module = LM()

    def loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return module.model.lm_head.weight.sum() * torch.ones(len(logits))

    callback = IOCaptureCallback(f"grad_outputs[{H0}]", forward=forward, loss=loss)
    with pytest.raises(ValueError, match=rf"loss does not depend on.*{H0}.*`loss=`") as caught:
        trainer([callback]).validate(module, DataLoader(samples(2), batch_size=2), verbose=False)
    assert "backward()" not in str(caught.value)


@pytest.mark.parametrize("spec", [f"grad_inputs[{WTE}]", f"grad_inputs[{WTE}|{H0}]"])
def test_the_gradient_of_token_ids_is_refused(spec: str) -> None:
    callback = IOCaptureCallback(spec, forward=forward)
    with pytest.raises(RuntimeError, match=rf"'{WTE}' has no floating input"):
        trainer([callback]).validate(LM(), DataLoader(samples(2), batch_size=2), verbose=False)


def test_an_8_bit_capture_dtype_is_refused_pointing_to_the_feature_writer() -> None:
    """Refused by the callback itself, before any run; a misspelt one is offered no 8-bit
    dtype."""
    with pytest.raises(ValueError, match=r"8-bit.*scale.*FeatureWriter\(dtype="):
        IOCaptureCallback(f"outputs[{H0}]", dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="did you mean 'float16'") as refused:
        IOCaptureCallback(f"outputs[{H0}]", dtype="flaot16")
    assert "float8" not in str(refused.value) and "scaled" not in str(refused.value)
