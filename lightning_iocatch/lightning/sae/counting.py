"""What an :class:`~lightning_iocatch.lightning.sae.SAEModule` counts each step over every
process's rows, in its buffers (so a checkpoint holds it): the input norms of the
normalisation, the rows since each latent last fired, BatchTopK's running threshold
(``module``: the SAEModule)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["count_fired", "estimate_scale", "update_threshold"]


def estimate_scale(module: Any, x: Tensor) -> None:
    """Counts a batch's row norms; after the last batch of the estimate, sets the SAE's
    ``input_scale`` to ``sqrt(d_in)`` over their mean (SAELens' factor; the norms in
    float64, where SAELens takes them in float32: a relative 1e-8 apart)."""
    norms = x.double().norm(dim=-1)  # float64 from the first operation
    whole = module._whole(torch.stack([norms.sum(), norms.new_tensor(x.shape[0])]))
    module.norm_sum += whole[0]
    module.norm_rows += whole[1].long()
    module._norm_batches += 1
    module.norm_batches.fill_(module._norm_batches)
    if module._norm_batches == module.normalize_batches:
        mean = module.norm_sum / module.norm_rows
        module.sae.input_scale.copy_(module.sae.d_in**0.5 / mean)


def count_fired(module: Any, latents: Tensor, rows: int) -> None:
    """Rows since each latent fired on any process: ``rows`` (the whole batch's) more, 0
    for those that fired."""
    # latents are never negative in training: the largest of each is above 0 where it
    # fired (13 times quicker than (latents != 0).any(0) on a CPU)
    largest = latents.amax(0) if latents.shape[0] else latents.new_zeros(latents.shape[1])
    fired = module._whole((largest > 0).to(torch.int32)) > 0
    module.tokens_since_fired += rows
    module.tokens_since_fired.masked_fill_(fired, 0)


def update_threshold(module: Any, latents: Tensor) -> None:
    """BatchTopK's running threshold: ``(1 - lr) * old + lr * smallest kept value`` of the
    whole batch, in float64; a batch with no positive value leaves it (no device sync)."""
    inf = torch.tensor(float("inf"), dtype=latents.dtype, device=latents.device)
    smallest = torch.where(latents > 0, latents, inf).amin().to(torch.float64)
    if module.trainer.world_size > 1:
        smallest = module.trainer.strategy.reduce(smallest, reduce_op=dist.ReduceOp.MIN)
    lr = module.topk_threshold_lr
    threshold = module.sae.topk_threshold
    moved = (1 - lr) * threshold + lr * smallest
    threshold.copy_(torch.where(torch.isfinite(smallest), moved, threshold))
