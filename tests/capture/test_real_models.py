"""The engine on real architectures built offline, and the reference docstring's example."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import ModelIOCatcher


def tiny_gpt2(n_layer: int = 4) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def test_gpt2_block_outputs_equal_output_hidden_states() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 12))
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec("outputs[transformer.h.*]|inputs[transformer.ln_f]", False) as buf:
        reference = model(ids, output_hidden_states=True).hidden_states
    blocks = [buf[f"transformer.h.{i}"]["outputs"][0] for i in range(4)]
    for i in range(3):  # hidden_states[i + 1] is the output of block i ...
        assert torch.equal(blocks[i], reference[i + 1])
    # ... except the last, which Hugging Face reports after the final layer norm.
    assert torch.equal(buf["transformer.ln_f"]["inputs"][0]["args"][0], blocks[3])
    assert torch.allclose(model.transformer.ln_f(blocks[3]), reference[4], atol=1e-6)


def test_gpt2_early_exit_returns_none_and_keeps_values() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 12))
    reference = model(ids, output_hidden_states=True).hidden_states
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec("outputs[transformer.h.1]", early_exit=True) as buf:
        assert catcher.run(input_ids=ids) is None
    assert torch.equal(buf["transformer.h.1"]["outputs"][0], reference[2])


class Wrapper(nn.Module):
    """A model whose blocks are ``model.layers.{i}``, as in the reference docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return x


def test_reference_docstring_example_runs_as_written() -> None:
    model = Wrapper()
    loader = [{"x": torch.randn(3, 6)} for _ in range(4)]
    device = torch.device("cpu")  # the docstring says "cuda"; CI has none

    catcher = ModelIOCatcher(model, device)

    # Full forwards: capture layer 0's input+output over the loader.
    with catcher(inputs=["model.layers.0"], outputs=["model.layers.0"]) as buf:
        for batch in loader:
            catcher.run(**batch)  # or model(**batch) here
    assert len(buf["model.layers.0"]["outputs"]) == 4  # one entry per batch
    assert buf["model.layers.0"]["inputs"][0]["args"][0].shape == (3, 6)  # layer 0 input

    # Only need layer 5's output? Skip layers 6.. on *every* batch:
    with catcher.from_spec("outputs[model.layers.5]", early_exit=True) as buf:
        for batch in loader:
            assert catcher.run(**batch) is None  # returns None, cut short
    hidden = buf["model.layers.5"]["outputs"]  # one tensor per batch
    assert len(hidden) == 4 and hidden[0].shape == (3, 6)


@pytest.mark.parametrize("early_exit", [False, True])
def test_hugging_face_model_outputs_keep_their_type(early_exit: bool) -> None:
    model = tiny_gpt2(2)
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec("outputs[transformer]", early_exit=early_exit) as buf:
        catcher.run(torch.randint(0, 128, (1, 5)))
    captured = buf["transformer"]["outputs"][0]
    assert type(captured).__name__ == "BaseModelOutputWithPastAndCrossAttentions"
    assert captured.last_hidden_state.shape == (1, 5, 32)
