"""The sparse autoencoders' activation functions: TopK, BatchTopK (over a batch that may
span processes), and JumpReLU with its straight-through threshold.

Examples:
    >>> pre = torch.tensor([[3.0, -1.0, 2.0], [0.5, 4.0, 1.0]])
    >>> topk(pre, 1).tolist()
    [[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]]
    >>> batch_topk(pre, 1.5).tolist()  # 3 of the batch's 6 values: 4, 3 and 2
    [[3.0, 0.0, 2.0], [0.0, 4.0, 0.0]]
    >>> JumpReLU.apply(pre.abs(), torch.full((3,), 1.5), 0.05).tolist()
    [[3.0, 0.0, 2.0], [0.0, 4.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["Across", "JumpReLU", "Step", "batch_topk", "batch_topk_mask", "topk"]


def topk(pre: Tensor, k: int) -> Tensor:
    """Each row's ``k`` largest pre-activations, ReLU'd; zero elsewhere (as SAELens' TopK:
    ``topk``, ``relu``, ``scatter`` into zeros)."""
    values, indices = torch.topk(pre, k=k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter_(-1, indices, values.relu())


class Across(NamedTuple):
    """A batch that spans processes: its ``rows`` in all, this process's ``rank`` of
    ``world``, and ``gather``, which gathers a 1-d tensor of the same length from every
    process as ``(world, n)`` in rank order (Lightning's ``strategy.all_gather``)."""

    rows: int
    rank: int
    world: int
    gather: Callable[[Tensor], Tensor]


def batch_topk(pre: Tensor, k: float, across: Across | None = None) -> Tensor:
    """The batch's ``int(k * rows)`` largest ReLU'd pre-activations, zero elsewhere; the
    batch spans the processes ``across`` names, or is this tensor's rows."""
    acts = pre.relu()
    return acts * batch_topk_mask(acts.detach(), k, across)


def batch_topk_mask(acts: Tensor, k: float, across: Across | None = None) -> Tensor:
    """The mask of the ``int(k * rows)`` largest of the non-negative ``acts`` ``(..., U)``
    of the whole batch, ties at the cut taken in the order of the flat batch, a process's
    values after those of lower ranks.

    One process: the entries ``torch.topk`` over the flattened batch takes (as SAELens;
    among ties at the cut, its choice, which it leaves undefined). Several: the values
    each process may contribute (its ``int(k * rows)`` largest) are gathered, the cut is the
    ``int(k * rows)``-th largest of them, and each process keeps its values above the cut
    and the ties that are its own: the entries one process would keep of the whole batch
    stacked in rank order, with one gather of ``int(k * rows)`` values a process."""
    flat = acts.reshape(-1)
    wanted = int(k * (acts.shape[:-1].numel() if across is None else across.rows))
    if wanted <= 0:
        return torch.zeros_like(acts, dtype=torch.bool)
    if across is None:  # as SAELens: the entries torch.topk picks
        picked = torch.topk(flat, min(wanted, flat.numel()), sorted=False).indices
        return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, picked, True).view(acts.shape)
    mine = torch.topk(flat, min(wanted, flat.numel()), sorted=True).values
    padded = torch.full((wanted,), -1.0, dtype=flat.dtype, device=flat.device)
    padded[: mine.numel()] = mine  # below every value (they are ReLU'd): never kept
    table = across.gather(padded)
    everyone = table.reshape(-1)
    cut = torch.topk(everyone, wanted, sorted=True).values[-1]
    before = int((table[: across.rank] == cut).sum())
    mask = flat > cut
    ties = wanted - int((everyone > cut).sum()) - before
    if ties > 0:
        mask[(flat == cut).nonzero().squeeze(1)[:ties]] = True
    return mask.view(acts.shape)


def _above(x: Tensor, threshold: Tensor) -> Tensor:
    """``x > threshold`` as 1.0 or 0.0 in ``x``'s dtype, without a boolean tensor (a pass
    over floats): ``x - threshold`` of two floats is positive exactly where ``x`` is
    larger."""
    return (x - threshold).sign_().relu_()


def _near(x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
    """SAELens' rectangle kernel ``-0.5 < (x - threshold) / bandwidth < 0.5`` as 1.0 or
    0.0: ``0.5 - |u|`` is positive exactly where ``|u| < 0.5``."""
    u = (x - threshold).div_(bandwidth)
    return u.abs_().neg_().add_(0.5).sign_().relu_()


class _StraightThrough(torch.autograd.Function):
    """What JumpReLU and Step keep for their backward: the inputs, the threshold and the
    kernel's bandwidth."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float], output: Tensor) -> None:
        x, threshold, bandwidth = inputs
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth


class JumpReLU(_StraightThrough):
    """``x * (x > threshold)``; the gradient of ``x`` where it passes, and of the
    threshold through a rectangle kernel of ``bandwidth`` (SAELens' and Rajamanoharan et
    al.'s straight-through estimator).

    The masks are SAELens', made as floats without boolean tensors (a boolean pass costs
    several float passes on a CPU), and multiply in SAELens' order: its values bit for
    bit, with IEEE gradual underflow (not under ``torch.set_flush_denormal(True)``)."""

    @staticmethod
    def forward(x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        return x * _above(x, threshold)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        x_grad = grad * _above(x, threshold)
        near = _near(x, threshold, bandwidth)
        threshold_grad = torch.sum(near.mul_(-(threshold / bandwidth)).mul_(grad), dim=0)
        return x_grad, threshold_grad, None


class Step(_StraightThrough):
    """``x > threshold`` as 0 or 1, with the threshold's straight-through gradient: the
    L0 of a JumpReLU, differentiable in its threshold."""

    @staticmethod
    def forward(x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        return _above(x, threshold)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        x, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        near = _near(x, threshold, bandwidth)
        threshold_grad = torch.sum(near.mul_(-(1.0 / bandwidth)).mul_(grad), dim=0)
        return None, threshold_grad, None
