"""The training losses of a :class:`~lightning_iocatch.sae.SparseAutoencoder`, as SAELens 6
defines them: the squared error summed over inputs and averaged over rows, the
auxiliary-k loss of TopK and BatchTopK, the L1 penalty of ReLU, the L0 penalty of
JumpReLU.

Each mean over rows is over the whole batch, every process's rows: processes whose
gradients are averaged (DDP, FSDP) give the gradient of one process over the batch, also
when their shares differ.

Examples:
    >>> sae = SparseAutoencoder(4, 8, "relu", generator=torch.Generator().manual_seed(0))
    >>> x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    >>> step = training_losses(sae, sae.scaled(x), dead=None, sparsity=1.0)
    >>> sorted(step.losses), step.loss.shape
    (['l1_loss', 'mse_loss'], torch.Size([]))
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_iocatch.sae.activations import Across, Step
from lightning_iocatch.sae.model import SparseAutoencoder
from lightning_iocatch.sae.sparse_decode import Chosen

__all__ = ["TrainingObjective", "TrainingStep", "aux_k_loss", "training_losses"]


class TrainingStep(NamedTuple):
    """One step's ``loss`` (to backpropagate), its parts by name, the latents, the
    pre-activations and the reconstruction (of the scaled inputs)."""

    loss: Tensor
    losses: dict[str, Tensor]
    latents: Tensor
    pre: Tensor
    reconstruction: Tensor


def training_losses(
    sae: SparseAutoencoder,
    scaled: Tensor,
    *,
    dead: Tensor | None,
    sparsity: float = 0.0,
    aux_k_coefficient: float = 1.0,
    across: Across | None = None,
    saelens_arithmetic: bool = False,
) -> TrainingStep:
    """The losses of one batch of scaled inputs ``(rows, d_in)``.

    Args:
        dead: the latents that count as dead (TopK and BatchTopK's auxiliary loss), or
            ``None``.
        sparsity: the L1 (ReLU) or L0 (JumpReLU) coefficient of this step.
        aux_k_coefficient: the auxiliary loss's coefficient.
        across: the batch spans processes: its rows in all (the means divide by them)
            and the gather BatchTopK selects over.
        saelens_arithmetic: compute with SAELens' own products, bit for bit: a dense
            decode of the latents and ``b_dec`` subtracted before the encoder. By default
            the same losses with fewer operations, equal to float rounding: TopK's and
            BatchTopK's decodes (the auxiliary loss's too) from their non-zero latents
            (:meth:`~lightning_iocatch.sae.SparseAutoencoder.decode_chosen`), ``b_dec``'s
            gradient through the encoder as a vector product
            (``pre_activations(b_dec_vector_gradient=True)``: SAELens' pre-activations
            exactly); the latents returned then carry no gradient.
    """
    share = (scaled.shape[0], 1) if across is None else (across.rows, across.world)
    pre = sae.pre_activations(scaled, b_dec_vector_gradient=not saelens_arithmetic)
    chosen = None if saelens_arithmetic else sae.choose(pre, across)
    if chosen is None:
        latents = sae.activate(pre, across)
        reconstruction = sae.decode_scaled(latents)
    else:
        latents = chosen.dense(sae.d_sae)
        reconstruction = sae.decode_chosen(chosen)
    error = torch.nn.functional.mse_loss(reconstruction, scaled, reduction="none")
    mse = _row_mean(error.sum(-1), share)
    losses = {"mse_loss": mse}
    if sae.architecture in ("topk", "batchtopk"):
        losses["auxiliary_reconstruction_loss"] = aux_k_loss(
            sae, scaled, reconstruction, pre, dead, share, aux_k_coefficient,
            sparse=not saelens_arithmetic,
        )  # fmt: skip
    elif sae.architecture == "relu":
        norms = sae.W_dec.norm(dim=1)
        losses["l1_loss"] = _row_mean(sparsity * (latents * norms).norm(p=1, dim=-1), share)
    else:
        steps = Step.apply(pre, sae.threshold.to(pre.dtype), sae.bandwidth)
        losses["l0_loss"] = _row_mean(sparsity * torch.sum(steps, dim=-1), share)
    loss = mse
    for name, part in losses.items():
        if name != "mse_loss":
            loss = loss + part
    return TrainingStep(loss, losses, latents, pre, reconstruction)


def aux_k_loss(
    sae: SparseAutoencoder,
    scaled: Tensor,
    reconstruction: Tensor,
    pre: Tensor,
    dead: Tensor | None,
    share: tuple[int, int],
    coefficient: float = 1.0,
    sparse: bool = False,
) -> Tensor:
    """The dead latents' reconstruction of what the live ones leave: the top
    ``k_aux = d_in // 2`` dead pre-activations of each row, decoded without ``b_dec``,
    against the residual, scaled by ``min(n_dead / k_aux, 1)`` (Gao et al., appendix
    B.1; SAELens 6). The top ones are chosen among the dead latents' columns only (the
    entries SAELens' top-k over all latents, with the live ones at ``-inf``, takes);
    ``sparse``: decoded from those entries alone (equal to float rounding)."""
    if dead is None or not bool(dead.any()):
        return reconstruction.new_tensor(0.0)
    dead_latents = dead.nonzero().squeeze(1)
    n_dead = dead_latents.numel()
    residual = (scaled - reconstruction).detach()
    k_aux = scaled.shape[-1] // 2
    scale = min(n_dead / k_aux, 1.0)
    top = pre.index_select(-1, dead_latents).topk(min(k_aux, n_dead), sorted=False)
    indices = dead_latents[top.indices]
    if sparse:
        decoded = sae.decode_chosen(Chosen.of_rows(indices, top.values), bias=False)
    else:
        acts = torch.zeros_like(pre).scatter_(-1, indices, top.values)
        decoded = sae.decode_scaled(acts, bias=False)
    error = (decoded - residual).pow(2).sum(dim=-1)
    return coefficient * scale * _row_mean(error, share)


def _row_mean(per_row: Tensor, share: tuple[int, int]) -> Tensor:
    """This process's part of the mean of ``per_row`` over the whole batch's rows, for
    gradients averaged over the processes (DDP, FSDP): ``share`` is ``(rows in all,
    processes)``; the plain ``mean`` where every process has as many rows."""
    rows, world = share
    if per_row.shape[0] * world == rows:
        return per_row.mean()
    return per_row.sum() * world / rows


class TrainingObjective(nn.Module):
    """An SAE whose ``forward`` is :func:`training_losses` of its scaled inputs: the module
    a strategy wraps (FSDP2 gathers the parameters around this forward), holding the SAE
    as ``.sae``; ``saelens_arithmetic``: :func:`training_losses`'."""

    def __init__(self, sae: SparseAutoencoder, saelens_arithmetic: bool = False) -> None:
        super().__init__()
        self.sae = sae
        self.saelens_arithmetic = saelens_arithmetic

    def forward(
        self,
        x: Tensor,
        *,
        dead: Tensor | None = None,
        sparsity: float = 0.0,
        aux_k_coefficient: float = 1.0,
        across: Across | None = None,
    ) -> TrainingStep:
        """The losses of the rows ``x`` at their own scale (scaled here)."""
        return training_losses(
            self.sae,
            self.sae.scaled(x),
            dead=dead,
            sparsity=sparsity,
            aux_k_coefficient=aux_k_coefficient,
            across=across,
            saelens_arithmetic=self.saelens_arithmetic,
        )
