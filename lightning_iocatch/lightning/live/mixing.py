"""The mixing buffer of live activations: the rows of consecutive forwards pooled until it
holds its capacity, then drawn in a random order in batches.

A fill's order is a function of ``(seed, epoch, rank, fill)`` alone, so the batches of a
fill can be derived again from the same inputs (a resume re-runs the fill's forwards and
skips the batches already trained on) and nothing of the buffer is saved. Every row of a
fill is drawn once; fills do not mix with each other (SAELens' buffer keeps half of its
rows for the next fill; here the capacity alone sets how far rows mix).

Examples:
    >>> rows = {"h": torch.arange(10.0)[:, None], "index": torch.arange(10)}
    >>> parts = split_rows(rows, fill_order(10, seed=0, epoch=0, rank=0, fill=0), batches=3)
    >>> [len(part["index"]) for part in parts]
    [4, 3, 3]
    >>> sorted(torch.cat([part["index"] for part in parts]).tolist()) == list(range(10))
    True
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["fill_order", "split_rows"]


def fill_order(rows: int, *, seed: int, epoch: int, rank: int, fill: int) -> Tensor:
    """The order a fill of ``rows`` rows is drawn in (on the CPU: the same on any device)."""
    text = f"{seed}/{epoch}/{rank}/{fill}".encode()
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8]))
    return torch.randperm(rows, generator=generator)


def split_rows(rows: dict[str, Tensor], order: Tensor, batches: int) -> list[dict[str, Tensor]]:
    """``rows`` (tensors of as many rows) drawn in ``order``, as ``batches`` batches of
    near-equal sizes (their sizes differ by one at most; empty where there are fewer rows
    than batches)."""
    device = next(iter(rows.values())).device
    order = order.to(device)
    count = order.numel()
    sizes = [count // batches + (1 if part < count % batches else 0) for part in range(batches)]
    found, start = [], 0
    for size in sizes:
        taken = order[start : start + size]
        found.append({key: value.index_select(0, taken) for key, value in rows.items()})
        start += size
    return found
