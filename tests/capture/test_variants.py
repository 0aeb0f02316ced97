"""Variants against the truth: each variant's output equals the model's output under
hand-written hooks returning the edited value (a whole forward per variant), bit for bit,
on GPT-2 and Llama causal LMs with padded attention masks (keyword inputs, cache objects),
a conv net and bf16 autocast; and the calls before the edit point are not computed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_iocatch.capture import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit, PatchWithin, Replace, Steer, Zero
from lightning_iocatch.capture.variants import Variants
from tests.lightning_models import SAE

WIDTH = 32


def gpt2() -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=WIDTH, n_head=4, vocab_size=64, n_positions=16)
    return GPT2LMHeadModel(config).eval(), "transformer.h"


def llama() -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, hidden_size=WIDTH, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=64)  # fmt: skip
    return LlamaForCausalLM(config).eval(), "model.layers"


def batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0  # padded on the right
    return {"input_ids": ids, "attention_mask": mask}


def first(value: Any, new: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return (new(value[0]), *value[1:]) if isinstance(value, tuple) else new(value)


def by_hand(model: nn.Module, hooks: list[tuple[nn.Module, str, Callable]], run: Callable) -> Any:
    """``run()`` with hand-written hooks returning the edited value (the truth)."""
    handles = []
    for module, kind, new in hooks:
        if kind == "outputs":
            handles.append(module.register_forward_hook(lambda m, a, out, n=new: first(out, n)))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=new: first(a, n)))
    try:
        with torch.no_grad():
            return run()
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("build", [gpt2, llama])
@pytest.mark.parametrize("share", [True, False])
def test_each_variant_equals_hand_written_hooks_on_causal_lms(build: Callable, share: bool):
    model, blocks = build()
    inputs = batch()
    sae = SAE(WIDTH)
    vector = torch.randn(WIDTH)
    block = dict(model.named_modules())
    variants: dict[str, list[Edit]] = {
        "splice": [Replace(f"{blocks}.2", sae)],
        "zero": [Zero(f"{blocks}.2")],
        "steer": [Steer(f"{blocks}.1", vector, alpha=3.0, kind="inputs")],
        "pair": [PatchWithin(f"{blocks}.0", [2, 0, 1]), Zero(f"{blocks}.3")],
    }
    truth = {
        "clean": [],
        "splice": [(block[f"{blocks}.2"], "outputs", sae)],
        "zero": [(block[f"{blocks}.2"], "outputs", torch.zeros_like)],
        "steer": [(block[f"{blocks}.1"], "inputs", lambda h: h + 3.0 * vector)],
        "pair": [
            (block[f"{blocks}.0"], "outputs", lambda h: h[torch.tensor([2, 0, 1])]),
            (block[f"{blocks}.3"], "outputs", torch.zeros_like),
        ],
    }
    with torch.no_grad():
        runner = Variants(ModelIOCatcher(model, "cpu"), variants, share=share)
        outputs = runner(lambda: model(**inputs).logits)
    assert list(outputs) == ["clean", *variants]
    for name, hooks in truth.items():
        expected = by_hand(model, hooks, lambda: model(**inputs).logits)
        assert torch.equal(outputs[name], expected), name
    assert not torch.equal(outputs["zero"], outputs["clean"])
    assert runner.fallbacks == []
    if share:  # the layers before the edit point were given a cache they do not write
        assert "DynamicCache" in runner.notes[0]


def test_calls_before_the_edit_point_are_computed_once():
    model, _ = gpt2()
    inputs = batch()
    computed: dict[str, int] = {}
    for name in ("transformer.h.0.attn", "transformer.h.1.mlp",
                 "transformer.h.2.attn", "transformer.h.3.mlp", "lm_head"):  # fmt: skip
        module = dict(model.named_modules())[name]
        module.register_forward_pre_hook(
            lambda m, a, n=name: computed.__setitem__(n, computed.get(n, 0) + 1)
        )
    variants = {"a": [Zero("transformer.h.1")], "b": [Steer("transformer.h.1", torch.ones(WIDTH))]}
    with torch.inference_mode():  # as in Lightning's validation loop
        outputs = Variants(ModelIOCatcher(model, "cpu"), variants)(lambda: model(**inputs).logits)
    # a replayed call (of h.0, h.1: their hooks still run) runs none of its submodules;
    # after the edit point, every variant runs
    assert computed == {"transformer.h.0.attn": 1, "transformer.h.1.mlp": 1, "lm_head": 3,
                        "transformer.h.2.attn": 3, "transformer.h.3.mlp": 3}  # fmt: skip
    assert torch.equal(outputs["a"], by_hand(
        model, [(model.transformer.h[1], "outputs", torch.zeros_like)],
        lambda: model(**inputs).logits))  # fmt: skip


class Counted(nn.Module):
    """A conv net whose forward hands its first block a side input that changes each
    forward (state carried between forwards), and modifies a block's output in place."""

    def __init__(self, in_place: bool = False, counter: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.LazyLinear(5))
        self.in_place, self.counter, self.forwards = in_place, counter, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        h = self.stem(x + (self.forwards if self.counter else 0))
        if self.in_place:
            h += 1.0  # the stem's output, changed after it returned
        return self.head(torch.relu(self.block(h)))


@pytest.mark.parametrize("case", ["plain", "counter", "in_place", "bf16"])
def test_a_conv_net_and_what_cannot_be_replayed_runs_for_real(case: str):
    model = Counted(in_place=case == "in_place", counter=case == "counter")
    x = torch.randn(4, 3, 6, 6)
    model(x)  # materialise the lazy layer
    model.eval()
    variants = {"zero": [Zero("block")], "half": [Replace("block", lambda h: h / 2)]}
    hooks = {"zero": torch.zeros_like, "half": lambda h: h / 2}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16")
    runner = Variants(ModelIOCatcher(model, "cpu"), variants)
    with autocast, pytest.warns(UserWarning) if case in ("counter", "in_place") else _nothing():
        start = model.forwards
        outputs = runner(lambda: model(x))
    expected = {}
    with autocast:
        model.forwards = start  # the truth sees the same counter values
        expected["clean"] = by_hand(model, [], lambda: model(x))
        for name, new in hooks.items():
            expected[name] = by_hand(model, [(model.block, "outputs", new)], lambda: model(x))
    for name in expected:
        assert torch.equal(outputs[name], expected[name]), name
    assert outputs["clean"].dtype == (torch.bfloat16 if case == "bf16" else torch.float32)
    assert bool(runner.fallbacks) == (case in ("counter", "in_place"))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_training_mode_runs_every_variant_whole_and_says_so():
    model, blocks = gpt2()
    model.train()
    model.config.resid_pdrop = 0.0
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # deterministic, so the whole forwards can be compared
    inputs = batch()
    runner = Variants(ModelIOCatcher(model, "cpu"), {"zero": [Zero(f"{blocks}.1")]})
    with pytest.warns(UserWarning, match="training mode"):
        outputs = runner(lambda: model(**inputs).logits)
    expected = by_hand(model, [(model.transformer.h[1], "outputs", torch.zeros_like)],
                       lambda: model(**inputs).logits)  # fmt: skip
    assert torch.equal(outputs["zero"], expected)
    assert "training mode" in runner.fallbacks[0]


def test_bad_variants_are_named():
    model, blocks = gpt2()
    catcher = ModelIOCatcher(model, "cpu")
    with pytest.raises(ValueError, match="reserved|unedited"):
        Variants(catcher, {"clean": [Zero(f"{blocks}.1")]})
    with pytest.raises(ValueError, match="empty"):
        Variants(catcher, {})
    with pytest.raises(KeyError):
        Variants(catcher, {"x": [Zero("transformer.nope")]})
    with pytest.raises(ValueError, match="have edits"):
        Variants(catcher, {"x": []})


def test_other_open_sessions_neither_capture_nor_edit_the_variants_forwards():
    model, blocks = gpt2()
    inputs = batch()
    other = ModelIOCatcher(model, "cpu")
    with other(outputs=[f"{blocks}.3"], edits=[Zero(f"{blocks}.0")]) as captured:
        edited = model(**inputs).logits  # the other session's own forward: edited, captured
        outputs = Variants(ModelIOCatcher(model, "cpu"), {"zero": [Zero(f"{blocks}.2")]})(
            lambda: model(**inputs).logits
        )
    assert len(captured[f"{blocks}.3"]["outputs"]) == 1
    assert torch.equal(outputs["clean"], by_hand(model, [], lambda: model(**inputs).logits))
    assert not torch.equal(outputs["clean"], edited)


class Rows:
    """A stand-in for a FeatureStore: sample ``i``'s row is ``i`` everywhere."""

    path = "rows"

    def rows_at(self, key: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows = torch.tensor(indices, dtype=torch.float32)[:, None, None].expand(-1, 10, WIDTH)
        return rows, torch.arange(len(indices)), None


def test_edits_that_need_the_batch_indices_get_them():
    from lightning_iocatch.capture.store_patch import StorePatch

    model, blocks = gpt2()
    inputs = batch()
    patch = StorePatch(f"{blocks}.1", Rows(), "h/outputs")
    runner = Variants(ModelIOCatcher(model, "cpu"), {"patched": [patch]})
    outputs = runner(lambda: model(**inputs).logits, indices=[5, 0, 2])
    rows = torch.tensor([5.0, 0.0, 2.0])[:, None, None].expand(-1, 10, WIDTH)
    hooks = [(model.transformer.h[1], "outputs", lambda h: rows.clone())]
    assert torch.equal(outputs["patched"], by_hand(model, hooks, lambda: model(**inputs).logits))
    with pytest.raises(Exception, match="dataset indices are unknown"):
        runner(lambda: model(**inputs).logits)


class Group(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + 0.0


class Shared(nn.Module):
    """ALBERT-style: one layer, called through a group at every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.group = Group(self.shared)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.tanh(self.group(x))
        return self.head(x)


@pytest.mark.parametrize("call", [1, 2, 3])
def test_an_edit_of_one_call_of_a_module_inside_earlier_calls_edits_that_call(call: int):
    net, x = Shared().eval(), torch.randn(3, 4)
    variants = {"v": [Steer("shared", torch.ones(4), alpha=5.0, call=call)]}
    outputs = Variants(ModelIOCatcher(net, "cpu"), variants)(lambda: net(x))
    calls = [0]

    def hook(m: nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor | None:
        calls[0] += 1
        return out + 5.0 if calls[0] - 1 == call else None

    assert torch.equal(outputs["v"], by_hand(net, [], lambda: _with(net.shared, hook, net, x)))


def _with(module: nn.Module, hook: Callable, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    handle = module.register_forward_hook(hook)
    try:
        return net(x)
    finally:
        handle.remove()


def test_a_user_hook_runs_once_and_a_returned_list_appended_to_is_replayed_as_returned():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    net[2].register_forward_hook(lambda m, a, out: out + 1)  # a hook of the user's, kept
    x, v = torch.randn(3, 4), torch.ones(4)
    outputs = Variants(ModelIOCatcher(net, "cpu"), {"s": [Steer("2", v)]})(lambda: net(x))
    truth = by_hand(net, [(net[2], "outputs", lambda h: h + v)], lambda: net(x))
    assert torch.equal(outputs["s"], truth)

    class Listing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = _Backbone()
            self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            features = self.backbone(x)
            features.append(self.extra(features[-1]))  # appended in place
            return self.head(torch.stack(features).sum(0))

    net2 = Listing().eval()
    edits = {"s": [Steer("extra", v, kind="inputs")]}
    outputs = Variants(ModelIOCatcher(net2, "cpu"), edits)(lambda: net2(x))
    truth = by_hand(net2, [(net2.extra, "inputs", lambda h: h + v)], lambda: net2(x))
    assert torch.equal(outputs["s"], truth)


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        first = self.a(x)
        return [first, self.b(first)]


class InPlaceUnderInference(nn.Module):
    """A forward entering inference mode itself, changing a block's output in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h += self.b(h)  # a's output, changed after it returned: unseen without versions
        return self.head(h)


class Router(nn.Module):
    """A module returning torch.return_types (topk), used by name after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.score, self.head = nn.Linear(4, 6), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = _TopK()(self.score(x))
        return self.head(top.values)


class _TopK(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x.topk(2)


def test_what_replaying_cannot_see_runs_whole_and_equals_the_truth():
    x = torch.randn(3, 4)
    # an inference tensor's changes in place are not seen: such a call is never replayed
    net = InPlaceUnderInference().eval()
    outputs = Variants(ModelIOCatcher(net, "cpu"), {"z": [Zero("b")]})(lambda: net(x))
    assert torch.equal(outputs["z"], by_hand(net, [(net.b, "outputs", torch.zeros_like)],
                                             lambda: net(x)))  # fmt: skip
    # an edit function working in place on a replayed output: the batch runs again whole
    model, _ = gpt2()
    inputs = batch()
    clean = by_hand(model, [], lambda: model(**inputs).logits)
    runner = Variants(
        ModelIOCatcher(model, "cpu"), {"half": [Replace("lm_head", lambda v: v.mul_(0.5))]}
    )
    with pytest.warns(UserWarning, match="in place"):
        outputs = runner(lambda: model(**inputs).logits)
    assert torch.equal(outputs["clean"], clean) and torch.equal(outputs["half"], clean * 0.5)
    # a module replaced after the first call is the one edited
    net2 = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    runner = Variants(ModelIOCatcher(net2, "cpu"), {"z": [Zero("0")]})
    runner(lambda: net2(x))
    net2[0] = nn.Linear(4, 4).eval()
    outputs = runner(lambda: net2(x))
    assert torch.equal(outputs["z"], by_hand(net2, [(net2[0], "outputs", torch.zeros_like)],
                                             lambda: net2(x)))  # fmt: skip
    # torch.return_types keep their type when replayed
    router = Router().eval()
    outputs = Variants(
        ModelIOCatcher(router, "cpu"), {"s": [Steer("head", torch.ones(2), kind="inputs")]}
    )(lambda: router(x))
    assert torch.equal(outputs["s"], by_hand(router, [(router.head, "inputs", lambda h: h + 1)],
                                             lambda: router(x)))  # fmt: skip


def test_a_global_forward_hook_makes_every_variant_run_whole():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    x = torch.randn(3, 4)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out + 1 if isinstance(m, nn.Linear) else None
    )
    try:
        runner = Variants(ModelIOCatcher(net, "cpu"), {"z": [Zero("1")]})
        with pytest.warns(UserWarning, match="global module forward hook"):
            outputs = runner(lambda: net(x))
        truth = by_hand(net, [(net[1], "outputs", torch.zeros_like)], lambda: net(x))
    finally:
        handle.remove()
    assert torch.equal(outputs["z"], truth)


class Counting(InPlaceUnderInference):
    """The head gets a side input that changes every forward, so it runs for real."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(4, 4)  # never called
        self.forwards = 0

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        h = self.a(x)
        h += self.b(h)
        return self.head(h + self.forwards)


def test_an_edit_that_never_applies_replays_nothing_it_cannot_check():
    net = Counting().eval()
    x = torch.randn(3, 4)
    runner = Variants(ModelIOCatcher(net, "cpu"), {"z": [Zero("spare")]})
    with pytest.warns(UserWarning, match="never applied"):
        outputs = runner(lambda: net(x))
    net.forwards = 1  # the truth of the variant's forward, the second
    truth = by_hand(net, [], lambda: net(x))  # a's output was changed in place: run again
    assert torch.equal(outputs["z"], truth)
