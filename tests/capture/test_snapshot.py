"""Captures are snapshots: no live object of the running model is ever kept by reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import LlamaForCausalLM

from lightning_iocatch import IOCaptureCallback, ModelIOCatcher, NotCaptured
from lightning_iocatch.capture.snapshots import snapshot
from tests.lightning_models import tiny_llama, trainer

IMMUTABLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def llama() -> Any:
    return tiny_llama(num_hidden_layers=3, pad_token_id=0)


def leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def hand_written_inputs(layer: torch.nn.Module) -> list[dict[str, Any]]:
    """A plain pre-hook cloning the layer's tensor inputs at call time: the ground truth."""
    seen: list[dict[str, Any]] = []

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(
            {
                "hidden": args[0].detach().clone(),
                "position_ids": kwargs["position_ids"].clone(),
                "rotary": [t.clone() for t in kwargs["position_embeddings"]],
                "live": [v for v in kwargs.values() if type(v).__name__.endswith("Cache")],
            }
        )

    layer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def generate(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
    )


def check_snapshot(entry: dict[str, Any], expected: dict[str, Any]) -> None:
    assert torch.equal(entry["args"][0], expected["hidden"])
    assert torch.equal(entry["kwargs"]["position_ids"], expected["position_ids"])
    for got, want in zip(entry["kwargs"]["position_embeddings"], expected["rotary"], strict=True):
        assert torch.equal(got, want)
    placeholders = [v for v in entry["kwargs"].values() if isinstance(v, NotCaptured)]
    assert [p.type_name for p in placeholders] == ["transformers.cache_utils.DynamicCache"]
    # the cache object grew after the capture; nothing captured refers to it
    assert all(v is not expected["live"][0] for v in leaves(entry))
    kept = (torch.Tensor, NotCaptured, *IMMUTABLE)
    assert all(isinstance(v, kept) for v in leaves(entry)), "a live object was kept"


def test_a_decoder_layer_under_generate_keeps_copies_and_a_placeholder_for_the_cache() -> None:
    model = llama()
    truth = hand_written_inputs(model.model.layers[1])
    ids = torch.randint(1, 64, (2, 5))
    with ModelIOCatcher(model, "cpu").from_spec("inputs[model.layers.1]") as buf:
        generate(model, ids)
    entries = buf["model.layers.1"]["inputs"]
    assert len(entries) == len(truth) == 4  # prompt, then one call per new token
    for entry, expected in zip(entries, truth, strict=True):
        check_snapshot(entry, expected)


class Generator(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return generate(self.model, batch[0])


def test_the_callback_snapshots_a_decoder_layer_in_a_predict_step_that_generates() -> None:
    module = Generator()
    truth = hand_written_inputs(module.model.model.layers[1])
    ids = torch.randint(1, 64, (4, 5))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    callback = IOCaptureCallback("inputs[model.model.layers.1]", stages=["predict"])
    sequences = trainer([callback]).predict(module, loader)
    assert [s.shape for s in sequences] == [(2, 9), (2, 9)]  # real generate() results
    entries = callback.captures["predict"][0]["model.model.layers.1"]["inputs"]
    assert len(entries) == len(truth) == 8
    for entry, expected in zip(entries, truth, strict=True):
        check_snapshot(entry, expected)


@dataclasses.dataclass
class Holder:
    tensor: torch.Tensor
    handle: Any


def test_unknown_objects_become_placeholders_inside_any_container() -> None:
    class Live:
        pass

    x = torch.ones(2)
    got = snapshot({"a": [Holder(x, Live())], "b": (3, None, "s", torch.float16), "f": print})
    assert torch.equal(got["a"][0].tensor, x) and got["a"][0].tensor is not x
    assert got["a"][0].handle == NotCaptured(
        f"{__name__}.test_unknown_objects_become_placeholders_inside_any_container.<locals>.Live"
    )
    assert got["b"] == (3, None, "s", torch.float16)
    assert isinstance(got["f"], NotCaptured)
