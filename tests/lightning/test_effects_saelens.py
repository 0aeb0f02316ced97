"""InterventionEffects equals SAELens' own evaluation of a sparse autoencoder.

SAELens judges an SAE by splicing it into a ``HookedTransformer`` and comparing the
cross-entropy and KL divergence with the clean run and a zero ablation
(``sae_lens.evals.get_recons_loss``, averaged over tokens as
``get_downstream_reconstruction_metrics`` does). The same model and SAE, evaluated by
``trainer.validate`` with ``InterventionEffects``, must log the same figures. Skipped
where SAELens is not installed (it is not in the test extra; ``make test-peers`` runs it in
the bench environment).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

sae_lens = pytest.importorskip("sae_lens")
transformer_lens = pytest.importorskip("transformer_lens")

from sae_lens.evals import get_recons_loss  # noqa: E402
from sae_lens.training.activation_scaler import ActivationScaler  # noqa: E402

from lightning_iocatch.capture import Replace, Zero  # noqa: E402
from lightning_iocatch.lightning.effects import InterventionEffects  # noqa: E402

HOOK = "blocks.1.hook_resid_post"


class Hooked(pl.LightningModule):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, return_type="logits")

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self(batch)


def test_effects_equal_saelens_evaluation_of_an_sae():
    torch.manual_seed(0)
    config = transformer_lens.HookedTransformerConfig(
        n_layers=3, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu"
    )
    model = transformer_lens.HookedTransformer(config).eval()
    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(
            d_in=32, d_sae=64, metadata=sae_lens.saes.sae.SAEMetadata(hook_name=HOOK)
        )
    )
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.normal_(0, 0.3)
    tokens = torch.randint(0, 50, (10, 12), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(list(tokens), batch_size=4)

    effects = InterventionEffects(
        {
            "splice": [Replace(f"model.{HOOK}", lambda h: sae.decode(sae.encode(h)))],
            "zero": [Zero(f"model.{HOOK}")],
        },
        recovered={"splice": "zero"},
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[effects])  # fmt: skip
    trainer.validate(Hooked(model), loader, verbose=False)

    per_token: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for batch in loader:
            found = get_recons_loss(sae, model, ActivationScaler(), batch, True, True)
            for name, value in found.items():
                per_token.setdefault(name, []).append(value.reshape(-1))
    saelens = {name: torch.cat(values).mean().item() for name, values in per_token.items()}
    saelens["ce_loss_score"] = (saelens["ce_loss_with_ablation"] - saelens["ce_loss_with_sae"]) / (
        saelens["ce_loss_with_ablation"] - saelens["ce_loss_without_sae"]
    )
    pairs = {
        "effects/clean/loss": "ce_loss_without_sae",
        "effects/splice/loss": "ce_loss_with_sae",
        "effects/zero/loss": "ce_loss_with_ablation",
        "effects/splice/kl": "kl_div_with_sae",
        "effects/zero/kl": "kl_div_with_ablation",
        "effects/splice/loss_recovered": "ce_loss_score",
    }
    for ours, theirs in pairs.items():
        assert effects.last_values[ours] == pytest.approx(saelens[theirs], rel=1e-5), ours
