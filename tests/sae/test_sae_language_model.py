"""SAEModule's validation on held-out text of the model its activations came from
(``language_model=``, ``layer=``): the rows are the layer's outputs at real tokens, as
Hugging Face's ``output_hidden_states`` gives them; the CE loss recovered and the KL equal
those of a splice written here with a plain forward hook; the frozen model stays out of
checkpoints and out of the optimizer. A tiny Llama built from a config, padded batches."""

from __future__ import annotations

import logging
import warnings
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch.lightning.sae import SAEModule
from tests.lightning_models import tiny_llama

LAYER = "model.layers.1"


class Fitted(NamedTuple):
    lm: Any
    text: list[dict[str, torch.Tensor]]
    before: dict[str, torch.Tensor]
    module: SAEModule
    trainer: pl.Trainer
    warned: list[str]


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    """One fit shared by the tests: a 3-layer tiny Llama in eval mode, as given."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    lm, text = tiny_llama(num_hidden_layers=3), _text()
    before = {name: value.clone() for name, value in lm.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, trainer = _trained(lm, text)
    return Fitted(lm, text, before, module, trainer, [str(w.message) for w in caught])


def _text() -> list[dict[str, torch.Tensor]]:
    """Two batches of 3 sequences of 10 tokens, left-padded by 0 to 4 tokens."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (6, 10), generator=generator)
    mask = torch.ones_like(ids)
    for row, padding in enumerate((0, 2, 4, 1, 3, 0)):
        mask[row, :padding] = 0
        ids[row, :padding] = 0
    return [{"input_ids": ids[i : i + 3], "attention_mask": mask[i : i + 3]} for i in (0, 3)]


def _hidden(lm: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's output at real tokens, from Hugging Face (the 3rd of 4 hidden states:
    after layers.1, before the final norm)."""
    with torch.no_grad():
        states = lm(**batch, output_hidden_states=True).hidden_states
    return states[2][batch["attention_mask"].bool()]


def _trained(lm: Any, text: list[dict[str, torch.Tensor]]) -> tuple[SAEModule, pl.Trainer]:
    torch.manual_seed(0)  # the training loader's shuffle
    rows = torch.cat([_hidden(lm, batch) for batch in text]).repeat(8, 1)
    module = SAEModule(32, 96, "topk", k=6, lr=3e-3, language_model=lm, layer=LAYER)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)  # fmt: skip
    train = DataLoader(TensorDataset(rows), batch_size=32, shuffle=True)
    trainer.fit(module, train, DataLoader(text, batch_size=None))
    return module, trainer


def _next_token_sums(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Sum and count of next-token cross entropies where both tokens are real."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    keep = mask[:, 1:] & mask[:, :-1]
    terms = torch.nn.functional.cross_entropy(
        logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none"
    )
    return float(terms[keep].sum()), int(keep.sum())


def _by_hand(lm: Any, text: list[dict[str, torch.Tensor]], edit: Any) -> tuple[float, float]:
    """Mean next-token loss with ``edit`` applied to the layer's hidden output by a hook,
    and the mean KL(clean || edited) over real positions."""
    layer = dict(lm.named_modules())[LAYER]
    loss, count, kl, positions = 0.0, 0, 0.0, 0

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (edit(output[0]), *output[1:])
        return edit(output)

    for batch in text:
        with torch.no_grad():
            clean = lm(**batch, use_cache=False).logits
            handle = layer.register_forward_hook(hook)
            try:
                edited = lm(**batch, use_cache=False).logits
            finally:
                handle.remove()
        total, terms = _next_token_sums(edited, batch)
        loss, count = loss + total, count + terms
        p, q = clean.double().log_softmax(-1), edited.double().log_softmax(-1)
        per_position = (p.exp() * (p - q)).sum(-1)
        mask = batch["attention_mask"].bool()
        kl, positions = kl + float(per_position[mask].sum()), positions + int(mask.sum())
    return loss / count, kl / positions


def test_rows_and_reconstruction_figures_are_the_layers_real_tokens(fitted: Fitted) -> None:
    lm, text, module, trainer = fitted.lm, fitted.text, fitted.module, fitted.trainer
    rows = torch.cat([_hidden(lm, batch) for batch in text]).double()
    sae = module.sae.eval()
    with torch.no_grad():
        error = (sae(rows.float()).double() - rows).pow(2).sum(-1)
        active = (sae.encode(rows.float()) != 0).double().sum(-1)
    spread = (rows - rows.mean(0)).pow(2).sum(-1)
    logged = trainer.callback_metrics
    assert module.unit_summary is not None and module.unit_summary.rows == rows.shape[0]
    assert float(logged["val/mse"]) == pytest.approx(float(error.mean()), rel=1e-5)
    assert float(logged["val/explained_variance"]) == pytest.approx(
        float(1 - error.mean() / spread.mean()), rel=1e-5
    )
    assert float(logged["val/l0"]) == pytest.approx(float(active.mean()))


def test_loss_recovered_and_kl_equal_a_hand_written_splice(fitted: Fitted) -> None:
    lm, text, module, trainer = fitted.lm, fitted.text, fitted.module, fitted.trainer
    sae = module.sae.eval()
    clean, _ = _by_hand(lm, text, lambda h: h)
    spliced, spliced_kl = _by_hand(lm, text, lambda h: sae(h))
    zero, zero_kl = _by_hand(lm, text, torch.zeros_like)
    logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
    assert logged["sae/clean/loss"] == pytest.approx(clean, rel=1e-5)
    assert logged["sae/sae/loss"] == pytest.approx(spliced, rel=1e-5)
    assert logged["sae/zero/loss"] == pytest.approx(zero, rel=1e-5)
    assert logged["sae/sae/kl"] == pytest.approx(spliced_kl, rel=1e-4, abs=1e-9)
    assert logged["sae/zero/kl"] == pytest.approx(zero_kl, rel=1e-4)
    recovered = (zero - spliced) / (zero - clean)
    assert logged["sae/sae/loss_recovered"] == pytest.approx(recovered, rel=1e-4)


def test_the_frozen_model_is_left_out_of_checkpoints_and_the_optimizer(
    fitted: Fitted, tmp_path: Any
) -> None:
    lm, module, trainer = fitted.lm, fitted.module, fitted.trainer
    assert all(torch.equal(value, lm.state_dict()[name]) for name, value in fitted.before.items())
    optimized = {
        id(p) for group in module.optimizers().optimizer.param_groups for p in group["params"]
    }
    assert optimized == {id(p) for p in module.sae.parameters()}
    path = tmp_path / "sae.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert saved and not [name for name in saved if name.startswith("language_model.")]
    again = SAEModule(32, 96, "topk", k=6, language_model=tiny_llama(num_hidden_layers=3),
                      layer=LAYER)  # fmt: skip
    again.on_load_checkpoint({"state_dict": saved})
    again.load_state_dict(saved)  # strict: the given model's weights fill its keys
    assert torch.equal(again.sae.W_dec, module.sae.W_dec)


def test_a_layer_the_model_lacks_is_refused_with_near_names() -> None:
    lm = tiny_llama()
    with pytest.raises(ValueError, match=r"'model.layer.1' is not a module.*did you mean"):
        SAEModule(32, 96, "topk", k=6, language_model=lm, layer="model.layer.1")
    with pytest.raises(ValueError, match="give both `language_model` and `layer`"):
        SAEModule(32, 96, "topk", k=6, language_model=lm)


def test_fit_gives_the_model_back_in_its_modes(fitted: Fitted) -> None:
    assert not [message for message in fitted.warned if "in eval mode" in message]
    assert not any(module.training for module in fitted.lm.modules())  # eval, as given
