"""Attribution patching against hand-written hooks and exact patching."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher, recording_gradients
from lightning_iocatch.capture.attribution import (
    attribution_patching,
    components,
    exact_patching,
)

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _pairs(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 50, (4, 6), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(0, 50, (4,), generator=generator)
    return {"input_ids": clean}, {"input_ids": corrupted}


def _logit_difference(model: nn.Module) -> Any:
    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**batch).logits[:, -1]
        return logits[:, 3] - logits[:, 7]

    return run


def _keep(held: dict[str, torch.Tensor], name: str) -> Any:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        held[name] = out if isinstance(out, torch.Tensor) else out[0]

    return hook


def _hand_written(
    model: nn.Module, names: list[str], clean: Any, corrupted: Any, heads: dict[str, int]
) -> dict[str, dict[str, torch.Tensor]]:
    """Both conventions by plain hooks: a forward and ``autograd.grad`` of each run."""
    modules = dict(model.named_modules())
    run = _logit_difference(model)
    acts: dict[str, dict[str, torch.Tensor]] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for which, batch in (("clean", clean), ("corrupted", corrupted)):
        held: dict[str, torch.Tensor] = {}
        handles = [modules[n].register_forward_hook(_keep(held, n)) for n in names]
        with torch.enable_grad():
            metric = run(batch).sum()
            found = torch.autograd.grad(metric, [held[n] for n in names])
        for handle in handles:
            handle.remove()
        acts[which] = {n: held[n].detach() for n in names}
        grads[which] = dict(zip(names, found, strict=True))
    scores: dict[str, dict[str, torch.Tensor]] = {"denoising": {}, "noising": {}}
    for name in names:
        for convention, base, source in (
            ("denoising", "corrupted", "clean"),
            ("noising", "clean", "corrupted"),
        ):
            delta, grad = acts[source][name] - acts[base][name], grads[base][name]
            if name in heads:
                shape = (*delta.shape[:-1], heads[name], -1)
                delta, grad = delta.reshape(shape), grad.reshape(shape)
            scores[convention][f"{name}/outputs"] = (delta * grad).sum(-1)
    return scores


def test_both_conventions_equal_hand_written_hooks_on_gpt2() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    clean, corrupted = _pairs()
    names = ["transformer.h.0", "transformer.h.1.mlp", "transformer.h.2.attn.c_proj"]
    heads = {"transformer.h.2.attn.c_proj": 4}
    expected = _hand_written(model, names, clean, corrupted, heads)
    found = attribution_patching(
        model,
        f"outputs[{'|'.join(names)}]",
        _logit_difference(model),
        clean,
        corrupted,
        conventions=("denoising", "noising"),
        heads=heads,
    )
    for convention in ("denoising", "noising"):
        assert set(found.scores[convention]) == set(expected[convention])
        for key, want in expected[convention].items():
            got = found.scores[convention][key]
            assert got.shape == want.shape, key
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert found.scores["noising"]["transformer.h.2.attn.c_proj/outputs"].shape == (4, 6, 4)
    assert not any(p.grad is not None for p in model.parameters())


def test_equal_to_exact_patching_where_the_metric_is_linear_in_the_component() -> None:
    """A metric linear in the patched value: the first-order estimate is exact."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
    clean, corrupted = torch.randn(5, 4, 3), torch.randn(5, 4, 3)

    def run(x: torch.Tensor) -> torch.Tensor:
        return model(x)[..., 0].sum(-1)  # linear in outputs of 2 and inputs of 2

    found = attribution_patching(
        model, "outputs[2]|inputs[2]", run, clean, corrupted, conventions=["noising", "denoising"]
    )
    for convention in ("denoising", "noising"):
        for key in ("2/outputs", "2/inputs"):
            exact = exact_patching(model, key, run, clean, corrupted, convention)
            torch.testing.assert_close(
                found.scores[convention][key].sum(-1), exact, rtol=0, atol=1e-5
            )
            mask = torch.zeros(5, 4, dtype=torch.bool)
            mask[:, 1] = True  # one position
            one = exact_patching(model, key, run, clean, corrupted, convention, positions=mask)
            torch.testing.assert_close(found.scores[convention][key][:, 1], one, atol=1e-5, rtol=0)
    # the conventions are the two batches swapped
    swapped = attribution_patching(model, "outputs[2]", run, corrupted, clean, "denoising")
    torch.testing.assert_close(
        swapped.scores["denoising"]["2/outputs"], found.scores["noising"]["2/outputs"]
    )


def test_refusals_name_the_fix() -> None:
    net = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match="outputs"):
        components(net, "grad_outputs[0]")
    with pytest.raises(ValueError, match="does not divide"):
        attribution_patching(net, "outputs[0]", lambda b: net(b)[:, 0], x, x, heads={"0": 3})
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        attribution_patching(net, "outputs[0]", lambda b: net(b).sum(), x, x)
    with pytest.raises(ValueError, match="conventions"):
        attribution_patching(net, "outputs[0]", lambda b: net(b)[:, 0], x, x, "denoise")
    with pytest.raises(ValueError, match="runs once"):
        attribution_patching(net, "outputs[0]", lambda b: net(b)[:, 0] + net(b)[:, 0], x, x)


def test_an_input_also_used_outside_its_module_counts_only_the_module() -> None:
    """``h + blk(h)`` with the residual add outside ``blk``: patching ``blk``'s input
    changes only ``blk``'s use of it; on a linear model AtP is exactly that."""
    torch.manual_seed(4)

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.blk, self.head = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            return self.head(h + self.blk(h))

    net = Residual()
    clean, corrupted = torch.randn(2, 5, 3), torch.randn(2, 5, 3)

    def run(x: torch.Tensor) -> torch.Tensor:
        return net(x).sum(dim=(1, 2))

    found = attribution_patching(
        net, "inputs[blk]", run, clean, corrupted, ["denoising", "noising"]
    )
    for convention in ("denoising", "noising"):
        exact = exact_patching(net, "blk/inputs", run, clean, corrupted, convention)
        estimate = found.scores[convention]["blk/inputs"].sum(-1)
        torch.testing.assert_close(estimate, exact, rtol=0, atol=1e-5)


def test_an_in_place_operation_after_a_component_and_a_parameter_view_as_output() -> None:
    """``ReLU(inplace=True)`` right after a component, and a learned position table whose
    output is a view of its parameter: the same figures as hand-written hooks."""
    torch.manual_seed(5)

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.table[: x.shape[1]]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos, self.up = Positions(), nn.Linear(4, 4)
            self.act, self.down = nn.ReLU(inplace=True), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.act(self.up(x + self.pos(x))))

    net = Net()
    clean, corrupted = torch.randn(3, 5, 4), torch.randn(3, 5, 4)

    def run(x: torch.Tensor) -> torch.Tensor:
        return net(x).sum(dim=(1, 2))

    found = attribution_patching(net, "outputs[up]", run, clean, corrupted)
    with torch.no_grad():  # by hand: the metric is sum(down(relu(u))), d/du = [u > 0] w
        held = {
            name: net.up(x + net.pos.table[:5]) for name, x in (("clean", clean), ("c", corrupted))
        }
        grad = (held["c"] > 0) * net.down.weight[0]
    expected = ((held["clean"] - held["c"]) * grad).sum(-1)
    torch.testing.assert_close(found.scores["denoising"]["up/outputs"], expected, atol=1e-6, rtol=0)
    assert float(expected.abs().sum()) > 0.1
    catcher = ModelIOCatcher(net, "cpu")
    with catcher(grad_outputs=["pos", "up"]) as buf, recording_gradients():
        torch.autograd.grad(run(corrupted.detach()).sum(), catcher.session.gradient_edges())
    torch.testing.assert_close(buf["up"]["grad_outputs"][0], grad, atol=1e-6, rtol=0)
    assert float(buf["pos"]["grad_outputs"][0].abs().sum()) > 0.1  # not silent zeros


def test_bf16_values_are_subtracted_in_float32() -> None:
    generator = torch.Generator().manual_seed(6)
    source, base, grad = (torch.randn(2, 3, 64, generator=generator) for _ in range(3))
    source, base = (1000 + source).bfloat16(), (1000 + base).bfloat16()
    got = components(nn.Sequential(nn.Linear(1, 1)), "outputs[0]")[0].product(source, base, grad)
    truth = ((source.double() - base.double()) * grad.double()).sum(-1)
    torch.testing.assert_close(got.double(), truth, rtol=1e-6, atol=1e-4)


def test_only_the_patched_tensor_of_an_inputs_component_is_captured() -> None:
    """A decoder layer's keyword inputs (masks, rotary tables) are neither copied nor
    differentiated: a component is what an edit would patch."""
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
        )
    ).eval()  # fmt: skip
    layer = components(model, "inputs[model.layers.1]")[0]
    catcher = ModelIOCatcher(model, None)
    ids = torch.randint(0, 50, (2, 6))
    parts = {(layer.module, layer.kind): layer.value}
    session = catcher(inputs=["model.layers.1"], grad_inputs=["model.layers.1"], parts=parts)
    with session as buf, recording_gradients():
        loss = model(input_ids=ids).logits.sum()
        torch.autograd.grad(loss, session.gradient_edges())
    assert len(session.gradient_edges()) == 0  # taken at close
    value, grad = buf["model.layers.1"]["inputs"][0], buf["model.layers.1"]["grad_inputs"][0]
    assert isinstance(value, torch.Tensor) and value.shape == grad.shape == (2, 6, 32)


def test_one_tensor_in_two_places_is_patched_and_scored_at_its_first() -> None:
    """``f(x, x)``, as ``nn.MultiheadAttention(x, x, x)`` is called: an edit of the inputs
    patches the first place only, and so does the estimate; each place has its own
    gradient, as register_full_backward_hook gives them."""
    torch.manual_seed(9)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.v = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.q(q) + self.v(v)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.two, self.head = nn.Linear(3, 4), Two(), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            return self.head(self.two(h, h))

    net = Net()
    clean, corrupted = torch.randn(2, 5, 3), torch.randn(2, 5, 3)

    def run(x: torch.Tensor) -> torch.Tensor:
        return net(x).sum(dim=(1, 2))

    found = attribution_patching(net, "inputs[two]", run, clean, corrupted)
    exact = exact_patching(net, "two/inputs", run, clean, corrupted)
    torch.testing.assert_close(
        found.scores["denoising"]["two/inputs"].sum(-1), exact, atol=1e-5, rtol=0
    )
    truth: list[Any] = []
    handle = net.two.register_full_backward_hook(lambda m, g_in, g_out: truth.append(g_in))
    with torch.enable_grad():
        run(clean.requires_grad_()).sum().backward()
    handle.remove()
    net.zero_grad(set_to_none=True)
    catcher = ModelIOCatcher(net, "cpu")
    with catcher(grad_inputs=["two"]) as buf, recording_gradients():
        torch.autograd.grad(run(clean.detach()).sum(), catcher.session.gradient_edges())
    got = buf["two"]["grad_inputs"][0]["args"]
    torch.testing.assert_close(got[0], truth[0][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[1], truth[0][1], atol=1e-6, rtol=0)
    assert not torch.allclose(got[0], got[1])
