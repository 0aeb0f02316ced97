"""Attribution patching against hand-written hooks and exact patching."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

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
