"""The collectives that make a tensor-parallel value whole, and cut it back to a part.

:class:`Layout` says how a local tensor lies on a 1-D tensor-parallel mesh;
:func:`gather` makes it whole, :func:`local_like` and :func:`as_dtensor_like` cut an
edited whole value back to the form the forward continues with. Every function here is a
collective of the mesh (or none): each rank must call it at the same place, and every
check that can refuse is decided from what every rank sees, so that no rank raises alone
while the others wait. Used by :mod:`~lightning_iocatch.capture.sharded`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_iocatch.errors import CaptureError

__all__ = [
    "Layout",
    "as_dtensor_like",
    "declared_size",
    "fingerprint",
    "full_value",
    "gather",
    "gather_sizes",
    "is_dtensor",
    "local_like",
]

Restore = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """How a local tensor lies on the tensor-parallel mesh: its ``placement``, and for a
    ``Shard`` the whole value's size along that dimension where a module tells it (a
    column-split ``Linear``'s ``out_features``): then each rank's part follows torch's
    chunking, as the module's weight was split, and one gather makes it whole; else the
    parts' sizes are gathered first."""

    placement: Any
    size: int | None = None

    @property
    def whole(self) -> bool:
        """Whether a tensor of this layout is the whole value already (``Replicate``)."""
        return bool(self.placement.is_replicate())


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (without importing DTensor where it is not)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "placements")


def full_value(tensor: Any) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor (waited for, if the gather is async)."""
    full = tensor.full_tensor()
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor
    return wait() if callable(wait) else full


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A value's shape and sums in float64, equal on two ranks that hold the same value."""
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    flat = values.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 97 + 1
    shape = torch.zeros(9, dtype=torch.float64, device=flat.device)
    shape[0] = tensor.dim()
    shape[1 : 1 + min(tensor.dim(), 8)] = torch.tensor(tensor.shape[:8], dtype=torch.float64)
    sums = torch.stack([flat.nansum(), (flat * weights).nansum(), flat.isnan().sum()])
    return torch.cat([shape, sums])


def declared_size(module: nn.Module, place: tuple[str, Any], placement: Any) -> int | None:
    """The whole size along a style's ``Shard(-1)`` where the module tells it: a
    ``Linear``'s ``out_features`` (output) or ``in_features`` (input), an ``Embedding``'s
    ``embedding_dim`` (output)."""
    if not placement.is_shard() or placement.dim != -1:
        return None
    if isinstance(module, nn.Linear):
        return module.out_features if place == ("output", 0) else module.in_features
    if isinstance(module, nn.Embedding) and place == ("output", 0):
        return module.embedding_dim
    return None


def gather_sizes(local: torch.Tensor, dim: int, mesh: Any) -> list[int]:
    """Every rank's size along ``dim`` (one small all_gather)."""
    size = torch.tensor([local.shape[dim]], device=local.device)
    every = [torch.empty_like(size) for _ in range(mesh.size())]
    torch.distributed.all_gather(every, size, group=mesh.get_group())
    return [int(s) for s in every]


def chunk_sizes(size: int, ranks: int) -> list[int]:
    """Each rank's part of ``size`` as torch shards it (``torch.chunk``'s rule)."""
    chunk = -(-size // ranks)
    return [max(0, min(chunk, size - r * chunk)) for r in range(ranks)]


def check_sizes(sizes: list[int], layout: Layout, where: str) -> None:
    """Refuse (on every rank alike: ``sizes`` are gathered) parts that do not follow
    torch's chunking of the size the module declares."""
    if layout.size is not None and sizes != chunk_sizes(layout.size, len(sizes)):
        raise CaptureError(
            f"{where}: the ranks hold parts of {sizes} along the sharded dimension, where "
            f"the module's width {layout.size} split as torch splits its weight gives "
            f"{chunk_sizes(layout.size, len(sizes))}: the parallel style and the module "
            "disagree; give the value's placement in `shard_layouts`"
        )


def gather(local: torch.Tensor, mesh: Any, layout: Layout, sizes: list[int]) -> torch.Tensor:
    """The whole value of a local tensor of ``layout`` on the 1-D ``mesh`` whose parts along
    the sharded dimension have ``sizes`` (a ``Partial`` needs none), through DTensor's
    collectives (autograd follows them: an edit's gradient reaches the shards)."""
    from torch.distributed.tensor import DTensor

    placement = layout.placement
    if placement.is_partial():
        return full_value(DTensor.from_local(local, mesh, [placement], run_check=False))
    dim = placement.dim % local.dim()
    largest = max(sizes)
    padded = local
    if local.shape[dim] < largest:  # shards may be uneven (a sequence split over ranks)
        pad = list(local.shape)
        pad[dim] = largest - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=dim)
    shard = type(placement)(dim)
    every = full_value(DTensor.from_local(padded.contiguous(), mesh, [shard], run_check=False))
    parts = every.split(largest, dim=dim)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes, strict=True)], dim)


def local_like(local: torch.Tensor, mesh: Any, layout: Layout, sizes: list[int]) -> Restore:
    """Cut a whole value back to this rank's part, as ``local`` is of its whole."""
    dim = layout.placement.dim % local.dim()
    rank = mesh.get_local_rank()
    start = sum(sizes[:rank])
    return lambda whole: whole.narrow(dim, start, sizes[rank]).contiguous()


def as_dtensor_like(tensor: Any) -> Restore:
    """Cut a whole value back to a DTensor of ``tensor``'s mesh and placements (a
    ``Partial`` one becomes ``Replicate``: the same value, held whole), in a way autograd
    follows (a replicated DTensor redistributed: each rank keeps its part)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = tensor.device_mesh
    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
    replicated = [Replicate()] * len(placements)

    def restore(whole: torch.Tensor) -> torch.Tensor:
        held = DTensor.from_local(whole, mesh, replicated, run_check=False)
        return held.redistribute(mesh, placements)

    return restore
