"""SAELens 6 reads the SAEs we save, and we read the SAEs SAELens saves, to the same function.

Our direction: an SAEModule of each architecture trained a few steps with the input
normalisation on (``input_scale`` != 1), saved with ``save_saelens``, loaded by
``sae_lens.SAE.load_from_disk`` as the class SAELens should pick (a BatchTopK as a
JumpReLU); SAELens' ``encode``/``decode`` equal our eval-mode ones. Theirs: SAELens'
training SAEs of each architecture with perturbed weights, saved with
``save_inference_model`` and with ``save_model``, loaded by our ``load_saelens``; our
``encode``/``decode`` equal SAELens' (a BatchTopK checkpoint in training mode, where
SAELens' training SAE always selects over the batch). Float32, to 1e-5. Skipped where
sae-lens is not installed (it is not in the test extra; ``make test-peers`` runs it in
``.venv-bench``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_iocatch.lightning.sae import SAEModule  # noqa: E402
from lightning_iocatch.sae import SparseAutoencoder, load_saelens, save_saelens  # noqa: E402

D_IN, D_SAE, ROWS = 16, 64, 32
K = {"topk": 4, "batchtopk": 4.0, "jumprelu": None, "relu": None}
CLASS = {"topk": "TopKSAE", "batchtopk": "JumpReLUSAE", "jumprelu": "JumpReLUSAE",
         "relu": "StandardSAE"}  # fmt: skip
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def rows(batches: int, seed: int = 0) -> list[torch.Tensor]:
    """Rows of a 4-dimensional mixture, far from unit scale (the normalisation matters)."""
    basis = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    return [
        5.0 * torch.relu(torch.randn(ROWS, 4, generator=generator)) @ basis
        + 0.1 * torch.randn(ROWS, D_IN, generator=generator)
        for _ in range(batches)
    ]


def trained(architecture: str) -> SparseAutoencoder:
    module = SAEModule(D_IN, D_SAE, architecture, K[architecture], lr=1e-2,
                       normalize_batches=2, sparsity_coefficient=1e-3,
                       jumprelu_init_threshold=0.05)  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(module, DataLoader(rows(14), batch_size=None))
    sae = module.sae.eval()
    assert float(sae.input_scale) != 1.0
    if architecture == "batchtopk":
        assert float(sae.topk_threshold) > 0
    return sae


@pytest.mark.parametrize("architecture", list(K))
def test_saelens_loads_what_we_save(tmp_path, architecture) -> None:
    ours = trained(architecture)
    path = save_saelens(ours, tmp_path / "sae", sparsity=torch.full((D_SAE,), -3.0))
    theirs = sae_lens.SAE.load_from_disk(path)
    assert type(theirs).__name__ == CLASS[architecture]
    if architecture == "topk":
        assert theirs.cfg.k == 4
    x = torch.cat(rows(2, seed=1))
    with torch.no_grad():
        latents = ours.encode(x)
        assert (latents != 0).any() and (latents == 0).any()
        torch.testing.assert_close(theirs.encode(x), latents, **TOLERANCE)
        torch.testing.assert_close(theirs.decode(latents), ours.decode(latents), **TOLERANCE)
        torch.testing.assert_close(theirs(x), ours(x), **TOLERANCE)


def saelens_training_sae(architecture: str) -> Any:
    from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig
    from sae_lens.saes.jumprelu_sae import JumpReLUTrainingSAE, JumpReLUTrainingSAEConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig

    common = {"d_in": D_IN, "d_sae": D_SAE, "dtype": "float32"}
    if architecture == "topk":
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(k=4, **common))
    elif architecture == "batchtopk":
        sae = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(k=4, **common))
    elif architecture == "jumprelu":
        sae = JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(**common))
    else:
        sae = StandardTrainingSAE(StandardTrainingSAEConfig(**common))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # trained-looking: no bias zero, decoder rows of varied norms
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            value = getattr(sae, name)
            value.add_(0.3 * torch.randn(value.shape, generator=generator))
        sae.W_dec.mul_(torch.rand(D_SAE, 1, generator=generator) + 0.5)
        if architecture == "jumprelu":
            sae.threshold.copy_(0.3 * torch.rand(D_SAE, generator=generator))
        if architecture == "batchtopk":
            sae.topk_threshold.fill_(0.4)
    return sae


@pytest.mark.parametrize("save", ["save_inference_model", "save_model"])
@pytest.mark.parametrize("architecture", list(K))
def test_we_load_what_saelens_saves(tmp_path, architecture, save) -> None:
    theirs = saelens_training_sae(architecture)
    getattr(theirs, save)(tmp_path / "sae")
    ours = load_saelens(tmp_path / "sae")
    if save == "save_inference_model":
        theirs = sae_lens.SAE.load_from_disk(tmp_path / "sae")  # what SAELens itself reads
        ours.eval()  # a BatchTopK is saved as its JumpReLU
    else:
        assert ours.architecture == architecture
        ours.train(architecture == "batchtopk")  # SAELens' training SAE selects over the batch
    x = torch.cat(rows(2, seed=3)) / 5
    with torch.no_grad():
        latents = theirs.encode(x)
        assert (latents != 0).any() and (latents == 0).any()
        torch.testing.assert_close(ours.encode(x), latents, **TOLERANCE)
        torch.testing.assert_close(ours.decode(latents), theirs.decode(latents), **TOLERANCE)
