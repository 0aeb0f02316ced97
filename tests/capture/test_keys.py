"""keys.py: the flat key of every captured tensor."""

from __future__ import annotations

import dataclasses

import torch
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import ModelIOCatcher
from lightning_iocatch.capture.keys import flatten_captures


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor | None


def test_keys_follow_the_captured_structure() -> None:
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, bos_token_id=0, eos_token_id=0
    )
    model = GPT2Model(config).eval()
    ids = torch.randint(0, 32, (3, 5))
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec("inputs[h.0]|outputs[h.1|]", early_exit=False) as buf:
        model(ids, attention_mask=torch.ones(3, 5, dtype=torch.long))
    catcher_outputs = ModelIOCatcher(model, "cpu")
    with catcher_outputs(outputs=[""]) as whole:
        model(ids)
    flat = flatten_captures(buf)
    assert all(
        key.startswith(("h.0/inputs/args/", "h.0/inputs/kwargs/", "h.1/outputs")) for key in flat
    )
    with torch.no_grad():  # the truth: Hugging Face's own hidden states of the same forward
        hidden = model(ids, output_hidden_states=True).hidden_states
        assert torch.equal(flat["h.0/inputs/args/0"], hidden[0])  # the embeddings
        block_1 = flat["h.1/outputs/0" if "h.1/outputs/0" in flat else "h.1/outputs"]
        assert torch.equal(model.ln_f(block_1), hidden[2])  # HF applies ln_f to the last
    assert torch.equal(flatten_captures(whole)["/outputs/last_hidden_state"], hidden[2])


def test_dataclasses_none_and_repeated_calls() -> None:
    from lightning_iocatch import CaptureBuffer

    buf = CaptureBuffer.empty(["block"])
    buf["block"]["outputs"] += [Pair(torch.zeros(1), None), [torch.ones(1), "text", 3]]
    buf["block"]["inputs"].append({"args": (), "kwargs": {"mask": torch.ones(1), "flag": True}})
    assert list(flatten_captures(buf)) == [
        "block/inputs/kwargs/mask",
        "block/outputs/left",
        "block/outputs@1/0",
    ]


def test_values_that_flatten_to_one_key_are_refused_never_overwritten() -> None:
    import pytest

    from lightning_iocatch.capture.keys import flatten_captures
    from lightning_iocatch.errors import CaptureError

    x = torch.zeros(1)
    for captures in (
        {"m": {"inputs": [], "outputs": [{"a/b": x, "a": {"b": x}}]}},
        {"m": {"inputs": [], "outputs": [{0: x, "0": x}]}},
        {
            "m/outputs": {"inputs": [], "outputs": [x]},
            "m": {"inputs": [], "outputs": [{"outputs": x}]},
        },
    ):
        with pytest.raises(CaptureError, match="flatten to the same key path"):
            flatten_captures(captures)
