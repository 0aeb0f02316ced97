"""Edits in a capture session against hand-written hooks returning the edited value.

The truth of each edit is a forward hook (or pre-hook) written here with the edit's formula,
registered by hand on the same module: the model's output under the session's edit must
equal the output under that hook bit for bit (the same computation), on GPT-2 and Llama
decoder layers, a tuple output, keyword inputs, a conv net, and under bf16 autocast.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

from lightning_iocatch.capture import ModelIOCatcher, Variants
from lightning_iocatch.capture.edits import Mean, Patch, PatchWithin, Replace, Steer, Zero
from lightning_iocatch.errors import CaptureError

WIDTH = 32


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=WIDTH, n_head=4, vocab_size=64, n_positions=16)
    return GPT2Model(config).eval()


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=3, hidden_size=WIDTH, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=64)  # fmt: skip
    return LlamaModel(config).eval()


def run(model: nn.Module, x: Any) -> torch.Tensor:
    output = model(x)
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output


def replaced(output: Any, new: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A hand-written forward hook's return: the output with its first tensor replaced."""
    if isinstance(output, tuple):
        return (new(output[0]), *output[1:])
    return new(output)


def by_hand(module: nn.Module, model: nn.Module, x: Any, new: Any) -> tuple[Any, Any]:
    """The model's output with a hand-written hook replacing ``module``'s output, and the
    value that hook returned."""
    returned = []

    def hook(m: nn.Module, args: Any, output: Any) -> Any:
        returned.append(replaced(output, new))
        return returned[-1]

    handle = module.register_forward_hook(hook)
    try:
        return run(model, x), returned[0] if len(returned) == 1 else returned
    finally:
        handle.remove()


torch.manual_seed(1)
SAE = nn.Linear(WIDTH, WIDTH)  # a stand-in reconstruction: any function of the value
MEAN, VECTOR = torch.randn(WIDTH), torch.randn(WIDTH)
EDITS: list[tuple[str, Callable[[str], Any], Callable[[torch.Tensor], torch.Tensor]]] = [
    ("zero", lambda m: Zero(m), lambda h: torch.zeros_like(h)),
    ("mean", lambda m: Mean(m, MEAN), lambda h: MEAN.expand_as(h).clone()),
    ("steer", lambda m: Steer(m, VECTOR, alpha=2.5), lambda h: h + 2.5 * VECTOR),
    ("swap samples", lambda m: PatchWithin(m, [1, 0]), lambda h: h[torch.tensor([1, 0])]),
    ("replace", lambda m: Replace(m, SAE), lambda h: SAE(h)),
    ("replace keeping the error", lambda m: Replace(m, lambda h: SAE(h) * 2, baseline=SAE),
     lambda h: SAE(h) * 2 + (h - SAE(h))),
]  # fmt: skip


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("name", "make", "formula"), EDITS, ids=[e[0] for e in EDITS])
def test_an_output_edit_equals_a_hand_written_hook(
    build: Callable[[], nn.Module], name: str, make: Any, formula: Any
) -> None:
    model = build()
    module = "h.1" if isinstance(model, GPT2Model) else "layers.1"
    layer = model.get_submodule(module)
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        clean = run(model, tokens)
        truth, returned = by_hand(layer, model, tokens, formula)
        with ModelIOCatcher(model, "cpu")(outputs=[module], edits=[make(module)]) as buf:
            edited = run(model, tokens)
        after = run(model, tokens)
    assert torch.equal(edited, truth) and not torch.equal(edited, clean), name
    assert torch.equal(after, clean)  # the edit is gone with the session
    assert torch.equal(buf[module]["outputs"][0], returned)  # captures read the edited value


def test_an_input_edit_positional_or_keyword_at_chosen_tokens_equals_a_pre_hook() -> None:
    model = llama()
    layer = model.layers[2]
    tokens = torch.randint(0, 64, (2, 7))
    where = torch.zeros(2, 7, dtype=torch.bool)
    where[0, 3], where[1, 5:] = True, True  # the tokens to steer

    def pre_hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0]
        steered = torch.where(where[..., None], hidden + VECTOR, hidden)
        return (steered, *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    with torch.no_grad():
        truth = run(model, tokens)
    handle.remove()
    edit = Steer("layers.2", VECTOR, kind="inputs", positions=where)
    with torch.no_grad(), ModelIOCatcher(model, "cpu")(edits=[edit]):
        assert torch.equal(run(model, tokens), truth)

    class Inner(nn.Module):  # a decoder layer's way: the hidden states by keyword
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.linear(hidden_states)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(hidden_states=x)

    net, x = Outer(), torch.randn(3, WIDTH)

    def by_keyword(m: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        return args, {**kwargs, "hidden_states": torch.zeros_like(kwargs["hidden_states"])}

    handle = net.inner.register_forward_pre_hook(by_keyword, with_kwargs=True)
    with torch.no_grad():
        truth = net(x)
    handle.remove()
    for argument in (None, "hidden_states"):  # the first tensor keyword, or named
        edit = Zero("inner", kind="inputs", argument=argument)
        with torch.no_grad(), ModelIOCatcher(net, "cpu")(edits=[edit]):
            assert torch.equal(net(x), truth)


def test_a_tuple_output_a_chosen_call_and_a_conv_net_under_bf16() -> None:
    model = gpt2()
    tokens = torch.randint(0, 64, (2, 7))
    attention = model.h[0].attn  # returns (output, weights)
    with torch.no_grad():
        truth, _ = by_hand(attention, model, tokens, lambda h: h * 0)
        with ModelIOCatcher(model, "cpu")(edits=[Zero("h.0.attn", argument=0)]):
            assert torch.equal(run(model, tokens), truth)
    shared = nn.Linear(4, 4)
    twice = nn.Sequential(shared, nn.ReLU(), shared)  # one module, two calls a forward
    x = torch.randn(3, 4)
    calls = []

    def second_call(m: nn.Module, a: Any, out: torch.Tensor) -> Any:
        calls.append(out)
        return out + 1.0 if len(calls) % 2 == 0 else None

    handle = shared.register_forward_hook(second_call)
    with torch.no_grad():
        truth = twice(x)
    handle.remove()
    edit = Steer("0", torch.ones(4), call=1)
    with torch.no_grad(), ModelIOCatcher(twice, "cpu")(edits=[edit]):
        assert torch.equal(twice(x), truth) and torch.equal(twice(x), truth)  # each forward
    torch.manual_seed(2)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    images = torch.randn(2, 3, 9, 9)
    channels = torch.zeros(2, 8, dtype=torch.bool)
    channels[:, :3] = True  # ablate channels 0..2 of each image
    patch = torch.randn(2, 8, 7, 7)
    for edit, formula in (
        (Zero("0", positions=channels), lambda h: torch.where(channels[..., None, None], 0.0, h)),
        (Patch("0", patch), lambda h: patch.to(h.dtype)),
    ):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            truth, _ = by_hand(conv[0], conv, images, formula)
            with ModelIOCatcher(conv, "cpu")(edits=[edit]):
                edited = conv(images)
        assert edited.dtype == torch.bfloat16 and torch.equal(edited, truth)


def test_edits_are_removed_on_exceptions_and_bad_edits_are_named() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    clean = net(x)
    with pytest.raises(RuntimeError, match="boom"), ModelIOCatcher(net, "cpu")(edits=[Zero("0")]):
        net(x)
        raise RuntimeError("boom")
    assert torch.equal(net(x), clean) and not net[0]._forward_hooks
    catcher = ModelIOCatcher(net, "cpu")
    with pytest.raises(ValueError, match="give one module's exact name"):
        catcher(edits=[Zero("*")])
    with pytest.raises(TypeError, match="takes Edit objects"):
        catcher(edits=["0"])  # type: ignore[list-item]
    for edit, match in (
        (PatchWithin("0", [0, 1]), "`pairing` has 2 entries for a batch of 3"),
        (Patch("0", torch.zeros(2, 4)), r"a patch of shape \(2, 4\) for '0'"),
        (Zero("0", positions=torch.ones(2, dtype=torch.bool)), "do not fit '0'"),
        (Zero("0", kind="inputs", argument="hidden"), "no argument 'hidden' to edit"),
    ):
        with pytest.raises(ValueError, match=match), catcher(edits=[edit]):
            net(x)
    assert torch.equal(net(x), clean)


# What a cold review found: each test failed before its fix


def test_checkpointing_recomputes_with_the_edits_so_gradients_are_the_edited_forwards() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    head = nn.Linear(4, 1)
    x = torch.randn(5, 4)

    def loss() -> torch.Tensor:
        return head(checkpoint(block, x, use_reentrant=False)).pow(2).sum()

    def gradients() -> list[torch.Tensor]:
        block.zero_grad()
        loss().backward()
        return [p.grad.clone() for p in block.parameters()]  # type: ignore[union-attr]

    handle = block[0].register_forward_hook(lambda m, a, out: out + VECTOR[:4])
    truth = gradients()  # the hand-written hook runs in the recompute too
    handle.remove()
    with ModelIOCatcher(block, "cpu")(edits=[Steer("0", VECTOR[:4])]):
        edited = gradients()
    assert all(torch.equal(a, b) for a, b in zip(edited, truth, strict=True))
    timed = ModelIOCatcher(block, "cpu")(edits=[Steer("0", VECTOR[:4], call=0)])
    with pytest.raises(CaptureError, match="recomputed by activation checkpointing"), timed:
        gradients()


def test_a_patch_never_hands_the_model_the_users_tensor() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    source = -torch.ones(3, 4)
    with torch.no_grad(), ModelIOCatcher(net, "cpu")(edits=[Patch("0", source)]):
        first, second = net(torch.randn(3, 4)), net(torch.randn(3, 4))
    assert bool((source == -1).all()) and torch.equal(first, second)  # the ReLU was in place


def test_every_capture_reads_the_edited_value_whichever_session_opened_first() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = net[0](x) + 1.0
    for capture_first in (True, False):
        reader, editor = ModelIOCatcher(net, "cpu"), ModelIOCatcher(net, "cpu")
        sessions = [reader(outputs=["0"]), editor(edits=[Steer("0", torch.ones(4))])]
        for session in sessions if capture_first else sessions[::-1]:
            session.open()
        with torch.no_grad():
            net(x)
        for session in sessions:
            session.close()
        assert torch.allclose(sessions[0].buffer["0"]["outputs"][0], expected), capture_first


def test_steering_rounds_once_under_bf16_and_replace_keeps_shape_and_dtype() -> None:
    model = gpt2()
    tokens = torch.randint(0, 64, (2, 7))
    alpha = 0.3

    def once(h: torch.Tensor) -> torch.Tensor:  # the documented rounding, written by hand
        return (h.float() + alpha * VECTOR.float()).to(h.dtype)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        truth, _ = by_hand(model.h[1], model, tokens, once)
        with ModelIOCatcher(model, "cpu")(edits=[Steer("h.1", VECTOR, alpha=alpha)]):
            edited = run(model, tokens)
    assert torch.equal(edited, truth)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    narrower = ModelIOCatcher(net, "cpu")(edits=[Replace("0", lambda h: h[:, :2])])
    with pytest.raises(ValueError, match=r"Replace's function gave \(3, 2\)"), narrower:
        net(torch.randn(3, 4))
    with ModelIOCatcher(net, "cpu")(edits=[Replace("0", lambda h: h.double())]):
        assert net(torch.randn(3, 4)).dtype == torch.float32  # cast back to the value's dtype


def test_unapplied_edits_warn_and_modules_are_described_by_their_weights() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    never = ModelIOCatcher(net, "cpu")(edits=[Zero("0", call=1)])  # one call a forward
    with pytest.warns(UserWarning, match="were never applied in its 1 forward"), never:
        net(torch.randn(3, 4))
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    one, other = Replace("0", first).describe(), Replace("0", second).describe()
    assert (
        one["function"]["function"]
        == other["function"]["function"]
        == "torch.nn.modules.linear.Linear"
    )
    assert one["function"]["blake2b"] != other["function"]["blake2b"]
    second.load_state_dict(first.state_dict())  # the same weights: the same description
    assert Replace("0", second).describe() == one
    method = Replace("0", first.forward).describe()["function"]  # a module's method: its weights
    assert method["function"].endswith("Linear.forward")
    assert method == Replace("0", second.forward).describe()["function"]
    with torch.no_grad():
        second.bias.add_(1.0)
    assert method != Replace("0", second.forward).describe()["function"]


@pytest.mark.parametrize(
    ("edit", "given"),
    [
        (Steer("1", torch.ones(5)), "vector"),
        (Mean("1", torch.ones(5)), "mean"),
        (Steer("1", torch.ones(3, 1, 4)), "vector"),  # broadcasts, but to a larger value
        (Mean("1", torch.ones(2, 4)), "mean"),
    ],
)
def test_a_mean_or_vector_of_the_wrong_shape_names_the_edit_and_both_shapes(
    edit: Any, given: str
) -> None:
    """Before: a raw broadcasting RuntimeError ("The size of tensor a (4) must match the
    size of tensor b (5)"), or for [3, 1, 4] a silently larger [3, 3, 4] output."""
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)).eval()
    shape = tuple(edit.__dict__[given].shape)
    expected = (
        rf"{type(edit).__name__}\('1', kind='outputs', call=None\): its `{given}` of shape "
        rf"{re.escape(str(shape))} does not fit '1''s outputs of shape \(3, 4\): give a "
        rf"`{given}` of shape \(4,\)"
    )
    with pytest.raises(ValueError, match=expected), ModelIOCatcher(net, "cpu")(edits=[edit]):
        net(torch.randn(3, 2))
    variants = Variants(ModelIOCatcher(net, "cpu"), {"fine": [Zero("1")], "wrong": [edit]})
    with pytest.raises(ValueError, match=expected) as raised:
        variants(lambda: net(torch.randn(3, 2)))
    assert raised.value.__notes__ == ["in variant 'wrong' of Variants(fine, wrong)"]
