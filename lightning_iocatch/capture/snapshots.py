"""Snapshots of captured values: detach, private copy, move and cast, keeping structure.

This module is the only place where captured tensors change device or dtype. Two ways:

- :func:`transfer_to_device`: synchronous; what it returns is complete.
- :class:`CaptureTransfer`: what the catcher uses. CUDA tensors bound for the CPU are
  snapshotted on the model's stream and copied asynchronously through a fixed ring of
  pinned memory (:mod:`lightning_iocatch.capture.host_copy`); it returns the pending copies, and
  nothing may read the host tensors before they are waited for (the capture buffer
  does so on every read).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_iocatch.capture.host_copy import CudaOps, HostCopier
from lightning_iocatch.capture.pinned_ring import StagedCopy
from lightning_iocatch.capture.shard_gather import full_value, is_dtensor
from lightning_iocatch.capture.transform import CaptureTransform, Site

__all__ = [
    "CaptureTransfer",
    "NotCaptured",
    "map_tensors",
    "snapshot",
    "transfer_to_device",
]

# Values kept as they are in a capture: immutable, so they cannot change after it.
_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    slice,
    range,
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


@dataclasses.dataclass(frozen=True)
class NotCaptured:
    """Stands in a capture for an object the library does not copy.

    A capture is a snapshot: tensors are copied, and mappings, lists, tuples, namedtuples
    and dataclasses are rebuilt around the copies; immutable values (numbers, strings,
    ``None``, dtypes, devices, enums) are kept. Any other object, such as the cache that
    Hugging Face passes to every decoder layer as ``past_key_values``, is live state of
    the running model that may change right after the capture: it is replaced by this
    placeholder, which names its type.

    Examples:
        >>> class Cache: ...
        >>> snapshot({"x": torch.ones(1), "cache": Cache(), "n": 3})["cache"]
        NotCaptured(type_name='lightning_iocatch.capture.snapshots.Cache')
    """

    type_name: str

    @classmethod
    def of(cls, obj: object) -> NotCaptured:
        kind = type(obj)
        return cls(f"{kind.__module__}.{kind.__qualname__}")


def _keep(obj: Any) -> Any:
    return obj


def map_tensors(
    obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], other: Callable[[Any], Any] = _keep
) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor inside it.

    Recurses through mappings (the mapping type is kept: an ``OrderedDict`` stays one, a
    Hugging Face ``ModelOutput`` stays a ``ModelOutput``), lists, tuples, namedtuples and
    dataclasses; containers are always new objects; anything else becomes ``other(obj)``
    (by default: returned as it is).
    """
    return _map(obj, lambda tensor, _: fn(tensor), other, "")


Leaf = Callable[[torch.Tensor, str], torch.Tensor]


def _map(obj: Any, fn: Leaf, other: Callable[[Any], Any], path: str) -> Any:
    """:func:`map_tensors` with each tensor's path inside ``obj`` (``"/0/hidden"``), as the
    flat keys of :mod:`~lightning_iocatch.capture.keys` spell it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if isinstance(obj, Mapping):
        return _map_mapping(obj, fn, other, path)
    if isinstance(obj, list):
        return type(obj)(_map(v, fn, other, f"{path}/{i}") for i, v in enumerate(obj))
    if isinstance(obj, tuple):
        items = [_map(v, fn, other, f"{path}/{i}") for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_dataclass(obj, fn, other, path)
    return other(obj)


def _placeholder_unless_immutable(obj: Any) -> Any:
    return obj if isinstance(obj, _IMMUTABLE) else NotCaptured.of(obj)


def _map_mapping(
    mapping: Mapping[Any, Any], fn: Leaf, other: Callable[[Any], Any], path: str
) -> Any:
    items = {key: _map(value, fn, other, f"{path}/{key}") for key, value in mapping.items()}
    try:
        result: Any = copy.copy(mapping)
        for key, value in items.items():
            result[key] = value
        return result
    except TypeError:  # immutable mapping types: fall back to a plain dict
        return items


def _map_dataclass(obj: Any, fn: Leaf, other: Callable[[Any], Any], path: str) -> Any:
    result = copy.copy(obj)
    for field in dataclasses.fields(obj):
        value = _map(getattr(obj, field.name), fn, other, f"{path}/{field.name}")
        object.__setattr__(result, field.name, value)  # works for frozen dataclasses too
    return result


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _copy_tensor(
    tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None
) -> torch.Tensor:
    # copy=True: a private copy even when the move and the cast are no-ops (no aliasing).
    return tensor.detach().to(
        device=device or tensor.device, dtype=_target_dtype(tensor, dtype), copy=True
    )


def transfer_to_device(
    obj: Any, device: torch.device | str | None, *, dtype: torch.dtype | None = None
) -> Any:
    """Return a copy of ``obj`` whose tensors are detached, private and on ``device``.

    Structure is kept as :func:`map_tensors` says. Every tensor is detached from
    autograd and copied, also when it is already on ``device`` (or when ``device`` is
    ``None``), so later in-place operations of the model cannot change a captured value.
    ``dtype`` casts floating-point tensors only. Copies from a GPU to the CPU are
    synchronous, so a returned tensor is always complete.

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> out = transfer_to_device({"h": (x * 2,), "n": 3}, "cpu", dtype=torch.float16)
        >>> out["h"][0], out["h"][0].requires_grad, out["n"]
        (tensor([2., 2.], dtype=torch.float16), False, 3)
    """
    return map_tensors(obj, lambda tensor: _copy_tensor(tensor, device, dtype))


def snapshot(
    obj: Any, device: torch.device | str | None = None, *, dtype: torch.dtype | None = None
) -> Any:
    """What a capture keeps of ``obj``: :func:`transfer_to_device`, and a :class:`NotCaptured`
    placeholder for every object that is neither a tensor, a container of the kinds
    :func:`map_tensors` rebuilds, nor an immutable value.
    """
    return map_tensors(
        obj, lambda tensor: _copy_tensor(tensor, device, dtype), _placeholder_unless_immutable
    )


class CaptureTransfer:
    """The catcher's copy of captured values: detached, private, on ``device``, cast.

    CUDA tensors bound for the CPU are copied asynchronously through a fixed ring of
    ``pinned_bytes`` of pinned memory, in a way that cannot race with the model (see
    :mod:`lightning_iocatch.capture.host_copy`); everything else is copied as
    :func:`transfer_to_device` does. ``pinned_bytes=0`` turns the asynchronous path off.
    A call's ``transform`` first changes each tensor on its own device (see
    :mod:`lightning_iocatch.capture.transform`). A DTensor is copied as its whole value
    (``full_tensor()``, a collective of its mesh), never as this process's part.
    """

    def __init__(
        self,
        device: torch.device | None,
        dtype: torch.dtype | None = None,
        *,
        pinned_bytes: int = 256 << 20,
        ops: CudaOps | None = None,
    ) -> None:
        if pinned_bytes < 0:
            raise ValueError(f"`pinned_bytes` must be >= 0, got {pinned_bytes}")
        self.device = device
        self.dtype = dtype
        to_host = device is not None and device.type == "cpu"
        self.host = HostCopier(pinned_bytes, ops) if pinned_bytes and to_host else None

    def __call__(
        self,
        obj: Any,
        transform: CaptureTransform | None = None,
        site: Site | None = None,
    ) -> tuple[Any, list[StagedCopy], list[str]]:
        """``(copy of obj, pending, changed)``: read the copy only once every pending copy is
        waited for; ``changed`` are the paths of the tensors ``transform`` changed (at
        ``site``)."""
        pending: list[StagedCopy] = []
        changed: list[str] = []
        host = self.host

        def copy_one(tensor: torch.Tensor, path: str) -> torch.Tensor:
            if is_dtensor(tensor):  # never a part: a DTensor's whole value (a collective)
                tensor = full_value(tensor)
            if transform is not None and site is not None:
                replaced = transform.capture(tensor.detach(), site)
                if replaced is not None:
                    tensor = replaced
                    changed.append(path)
            dtype = _target_dtype(tensor, self.dtype)
            if host is not None and host.accepts(tensor, dtype):
                return host.copy(tensor, dtype, pending)
            return _copy_tensor(tensor, self.device, self.dtype)

        return _map(obj, copy_one, _placeholder_unless_immutable, ""), pending, changed
