"""What an SAE's training counts across processes: rows, the latents that fired, the
input norms of the normalisation, and the sums behind the reconstruction figures.

Every count is of the whole batch (all processes' rows, reduced with the strategy's own
collectives), so that two processes keep the numbers one process would.

Examples:
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> sums = reconstruction_sums(x, x * 0.5, torch.tensor([[1.0, 0.0], [2.0, 3.0]]))
    >>> figures = reconstruction_figures(sums)
    >>> round(figures["mse"], 3), round(figures["l0"], 3), round(figures["explained_variance"], 3)
    (0.25, 1.5, 0.5)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_iocatch.token_mask import real_tokens

__all__ = ["batch_rows", "reconstruction_figures", "reconstruction_sums"]


def reconstruction_sums(x: Tensor, reconstruction: Tensor, latents: Tensor) -> Tensor:
    """One float64 vector of the sums a batch adds to the figures (sums of processes add
    up): rows, squared error, ``|x|^2``, active latents, then ``x`` per input."""
    x, error = x.double(), (reconstruction.double() - x.double()).pow(2).sum()
    head = torch.stack(
        [
            x.new_tensor(float(x.shape[0])),
            error,
            x.pow(2).sum(),
            (latents != 0).sum().double(),
        ]
    )
    return torch.cat([head, x.sum(0)])


def reconstruction_figures(sums: Tensor) -> dict[str, float]:
    """``mse`` (squared error per row, summed over inputs, as the loss), ``normalized_mse``
    (over ``|x|^2``), ``explained_variance`` (1 - squared error over ``|x - mean|^2``,
    SAELens' ``explained_variance``) and ``l0`` (active latents per row)."""
    rows, error, energy, active = (float(value) for value in sums[:4])
    if rows == 0:
        return {}
    spread = energy - float(sums[4:].pow(2).sum()) / rows
    return {
        "mse": error / rows,
        "normalized_mse": error / energy if energy else float("nan"),
        "explained_variance": 1 - error / spread if spread else float("nan"),
        "l0": active / rows,
    }


def batch_rows(batch: Any, key: str | None, d_in: int, kept: list[bool] | None = None) -> Tensor:
    """The rows of a batch: a tensor, the one under ``key`` of a dict (or its one floating
    tensor), or a tuple's first item; ``(rows, d_in)``. A ``(batch, seq, d_in)`` tensor of a
    dict with an ``attention_mask`` gives its real tokens only; ``kept``: only these
    samples (the first dimension)."""
    found = batch
    if isinstance(batch, Mapping):
        if key is not None:
            found = batch[key]
        else:
            tensors = [value for value in batch.values() if isinstance(value, Tensor)
                       and value.is_floating_point()]  # fmt: skip
            if len(tensors) != 1:
                raise ValueError(
                    f"SAEModule: the batch holds {sorted(batch)}: name the rows' key "
                    "with SAEModule(key=...)"
                )
            found = tensors[0]
    elif isinstance(batch, Sequence) and not isinstance(batch, Tensor):
        found = batch[0]
    if not isinstance(found, Tensor) or found.shape[-1] != d_in:
        shown = tuple(found.shape) if isinstance(found, Tensor) else type(found).__name__
        raise ValueError(f"SAEModule: rows of width d_in={d_in} expected, got {shown}")
    mask = real_tokens(batch, "SAEModule") if found.dim() == 3 else None
    if mask is not None and tuple(mask.shape) == tuple(found.shape[:2]):
        mask = mask.to(found.device)
    else:
        mask = None
    if kept is not None:
        chosen = torch.tensor(kept, device=found.device)
        found = found[chosen]
        mask = None if mask is None else mask[chosen]
    return found[mask] if mask is not None else found.reshape(-1, d_in)
