"""Gradients and captures that would come out silently wrong are refused, naming the fix:
attribution patching of two runs of other shapes, the gradient of an input that is token
ids, and 8-bit capture dtypes (a cast without a scale)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_iocatch import checks
from lightning_iocatch.capture import ModelIOCatcher, recording_gradients
from lightning_iocatch.capture.attribution import attribution_patching
from lightning_iocatch.errors import CaptureError

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _last_logit(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    return lambda batch: model(**batch).logits[:, -1, 3]


@pytest.mark.parametrize(
    "corrupted_shape",
    [(1, 12), (4, 10)],  # one row: was broadcast silently; other length: torch's error
)
def test_attribution_patching_refuses_runs_of_other_shapes(
    corrupted_shape: tuple[int, int],
) -> None:
    model = _gpt2()
    clean = {"input_ids": torch.randint(0, 50, (4, 12))}
    corrupted = {"input_ids": torch.randint(0, 50, corrupted_shape)}
    expected = rf"clean.*\(4, 12\).*corrupted.*{re.escape(str(corrupted_shape))}"
    with pytest.raises(ValueError, match=expected):
        attribution_patching(
            model, "outputs[transformer.h.0]", _last_logit(model), clean, corrupted
        )


def test_attribution_patching_refuses_components_of_other_shapes() -> None:
    """Batches of one shape whose run makes values of other shapes (a run that crops)."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    clean, corrupted = torch.randn(4, 3), torch.randn(4, 3)

    def run(batch: torch.Tensor) -> torch.Tensor:
        out = net(batch if batch is clean else batch[:1])[:, 0]
        return out.expand(4) if len(out) == 1 else out

    with pytest.raises(ValueError, match=r"0/outputs.*clean.*\(4, 4\).*corrupted.*\(1, 4\)"):
        attribution_patching(net, "outputs[0]", run, clean, corrupted)


def test_the_gradient_of_token_ids_is_refused_naming_the_module() -> None:
    """An embedding's input is token ids: no gradient. Alone it captured [] (with advice to
    call backward, which was called); beside another site, (None,)."""
    model = _gpt2()
    ids = torch.randint(0, 50, (2, 6))
    catcher = ModelIOCatcher(model, "cpu")
    for spec in ("grad_inputs[transformer.wte]", "grad_inputs[transformer.wte|transformer.h.0]"):
        refused = pytest.raises(
            CaptureError, match=r"'transformer.wte' has no floating input.*grad_outputs"
        )
        with catcher.from_spec(spec), recording_gradients(), refused:
            model(input_ids=ids)
    # a floating input beside integer ones is fine: only the floating one has a gradient
    with catcher.from_spec("grad_inputs[transformer.h.0]") as buf, recording_gradients():
        loss = model(input_ids=ids).logits.sum()
        torch.autograd.grad(loss, catcher.session.gradient_edges())
    assert buf["transformer.h.0"]["grad_inputs"][0]["args"][0].shape == (2, 6, 32)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", torch.float8_e5m2])
def test_an_8_bit_capture_dtype_is_refused_pointing_to_the_feature_writer(
    dtype: str | torch.dtype,
) -> None:
    with pytest.raises(ValueError, match=r"`dtype` float8_e.*FeatureWriter\(dtype="):
        ModelIOCatcher(nn.Linear(2, 2), "cpu", dtype=dtype)
    assert checks.parse_dtype("dtype", dtype).itemsize == 1  # the store's dtypes keep them


@pytest.mark.parametrize("misspelt", ["fp8", "float8", "flaot16", "e4m3"])
def test_a_misspelt_capture_dtype_suggests_no_8_bit_dtype(misspelt: str) -> None:
    with pytest.raises(ValueError, match="`dtype`") as caught:
        checks.parse_capture_dtype("dtype", misspelt)
    assert not re.search("float8_e|8-bit|scaled", str(caught.value))
    assert "'float32', 'float16', 'bfloat16'" in str(caught.value)
    with pytest.raises(ValueError, match="did you mean 'float16'"):
        checks.parse_capture_dtype("dtype", "flaot16")
    with pytest.raises(ValueError, match="did you mean 'float8_e4m3fn'"):  # the store's
        checks.parse_dtype("dtype", "fp8")
