"""Gradients captured by IOCaptureCallback in real Trainer runs, against the truth.

The truth: for every batch of the same DataLoader, the model run by hand outside
Lightning with gradients on, plain hooks holding the tensors asked for, the summed
next-token loss of the real tokens written here (float64), and ``torch.autograd.grad`` of
it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, TokenRows
from lightning_iocatch.capture import Steer, Zero
from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.lightning.effects import InterventionEffects
from lightning_iocatch.probes import ActivationStats
from lightning_iocatch.store.names import POSITION_KEY
from tests.conftest import hook_count
from tests.lightning_models import trainer

transformers = pytest.importorskip("transformers")

VOCAB = 50
L0, L1 = "model.model.layers.0", "model.model.layers.1"


class Llama(pl.LightningModule):
    """A 3-block Llama (or GPT-2) of random weights; its steps call ``self.model(**batch)``."""

    def __init__(self, gpt2: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if gpt2:
            config = transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=3, n_head=4
            )
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                attn_implementation="eager",
            )  # fmt: skip
            self.model = transformers.LlamaForCausalLM(config)
        self.step_hooks: list[int] = []  # capture hooks seen by each step's own forward

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.step_hooks.append(hook_count(self))
        self.model(**batch)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.step_hooks.append(hook_count(self))
        return self.model(**batch).logits


def padded(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest sequence, as a tokenizer's."""
    width = max(len(item) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item)], mask[row, : len(item)] = item, 1
    return {"input_ids": ids, "attention_mask": mask}


def loader(n: int = 7, batch_size: int = 3) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(4)
    lengths = [3 + (5 * i) % 6 for i in range(n)]  # 3..8 tokens: every batch is padded
    items = [torch.randint(0, VOCAB, (k,), generator=generator) for k in lengths]
    return DataLoader(items, batch_size=batch_size, collate_fn=padded)  # type: ignore[arg-type]


def summed_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy summed over the real tokens (float64), written here."""
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    target = batch["input_ids"][:, 1:]
    mask = batch["attention_mask"]
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    terms = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return terms[keep].sum()


def by_hand(
    module: Llama, batch: dict[str, torch.Tensor], sites: list[tuple[str, str]], bf16: bool = False
) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per site ``(name, "outputs" | "inputs")``: the hidden state a plain hook sees in a
    forward with gradients on, and ``torch.autograd.grad`` of the summed loss of it."""
    modules = dict(module.named_modules())
    held: dict[tuple[str, str], torch.Tensor] = {}
    handles = []
    for site in sites:
        name, kind = site
        if kind == "outputs":

            def output(m: nn.Module, a: Any, out: Any, site: tuple[str, str] = site) -> None:
                held[site] = out if isinstance(out, torch.Tensor) else out[0]

            handles.append(modules[name].register_forward_hook(output))
        else:

            def inputs(m: nn.Module, a: Any, kw: Any, site: tuple[str, str] = site) -> None:
                held[site] = a[0] if a else kw["hidden_states"]

            handles.append(modules[name].register_forward_pre_hook(inputs, with_kwargs=True))
    try:
        module.eval()
        with torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = module.model(**batch).logits
            grads = torch.autograd.grad(summed_loss(logits, batch), list(held.values()))
    finally:
        for handle in handles:
            handle.remove()
    return {site: (held[site].detach(), grad) for site, grad in zip(held, grads, strict=True)}


def hidden(flat: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The hidden state under ``prefix``: a block's whole output, or its first value."""
    for key in (prefix, f"{prefix}/0", f"{prefix}/args/0", f"{prefix}/kwargs/hidden_states"):
        if key in flat:
            return flat[key]
    raise KeyError(f"{prefix} not in {sorted(flat)}")


def flat_batch(captured: Any, batch_idx: int) -> dict[str, torch.Tensor]:
    """The flat captures of batch ``batch_idx`` (each module called once per forward)."""
    one = {n: {k: [v[batch_idx]] for k, v in kinds.items() if v} for n, kinds in captured.items()}
    return flatten_captures(one)


def unchanged_parameters(module: nn.Module) -> bool:
    return all(p.grad is None and p.requires_grad for p in module.parameters())


@pytest.mark.parametrize("gpt2", [False, True], ids=["llama", "gpt2"])
def test_validate_gradients_equal_autograd_grad_of_hand_written_hooks(gpt2: bool) -> None:
    module = Llama(gpt2)
    blocks = "model.transformer.h" if gpt2 else "model.model.layers"
    first, second = f"{blocks}.0", f"{blocks}.1"
    spec = f"outputs[{second}]|grad_outputs[{first}|{second}]|grad_inputs[{second}]"
    callback = IOCaptureCallback(spec, stages=["validate"])
    trainer([callback]).validate(module, loader(), verbose=False)
    assert module.step_hooks == [0, 0, 0]  # the step's own forward runs untouched
    assert unchanged_parameters(module)
    captured = callback.captures["validate"][0]
    for batch_idx, batch in enumerate(loader()):
        truth = by_hand(
            module, batch, [(first, "outputs"), (second, "outputs"), (second, "inputs")]
        )
        flat = flat_batch(captured, batch_idx)
        activations = hidden(flat, f"{second}/outputs")
        torch.testing.assert_close(activations, truth[second, "outputs"][0], rtol=0, atol=0)
        for name, kind in truth:
            got = hidden(flat, f"{name}/grad_{kind}")
            torch.testing.assert_close(got, truth[name, kind][1], rtol=0, atol=0)
    assert unchanged_parameters(module)


def real_tokens(batch: dict[str, torch.Tensor], value: torch.Tensor) -> tuple[Any, list[int]]:
    """``value``'s rows at the batch's real tokens, sample by sample, and their positions."""
    rows, positions = [], []
    for i in range(len(value)):
        for p in range(value.shape[1]):
            if batch["attention_mask"][i, p]:
                rows.append(value[i, p])
                positions.append(p)
    return torch.stack(rows), positions


def test_a_predict_dump_of_token_rows_stores_the_gradients_of_the_real_tokens(
    tmp_path: Path,
) -> None:
    module = Llama()
    writer = FeatureWriter(tmp_path, tokens=TokenRows())
    callback = IOCaptureCallback(
        f"outputs[{L1}]|grad_outputs[{L1}]", stages=["predict"], writer=writer
    )
    trainer([callback]).predict(module, loader(), return_predictions=False)
    assert module.step_hooks == [0, 0, 0] and unchanged_parameters(module)
    rows, grads, positions, indices, start = [], [], [], [], 0
    for batch in loader():
        value, grad = by_hand(module, batch, [(L1, "outputs")])[L1, "outputs"]
        rows.append(real_tokens(batch, value)[0])
        selected, where = real_tokens(batch, grad)
        grads.append(selected)
        positions += where
        indices += [
            start + i
            for i in range(len(grad))
            for _ in range(int(batch["attention_mask"][i].sum()))
        ]
        start += len(grad)
    store = FeatureStore(tmp_path)
    assert store.indices.tolist() == indices
    assert store[POSITION_KEY].tolist() == positions
    assert torch.equal(store[f"{L1}/outputs"], torch.cat(rows))
    assert torch.equal(store[f"{L1}/grad_outputs"], torch.cat(grads))


def test_bf16_mixed_gradients_equal_hand_written_hooks_under_autocast() -> None:
    module = Llama()
    callback = IOCaptureCallback(f"grad_outputs[{L0}|{L1}.mlp]", stages=["test"])
    trainer([callback], precision="bf16-mixed").test(module, loader(), verbose=False)
    captured = callback.captures["test"][0]
    for batch_idx, batch in enumerate(loader()):
        truth = by_hand(module, batch, [(L0, "outputs"), (f"{L1}.mlp", "outputs")], bf16=True)
        flat = flat_batch(captured, batch_idx)
        for name, kind in truth:
            got, want = hidden(flat, f"{name}/grad_{kind}"), truth[name, kind][1]
            assert got.dtype == want.dtype  # float32 on the residual stream, bf16 in the MLP
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert {hidden(flat, f"{L1}.mlp/grad_outputs").dtype} == {torch.bfloat16}
    assert unchanged_parameters(module)


@pytest.mark.parametrize("gradients_first", [False, True])
def test_a_callback_of_activations_beside_one_of_gradients_sees_only_the_steps_forward(
    gradients_first: bool,
) -> None:
    module = Llama()
    activations = IOCaptureCallback(f"outputs[{L0}]", stages=["validate"])
    gradients = IOCaptureCallback(f"grad_outputs[{L1}]", stages=["validate"])
    callbacks = [gradients, activations] if gradients_first else [activations, gradients]
    trainer(callbacks).validate(module, loader(), verbose=False)
    assert module.step_hooks == [1, 1, 1]  # the activations' hook only
    outputs = activations.captures["validate"][0][L0]["outputs"]
    grads = gradients.captures["validate"][0][L1]["grad_outputs"]
    assert len(outputs) == len(grads) == 3  # one call per batch: the pass is apart
    for batch_idx, batch in enumerate(loader()):
        truth = by_hand(module, batch, [(L0, "outputs"), (L1, "outputs")])
        torch.testing.assert_close(outputs[batch_idx], truth[L0, "outputs"][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[batch_idx], truth[L1, "outputs"][1], rtol=0, atol=0)
    assert set(gradients.captures["validate"][0]) == {L1}


def test_bad_arguments_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="asks for gradients.*drop `early_exit`"):
        IOCaptureCallback(f"grad_outputs[{L1}]", stages=["predict"], early_exit=True)
    fix = r"asks for no gradient: add e.g. 'grad_outputs\[model.model.layers.1\]'"
    with pytest.raises(ValueError, match=f"`loss` only serves the gradients.*{fix}"):
        IOCaptureCallback(f"outputs[{L1}]", loss=lambda logits, batch: logits.sum())
    with pytest.raises(ValueError, match="`forward` and `output` only serve"):
        IOCaptureCallback(f"outputs[{L1}]", forward=Llama.__call__, output=lambda out: out)
    with pytest.raises(TypeError, match="`loss` must be a function"):
        IOCaptureCallback(f"grad_outputs[{L1}]", loss="mean")  # type: ignore[arg-type]
    mean = IOCaptureCallback(f"grad_outputs[{L1}]", loss=lambda logits, batch: logits.mean())
    with pytest.raises(ValueError, match=r"returned \(\): it must return one loss per sample"):
        trainer([mean]).validate(Llama(), loader(), verbose=False)


def test_the_callbacks_own_edits_apply_to_its_pass_and_not_to_the_step() -> None:
    module = Llama()
    steer = torch.linspace(-1, 1, 32)
    edit = Steer(L0, steer, alpha=2.0)
    callback = IOCaptureCallback(f"grad_outputs[{L1}]", stages=["validate"], edits=[edit])
    trainer([callback]).validate(module, loader(), verbose=False)
    assert module.step_hooks == [0, 0, 0]  # the step's forward is neither captured nor edited
    handle = module.model.model.layers[0].register_forward_hook(lambda m, a, o: o + 2.0 * steer)
    try:
        for batch_idx, batch in enumerate(loader()):
            want = by_hand(module, batch, [(L1, "outputs")])[L1, "outputs"][1]
            got = callback.captures["validate"][0][L1]["grad_outputs"][batch_idx]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        handle.remove()
    unedited = by_hand(module, batch, [(L1, "outputs")])[L1, "outputs"][1]
    assert not torch.allclose(got, unedited, rtol=0, atol=1e-3)  # the edit changes them


def test_probes_of_gradients_log_numpy_statistics_of_the_real_tokens() -> None:
    module = Llama()
    callback = IOCaptureCallback(
        f"grad_outputs[{L1}]", stages=["validate"], probes=[ActivationStats()]
    )
    logged = trainer([callback]).validate(module, loader(), verbose=False)[0]
    rows = [
        real_tokens(batch, by_hand(module, batch, [(L1, "outputs")])[L1, "outputs"][1])[0]
        for batch in loader()
    ]
    values = torch.cat(rows).double().numpy()
    expected = {
        "mean": values.mean(),
        "rms": np.sqrt((values**2).mean()),
        "absmax": np.abs(values).max(),
        "zero_frac": (values == 0).mean(),  # each sample's last token: no loss term after it
    }
    assert expected["zero_frac"] > 0
    for stat, value in expected.items():
        assert logged[f"iocatch/{L1}/grad_outputs/{stat}"] == pytest.approx(value, rel=1e-6), stat


def test_intervention_effects_beside_it_log_what_they_log_alone() -> None:
    def effects() -> InterventionEffects:
        return InterventionEffects({"zero": [Zero(L0)]}, forward=lambda m, b: m.model(**b))

    alone = effects()
    trainer([alone]).validate(Llama(), loader(), verbose=False)
    module, beside = Llama(), effects()
    gradients = IOCaptureCallback(f"grad_outputs[{L1}]", stages=["validate"])
    trainer([gradients, beside]).validate(module, loader(), verbose=False)  # its pass first
    assert beside.last_values == alone.last_values
    for batch_idx, batch in enumerate(loader()):
        want = by_hand(module, batch, [(L1, "outputs")])[L1, "outputs"][1]
        got = gradients.captures["validate"][0][L1]["grad_outputs"][batch_idx]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
