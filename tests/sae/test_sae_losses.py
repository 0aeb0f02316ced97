"""training_losses against NumPy float64 written from SAELens 6's definitions, and its
``across`` form against the one-process gradient.

Each architecture's losses (the squared error summed over inputs and averaged over rows;
TopK and BatchTopK's auxiliary-k loss of the dead latents, decoded without ``b_dec``;
ReLU's L1 of latents times decoder norms; JumpReLU's L0) are recomputed in NumPy. For
uneven shares of a batch over 2 and 3 simulated processes, the mean of the processes'
gradients (what DDP applies) equals the gradient of the whole batch in one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_iocatch.sae import TrainingObjective, training_losses
from tests.sae.test_sae_model import D_IN, D_SAE, numpy_weights, simulated_ranks, trained_looking

K = {"topk": 3, "batchtopk": 2.5, "jumprelu": None, "relu": None}


def numpy_losses(sae, scaled: np.ndarray, dead: np.ndarray | None, sparsity: float, aux: float):
    """The losses SAELens 6 defines, for float64 rows already scaled."""
    w = numpy_weights(sae)
    norms = np.linalg.norm(w["W_dec"], axis=1)
    pre = (scaled - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if sae.scale_by_decoder_norm:
        pre = pre * norms
    if sae.architecture == "topk":
        latents = np.zeros_like(pre)
        for row, values in enumerate(pre):
            chosen = np.argsort(-values)[: sae.k]
            latents[row, chosen] = np.maximum(values[chosen], 0)
    elif sae.architecture == "batchtopk":
        acts = np.maximum(pre, 0)
        cut = np.sort(acts.ravel())[::-1][int(sae.k * len(pre)) - 1]
        latents = acts * (acts >= cut)
    elif sae.architecture == "jumprelu":
        latents = pre * (pre > w["threshold"])
    else:
        latents = np.maximum(pre, 0)

    def decoded(acts: np.ndarray) -> np.ndarray:
        return (acts / norms if sae.scale_by_decoder_norm else acts) @ w["W_dec"]

    reconstruction = decoded(latents) + w["b_dec"]
    losses = {"mse_loss": ((reconstruction - scaled) ** 2).sum(1).mean()}
    if sae.architecture in ("topk", "batchtopk"):
        n_dead = 0 if dead is None else int(dead.sum())
        value = 0.0
        if n_dead:
            k_aux = scaled.shape[1] // 2
            scale = min(n_dead / k_aux, 1.0)
            residual = scaled - reconstruction
            dead_pre = np.where(dead[None], pre, -np.inf)
            acts = np.zeros_like(pre)
            for row, values in enumerate(dead_pre):
                chosen = np.argsort(-values)[: min(k_aux, n_dead)]
                acts[row, chosen] = values[chosen]
            value = aux * scale * ((decoded(acts) - residual) ** 2).sum(1).mean()
        losses["auxiliary_reconstruction_loss"] = value
    elif sae.architecture == "relu":
        losses["l1_loss"] = sparsity * (latents * norms).sum(1).mean()
    else:
        losses["l0_loss"] = sparsity * (pre > w["threshold"]).sum(1).mean()
    return losses, latents, reconstruction


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, D_IN, dtype=torch.float64) * 1.5


@pytest.mark.parametrize("architecture", list(K))
@pytest.mark.parametrize("n_dead", [0, 2, 9])  # none, fewer than d_in // 2, more
def test_losses_match_numpy(architecture, n_dead) -> None:
    sae = trained_looking(architecture, K[architecture])
    scaled = sae.scaled(rows(7))
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[torch.randperm(D_SAE)[:n_dead]] = True
    step = training_losses(sae, scaled, dead=dead, sparsity=0.7, aux_k_coefficient=1.3)
    truth, latents, reconstruction = numpy_losses(sae, scaled.numpy(), dead.numpy(), 0.7, 1.3)
    assert sorted(step.losses) == sorted(truth)
    for name, value in truth.items():
        np.testing.assert_allclose(float(step.losses[name].detach()), value, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(float(step.loss.detach()), sum(truth.values()), rtol=1e-12)
    np.testing.assert_allclose(step.latents.detach().numpy(), latents, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(step.reconstruction.detach().numpy(), reconstruction, rtol=1e-12)
    if architecture in ("topk", "batchtopk") and n_dead:
        assert float(step.losses["auxiliary_reconstruction_loss"].detach()) > 0


def test_no_dead_mask_gives_a_zero_auxiliary_loss() -> None:
    sae = trained_looking("topk", 3)
    step = training_losses(sae, sae.scaled(rows(5)), dead=None)
    assert float(step.losses["auxiliary_reconstruction_loss"].detach()) == 0.0


def test_objective_scales_its_rows() -> None:
    sae = trained_looking("relu", None, scale=3.0)
    x = rows(5)
    step = TrainingObjective(sae)(x, sparsity=0.5)
    truth, _, _ = numpy_losses(sae, 3.0 * x.numpy(), None, 0.5, 1.0)
    np.testing.assert_allclose(
        float(step.losses["mse_loss"].detach()), truth["mse_loss"], rtol=1e-12
    )
    np.testing.assert_allclose(float(step.losses["l1_loss"].detach()), truth["l1_loss"], rtol=1e-12)


def gradients(sae, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in sae.parameters()]
    return list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))


@pytest.mark.parametrize("architecture", list(K))
@pytest.mark.parametrize("sizes", [(3, 7), (1, 4, 6), (5, 5)])
def test_averaged_process_gradients_are_the_one_process_gradient(architecture, sizes) -> None:
    sae = trained_looking(architecture, K[architecture])
    if architecture == "jumprelu":  # thresholds near the pre-activations: a kernel gradient
        with torch.no_grad():
            sae.threshold.copy_(torch.rand(D_SAE) * 0.3)
    x = rows(sum(sizes))
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::3] = True
    options = {"dead": dead, "sparsity": 0.4}
    whole = gradients(sae, training_losses(sae, sae.scaled(x), **options).loss)

    def rank_gradients(chunk, across):
        return gradients(
            sae, training_losses(sae, sae.scaled(chunk), across=across, **options).loss
        )

    per_rank = simulated_ranks(x.split(list(sizes)), rank_gradients)
    world = len(sizes)
    for name, mine, truth in zip(
        [n for n, _ in sae.named_parameters()], zip(*per_rank, strict=True), whole, strict=True
    ):
        averaged = sum(mine) / world
        assert truth.abs().max() > 0, name
        tight = truth.dtype == torch.float64  # a JumpReLU's threshold is float32 (as SAELens)
        rtol, atol = (1e-10, 1e-12) if tight else (1e-6, 1e-6)
        torch.testing.assert_close(averaged, truth, rtol=rtol, atol=atol, msg=name)
