"""Gradients as a capture kind, against ``torch.autograd.grad`` of hand-written hooks."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch.capture import CaptureSpec, ModelIOCatcher, recording_gradients
from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.errors import CaptureError, SpecError

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=3, n_head=4, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded sample: its padding is not in the loss
    return {"input_ids": ids, "attention_mask": mask}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token loss over real tokens: every sample's own gradient."""
    logits = model(**batch).logits[:, :-1].float()
    keep = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
    targets = batch["input_ids"][:, 1:].reshape(-1)
    terms = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets, reduction="none"
    )
    return terms[keep.reshape(-1)].sum()


def _hand_written(
    model: nn.Module, sites: list[tuple[str, str]], batch: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """Every call's first floating tensor of each site, and the loss' gradient of it, by
    plain hooks and ``torch.autograd.grad`` in a forward with gradients on."""
    modules = dict(model.named_modules())
    held: list[torch.Tensor] = []
    handles = []
    for name, kind in sites:
        if kind == "outputs":

            def output(module: nn.Module, args: Any, out: Any) -> None:
                held.append(out if isinstance(out, torch.Tensor) else out[0])

            handles.append(modules[name].register_forward_hook(output))
        else:

            def inputs(module: nn.Module, args: Any, kwargs: Any) -> None:
                held.append(args[0] if args else kwargs["hidden_states"])

            handles.append(modules[name].register_forward_pre_hook(inputs, with_kwargs=True))
    try:
        with torch.enable_grad():
            loss = _loss(model, batch)
            return list(torch.autograd.grad(loss, held))
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("recording", [True, False], ids=["from-first-site", "grad-on"])
def test_gradients_equal_autograd_of_hand_written_hooks(build: Any, recording: bool) -> None:
    torch.manual_seed(0)
    model = build()
    layers = "transformer.h" if build is _gpt2 else "model.layers"
    mlp = f"{layers}.1.mlp"
    spec = f"grad_outputs[{layers}.0|{mlp}]|grad_inputs[{layers}.2]|outputs[{layers}.0]"
    batch = _batch()
    expected = _hand_written(
        model, [(f"{layers}.0", "outputs"), (mlp, "outputs"), (f"{layers}.2", "inputs")], batch
    )
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec(spec) as buf:
        context = recording_gradients() if recording else torch.enable_grad()
        with context:
            loss = _loss(model, batch)
            torch.autograd.grad(loss, catcher.session.gradient_edges())
    flat = flatten_captures(buf)
    out0 = flat.get(f"{layers}.0/grad_outputs/0", flat.get(f"{layers}.0/grad_outputs"))
    torch.testing.assert_close(out0, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(flat[f"{mlp}/grad_outputs"], expected[1], rtol=0, atol=1e-6)
    into = [k for k in flat if k.startswith(f"{layers}.2/grad_inputs/")]
    hidden = flat.get(f"{layers}.2/grad_inputs/args/0")
    if hidden is None:  # a keyword input, as recent decoder layers are called
        hidden = flat[f"{layers}.2/grad_inputs/kwargs/hidden_states"]
    assert into, flat.keys()
    torch.testing.assert_close(hidden, expected[2], rtol=0, atol=1e-6)
    assert not any(p.grad is not None for p in model.parameters())  # no .grad touched
    assert all(p.requires_grad for p in model.parameters())  # nor requires_grad
    activations = flat.get(f"{layers}.0/outputs/0", flat.get(f"{layers}.0/outputs"))
    assert activations is not None and not activations.requires_grad


def test_a_module_called_twice_gives_each_call_its_gradient() -> None:
    torch.manual_seed(1)
    shared, head = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"shared": shared, "head": head})

    def forward(x: torch.Tensor) -> torch.Tensor:
        return head(torch.tanh(shared(torch.tanh(shared(x))))).pow(2).sum()

    x = torch.randn(5, 4)
    outs: list[torch.Tensor] = []
    handle = shared.register_forward_hook(lambda m, a, o: outs.append(o))
    with torch.enable_grad():
        expected = torch.autograd.grad(forward(x), outs)
    handle.remove()
    catcher = ModelIOCatcher(model, "cpu")
    with catcher(grad_outputs=["shared"], grad_inputs=["shared"]) as buf, torch.enable_grad():
        forward(x).backward(inputs=catcher.session.gradient_edges())
    assert [g.shape for g in buf["shared"]["grad_outputs"]] == [(5, 4), (5, 4)]
    for got, want in zip(buf["shared"]["grad_outputs"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert set(flatten_captures(buf)) == {
        "shared/grad_outputs",
        "shared/grad_outputs@1",
        "shared/grad_inputs/args/0",
        "shared/grad_inputs@1/args/0",
    }
    assert not any(p.grad is not None for p in model.parameters())


def test_bf16_autocast_gradients_equal_the_hand_written_ones() -> None:
    torch.manual_seed(2)
    model = _llama()
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _hand_written(model, [("model.layers.1.mlp", "outputs")], batch)
        catcher = ModelIOCatcher(model, "cpu")
        session = catcher.from_spec("grad_outputs[model.layers.1.mlp]")
        with session as buf, recording_gradients():
            torch.autograd.grad(_loss(model, batch), session.gradient_edges())
    got = buf["model.layers.1.mlp"]["grad_outputs"][0]
    assert got.dtype == expected[0].dtype == torch.bfloat16
    torch.testing.assert_close(got, expected[0], rtol=0, atol=0)


def test_grammar_and_refusals_name_the_fix() -> None:
    spec = CaptureSpec.parse("grad_outputs[a|b] | outputs[a]")
    assert (spec.grad_outputs, spec.outputs, spec.has_gradients) == (("a", "b"), ("a",), True)
    assert CaptureSpec.parse(spec.to_string()) == spec
    with pytest.raises(SpecError, match="did you mean 'grad_outputs'"):
        CaptureSpec.parse("grad_output[a]")
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    catcher = ModelIOCatcher(net, "cpu")
    with pytest.raises(KeyError, match="did you mean '1'|unknown module"):
        catcher.from_spec("grad_outputs[2]")
    with pytest.raises(ValueError, match="early_exit=False"):
        catcher.from_spec("grad_outputs[0]", early_exit=True)
    with catcher.from_spec("grad_outputs[0]"):
        with torch.inference_mode(), pytest.raises(CaptureError, match="recording_gradients"):
            net(torch.ones(1, 2))
        with torch.no_grad(), pytest.raises(CaptureError, match="enable_grad"):
            net(torch.ones(1, 2))


def test_a_forward_no_backward_reached_captures_nothing_and_says_so() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    catcher = ModelIOCatcher(net, "cpu")
    with catcher.from_spec("grad_outputs[0]") as buf:
        with recording_gradients():
            net(torch.ones(3, 2))
        with pytest.warns(UserWarning, match="no backward reached"):
            taken = catcher.session.take()
    assert taken["0"]["grad_outputs"] == [] and buf["0"]["grad_outputs"] == []


def test_a_batch_made_under_inference_mode_gives_the_same_gradients() -> None:
    """As a GPU evaluation loop gives it (moved to the device under inference mode):
    nothing before the first gradient site is recorded, so nothing saves it."""
    torch.manual_seed(3)
    model = _gpt2()
    with torch.inference_mode():
        batch = {k: v.clone() for k, v in _batch().items()}
    catcher = ModelIOCatcher(model, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = catcher.from_spec("grad_outputs[transformer.h.1]")
        with session as buf, recording_gradients():
            torch.autograd.grad(_loss(model, batch), session.gradient_edges())
    expected = _hand_written(model, [("transformer.h.1", "outputs")], _batch())
    flat = flatten_captures(buf)
    got = flat.get("transformer.h.1/grad_outputs/0", flat.get("transformer.h.1/grad_outputs"))
    torch.testing.assert_close(got, expected[0], rtol=0, atol=1e-6)


def test_a_taken_batch_leaves_no_graph_alive() -> None:
    """A tensor hook that held its site back would keep every forward's graph for good
    (a cycle through autograd that Python's collector cannot see)."""
    import gc
    import weakref

    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    catcher = ModelIOCatcher(net, "cpu")
    with catcher.from_spec("grad_outputs[0|1]") as buf:
        with recording_gradients():
            loss = net(torch.ones(3, 2)).sum()
            held = catcher.session._gradients.sites
            sites = [weakref.ref(t) for site in held for t in site.tensors]
            del held
            torch.autograd.grad(loss, catcher.session.gradient_edges())
        del loss
        catcher.session.take()
    gc.collect()
    assert len(sites) == 2 and all(site() is None for site in sites)
    assert len(buf["0"]["grad_outputs"]) == 1  # the gradient itself is a copy of its own


def test_a_parameter_given_as_an_input_keeps_no_hook_and_counts_its_module_only() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * w, x * w

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3,), 2.0))
            self.scale = Scale()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            twice = torch.tanh(x)
            a, _ = self.scale(twice, self.w)
            return (a * twice).sum()  # `twice` twice: as the input and again here

    net = Net()
    x = torch.randn(4, 3)
    truth: list[Any] = []  # PyTorch's own: the gradient through the module only
    handle = net.scale.register_full_backward_hook(lambda m, g_in, g_out: truth.append(g_in))
    with torch.enable_grad():
        net(x.requires_grad_()).backward()
    handle.remove()
    net.zero_grad(set_to_none=True)
    catcher = ModelIOCatcher(net, "cpu")
    for _ in range(3):
        with catcher(grad_inputs=["scale"]) as buf, recording_gradients():
            torch.autograd.grad(net(x.detach()), catcher.session.gradient_edges())
    assert not net.w._backward_hooks  # every forward's hook removed
    got = buf["scale"]["grad_inputs"][0]["args"]
    t = torch.tanh(x.detach())
    torch.testing.assert_close(got[0], 2.0 * t)  # w * t: the use inside the module only
    torch.testing.assert_close(got[0], truth[0][0])
    torch.testing.assert_close(got[1], (t * t).sum(0))
    torch.testing.assert_close(got[1], truth[0][1])


def test_the_models_own_output_recording_reads_the_copy_of_a_site() -> None:
    """Hugging Face records ``hidden_states`` by hooks it adds at the first call: a loss
    that reads them gets its gradient through the site too, whichever ran first."""
    torch.manual_seed(7)
    model = _llama()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        model(input_ids=ids, output_hidden_states=True)  # the model's own hooks are in

    def loss_of(out: Any) -> torch.Tensor:
        return out.loss + 1e-2 * out.hidden_states[2].pow(2).sum()  # [2]: layer 1's output

    held: list[torch.Tensor] = []
    handle = model.model.layers[1].register_forward_hook(lambda m, a, o: held.append(o))
    with torch.enable_grad():
        truth = torch.autograd.grad(
            loss_of(model(input_ids=ids, labels=ids, output_hidden_states=True)), held
        )[0]
    handle.remove()
    catcher = ModelIOCatcher(model, "cpu")
    with catcher(grad_outputs=["model.layers.1"]) as buf, recording_gradients():
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        torch.autograd.grad(loss_of(out), catcher.session.gradient_edges())
    got = buf["model.layers.1"]["grad_outputs"][0]
    torch.testing.assert_close(got, truth, rtol=0, atol=1e-6)


def test_gradients_turned_off_again_in_the_forward_are_refused() -> None:
    """Reentrant activation checkpointing runs its forward without gradients: a site
    after it would be cut off from the loss (zeros), so it is refused."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(8)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(net[0], x, use_reentrant=True)
        return net[2](net[1](h))

    catcher = ModelIOCatcher(net, "cpu")
    x = torch.randn(2, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no backward reached" beside the error
        refused = pytest.raises(CaptureError, match="use_reentrant=False")
        with refused, catcher(grad_outputs=["0", "1"]), recording_gradients():
            forward(x)


def test_a_module_that_writes_into_its_input_is_refused() -> None:
    """Its inputs' gradients are taken at copies: the caller would not see its writes."""

    class Cache(nn.Module):
        def forward(self, cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            cache[:, : x.shape[1]] = x  # a cache filled in place
            return cache.sum(1)

    net = nn.ModuleDict({"cache": Cache()})
    catcher = ModelIOCatcher(net, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refused = pytest.raises(CaptureError, match="writes into an input in place")
        with refused, catcher(grad_inputs=["cache"]), recording_gradients():
            net["cache"](torch.zeros(2, 4), torch.ones(2, 2))
