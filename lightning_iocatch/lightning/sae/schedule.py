"""The learning rate and sparsity coefficient over steps, as SAELens 6 schedules them (the
same factors; SAELens computes the cosine recursively, 1e-15 apart at most):
a linear warmup from ``lr / warmup`` to ``lr`` over ``warmup`` steps, then constant or a
cosine to ``lr_end``, then a linear decay from ``lr_end`` to 0 over the last ``decay``
steps; the sparsity coefficient rising linearly from 0 over its own warmup.

The factor is a function of the step alone (a ``LambdaLR``), so a resumed run picks it
up from the step Lightning restores.

Examples:
    >>> factor = lr_factor(warmup=4, decay=0, total=10, schedule="constant", end_ratio=0.1)
    >>> [round(factor(step), 3) for step in (0, 1, 3, 4, 9)]
    [0.25, 0.5, 1.0, 1.0, 1.0]
    >>> sparsity_factor(2, warmup=4), sparsity_factor(9, warmup=4)
    (0.5, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

__all__ = ["Schedule", "lr_factor", "sparsity_factor"]

Schedule = Literal["constant", "cosine"]


def lr_factor(
    *, warmup: int, decay: int, total: int | None, schedule: Schedule, end_ratio: float
) -> Callable[[int], float]:
    """The learning rate's factor at each optimizer step (0 first). ``total`` steps are
    needed for a cosine or a decay (where they end); ``end_ratio`` is ``lr_end / lr``."""
    if (schedule == "cosine" or decay) and total is None:
        raise ValueError(
            "a cosine schedule or a decay needs the number of steps: give `total_steps` "
            "(or Trainer(max_steps=...))"
        )
    last = 0 if total is None else total
    main = last - warmup - decay

    def factor(step: int) -> float:
        if step < warmup:  # SAELens: LinearLR(1 / warmup -> 1 over warmup - 1 steps)
            return 1 / warmup + (1 - 1 / warmup) * step / max(warmup - 1, 1)
        if decay and step >= last - decay:  # 0 from the last step on, as LinearLR stays
            return end_ratio * max(0.0, 1 - (step - (last - decay)) / decay)
        if schedule == "cosine":
            into = min(step - warmup, main)  # held at lr_end after the cosine's end
            return end_ratio + (1 - end_ratio) * (1 + math.cos(math.pi * into / max(main, 1))) / 2
        return 1.0

    return factor


def sparsity_factor(step: int, *, warmup: int) -> float:
    """The sparsity coefficient's factor at ``step``: ``step / warmup`` up to 1."""
    return 1.0 if step >= warmup else step / warmup
