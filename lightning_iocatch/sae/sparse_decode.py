"""Decoding latents from their non-zero entries: TopK's ``k`` of ``d_sae`` a row, the
auxiliary loss's dead latents, a BatchTopK batch's kept values.

``latents @ W_dec`` over a dense ``(rows, d_sae)`` matrix multiplies every zero; with 32 of
1,024 latents a row, 97 % of a decode's multiply-adds and of its backward's. Here the
forward is ``embedding_bag`` (a weighted sum of the chosen decoder rows), and the backward
computes only what is not zero: each chosen entry's gradient (a sampled product) and the
decoder rows' gradient (a sparse product). The sums run in another order than a dense
product's, so the results equal it to float rounding, not bit for bit.

Examples:
    >>> W_dec = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    >>> chosen = Chosen.of_rows(torch.tensor([[2], [0]]), torch.tensor([[1.0], [0.5]]))
    >>> decode(chosen, W_dec).tolist()
    [[3.0, 3.0], [0.5, 0.0]]
    >>> chosen.dense(3).tolist()
    [[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Chosen", "decode"]


class Chosen(NamedTuple):
    """Latents given by their non-zero entries, row by row: row ``r``'s are ``values`` at
    ``latents`` between ``offsets[r]`` and ``offsets[r + 1]`` (``offsets`` has ``rows + 1``
    entries), each row's latents ascending (a compressed sparse row pattern)."""

    offsets: Tensor
    latents: Tensor
    values: Tensor

    @classmethod
    def of_rows(cls, indices: Tensor, values: Tensor) -> Chosen:
        """As many entries in every row: ``indices`` and ``values`` ``(rows, k)`` (what
        ``torch.topk`` gives, in any order)."""
        rows, k = indices.shape
        indices, order = indices.sort(-1)
        offsets = torch.arange(0, rows * k + 1, k, device=indices.device)
        return cls(offsets, indices.reshape(-1), values.gather(-1, order).reshape(-1))

    @classmethod
    def of_mask(cls, values: Tensor, mask: Tensor) -> Chosen:
        """The entries of ``values`` ``(rows, d_sae)`` where ``mask`` is true."""
        rows, cols = mask.nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=mask.shape[0])
        offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.long, device=mask.device)
        offsets[1:] = counts.cumsum(0)
        return cls(offsets, cols, values[rows, cols])

    def rows(self) -> Tensor:
        """The row of each entry."""
        counts = self.offsets.diff()
        rows = torch.arange(counts.numel(), device=counts.device)
        return torch.repeat_interleave(rows, counts, output_size=self.latents.numel())

    def dense(self, d_sae: int) -> Tensor:
        """The ``(rows, d_sae)`` latents, without gradient."""
        out = self.values.new_zeros(self.offsets.numel() - 1, d_sae)
        return out.index_put_((self.rows(), self.latents), self.values.detach())


def decode(chosen: Chosen, W_dec: Tensor) -> Tensor:
    """``chosen``'s dense latents ``@ W_dec`` ``(rows, d_in)``, differentiable in
    ``chosen.values`` and ``W_dec``, in ``W_dec``'s dtype."""
    return _Decode.apply(chosen.values.to(W_dec.dtype), chosen.offsets, chosen.latents, W_dec)


class _Decode(torch.autograd.Function):
    @staticmethod
    def forward(values: Tensor, offsets: Tensor, latents: Tensor, W_dec: Tensor) -> Tensor:
        return F.embedding_bag(latents, W_dec, offsets[:-1], mode="sum", per_sample_weights=values)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, Tensor | None]:
        values, offsets, latents, W_dec = ctx.saved_tensors
        rows, d_sae = offsets.numel() - 1, W_dec.shape[0]
        dtype = W_dec.dtype
        if dtype not in (torch.float32, torch.float64):  # no sparse kernels in half types
            values, W_dec, grad = values.float(), W_dec.float(), grad.float()
        grad = grad.contiguous()
        values_grad = W_grad = None
        if ctx.needs_input_grad[0]:  # each entry's: its row's gradient . its decoder row
            with warnings.catch_warnings():  # "sparse CSR support is in beta", once
                warnings.simplefilter("ignore", UserWarning)
                pattern = torch.sparse_csr_tensor(
                    offsets, latents, torch.zeros_like(values), (rows, d_sae),
                    check_invariants=False,
                )  # fmt: skip
                values_grad = torch.sparse.sampled_addmm(pattern, grad, W_dec.T, beta=0.0)
            values_grad = values_grad.values().to(dtype)
        if ctx.needs_input_grad[3]:  # the decoder rows': latents.T @ grad, sparse
            rows_of = Chosen(offsets, latents, values).rows()
            transposed = torch.sparse_coo_tensor(
                torch.stack([latents, rows_of]), values, (d_sae, rows), check_invariants=False
            )
            W_grad = torch.sparse.mm(transposed, grad).to(dtype)
        return values_grad, None, None, W_grad
