"""What a recording keeps, and what replaying costs, against the truth of hand-written
hooks: hooks only where a call may be replayed alone, no copy of an output no variant
replays, the last variant given the private copies themselves, and the arguments compared
with ``torch.equal``'s meaning (through NumPy on the CPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher, Steer, Zero
from lightning_iocatch.capture.replay import _equal
from lightning_iocatch.capture.variants import Variants
from tests.capture.test_variants import batch, by_hand, gpt2
from tests.capture.test_variants_inference import Aliasing


def test_only_the_calls_that_may_be_replayed_alone_are_hooked_and_variants_equal_the_truth():
    model, _ = gpt2()
    inputs = batch()
    hooked: list[set[str]] = []

    def forward() -> torch.Tensor:
        hooked.append({n for n, m in model.named_modules() if m._forward_pre_hooks})
        return model(**inputs, use_cache=False).logits

    runner = Variants(
        ModelIOCatcher(model, "cpu"), {"zero": [Zero("transformer.h.2", kind="inputs")]}
    )
    with torch.inference_mode():
        outputs = runner(forward)
    blocks = {f"transformer.h.{k}" for k in range(4)}
    inside = {f"transformer.h.2.{part}" for part in ("ln_1", "attn", "ln_2", "mlp")}
    tops = {"transformer", "lm_head", "transformer.wte", "transformer.wpe", "transformer.drop"}
    assert hooked[0] == tops | {"transformer.h", "transformer.ln_f"} | blocks | inside
    zero = [(dict(model.named_modules())["transformer.h.2"], "inputs", torch.zeros_like)]
    for name, hooks in {"clean": [], "zero": zero}.items():
        expected = by_hand(model, hooks, lambda: model(**inputs, use_cache=False).logits)
        assert torch.equal(outputs[name], expected), name
    assert runner.fallbacks == []


class Returning(nn.Module):
    """Returns the output of ``a`` (replayed in every variant) beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.head(torch.tanh(self.b(h))), h


def test_the_last_variant_gets_the_private_copies_and_no_output_shares_another_ones():
    net, x = Returning().eval(), torch.randn(3, 4)
    variants = {
        "steer": [Steer("head", torch.ones(4), kind="inputs")],
        "zero": [Zero("b")],
        "last": [Steer("b", torch.ones(4), kind="inputs")],
    }
    runner = Variants(ModelIOCatcher(net, "cpu"), variants)
    with torch.inference_mode():
        outputs = runner(lambda: net(x))
        a_out = [outputs[name][1] for name in outputs]
        places = {t.untyped_storage().data_ptr() for t in a_out}
        assert len(places) == 4  # the clean one, two fresh copies, the private copy
        outputs["last"][1].mul_(0.0)  # a user writing into one output changes no other
        kept = [outputs[name][1] for name in ("clean", "steer", "zero")]
    truth = by_hand(net, [], lambda: net(x))[1]
    assert all(torch.equal(t, truth) for t in kept)
    assert runner.fallbacks == []


def test_three_variants_of_a_forward_writing_into_a_replayed_output_equal_the_truth():
    net, x = Aliasing().eval(), torch.randn(3, 4)
    variants = {
        "steer": [Steer("head", torch.ones(4), kind="inputs")],
        "zero": [Zero("b")],
        "steer_b": [Steer("b", torch.ones(4), kind="inputs")],
    }
    runner = Variants(ModelIOCatcher(net, "cpu"), variants)
    with torch.inference_mode():
        outputs = runner(lambda: net(x.clone()))
    hooks: dict[str, list[Any]] = {
        "clean": [],
        "steer": [(net.head, "inputs", lambda h: h + 1.0)],
        "zero": [(net.b, "outputs", torch.zeros_like)],
        "steer_b": [(net.b, "inputs", lambda h: h + 1.0)],
    }
    for name, edits in hooks.items():
        assert torch.equal(outputs[name], by_hand(net, edits, lambda: net(x.clone()))), name
    assert runner.fallbacks == []
    assert net.computed == 1 + 4  # a computed once, then in the 4 forwards of the truth


class Wrapper(nn.Module):
    """The outermost call returns its input beside the logits: it is never replayed whole,
    so a clean forward reused from a recording replays what it holds, and runs the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.model, _ = gpt2()

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids=ids, use_cache=False).logits, ids


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wrapper = Wrapper().eval()

    def forward(self, ids: torch.Tensor) -> Any:
        return self.wrapper(ids)


def test_a_reused_clean_forward_whose_outermost_call_cannot_be_replayed_equals_the_truth():
    root, ids = Root().eval(), batch()["input_ids"]
    edits = {"zero": [Zero("wrapper.model.transformer.h.1")]}
    runner = Variants(ModelIOCatcher(root, None), edits)
    with torch.inference_mode():
        recorded = runner.record()
        root(ids)  # the step's own forward
        outputs = runner(lambda: root(ids), None, recorded)
        truth = root(ids)
    assert runner.reused  # the calls before the edit point were replayed
    assert torch.equal(outputs["clean"][0], truth[0])
    block = root.wrapper.model.transformer.h[1]
    zero = by_hand(root, [(block, "outputs", torch.zeros_like)], lambda: root(ids))
    assert torch.equal(outputs["zero"][0], zero[0])


def cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, generator=g)
    nan = x.clone()
    nan[1, 2] = float("nan")
    found = [(x, x.clone()), (x, x + 1e-7), (x.t(), x.t().contiguous()), (nan, nan.clone())]
    found += [(torch.zeros(3), -torch.zeros(3)), (torch.empty(0, 2), torch.empty(0, 2))]
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        found.append((x.to(dtype), x.to(dtype).clone()))
        found.append((x.to(dtype), (x * 3).to(dtype)))
    c = torch.randn(3, dtype=torch.complex64, generator=g)
    found += [(c.conj(), c.conj().clone()), (c.conj(), c)]
    found.append((x.clone().requires_grad_(), x))
    return found


@pytest.mark.parametrize("pair", cases())
def test_arguments_compare_as_torch_equal_compares_them(pair: tuple[torch.Tensor, torch.Tensor]):
    a, b = pair
    with torch.inference_mode():
        assert _equal(a, b) == torch.equal(a, b)
        assert _equal(a.clone(), b.clone()) == torch.equal(a, b)  # inference tensors


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model, _ = gpt2()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def test_a_reused_clean_output_replayed_once_is_the_callers_own():
    root, ids = Plain().eval(), batch()["input_ids"]
    runner = Variants(ModelIOCatcher(root, None), {"zero": [Zero("model.transformer.h.1")]})
    with torch.inference_mode():
        recorded = runner.record()
        step = root(ids)  # the step's own forward, which then writes into its output
        step.mul_(0.0)
        outputs = runner(lambda: root(ids), None, recorded)
        truth = root(ids)
        assert runner.reused and torch.equal(outputs["clean"], truth)
        zero = outputs["zero"].clone()
        outputs["clean"].add_(1.0)  # the caller's own: no other output changes
        assert torch.equal(outputs["zero"], zero) and not torch.equal(zero, truth)
