"""Copy captured values out of a live forward: detach, clone, move and cast, keeping structure.

This module is the only place where captured tensors change device or dtype.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["transfer_to_device"]


def transfer_to_device(
    obj: Any, device: torch.device | str | None, *, dtype: torch.dtype | None = None
) -> Any:
    """Return a copy of ``obj`` whose tensors are detached, private and on ``device``.

    Recurses through tensors, mappings (the mapping type is kept: an ``OrderedDict``
    stays one, a Hugging Face ``ModelOutput`` stays a ``ModelOutput``), lists, tuples,
    namedtuples and dataclasses; anything else is returned as it is. Every tensor is
    detached from autograd and copied, also when it is already on ``device`` (or when
    ``device`` is ``None``), so later in-place operations of the model cannot change a
    captured value. ``dtype`` casts floating-point tensors only. Copies from a GPU to
    the CPU are synchronous, so a returned tensor is always complete.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> out = transfer_to_device({"h": (x * 2,), "n": 3}, "cpu", dtype=torch.float16)
        >>> out["h"][0], out["h"][0].requires_grad, out["n"]
        (tensor([2., 2.], dtype=torch.float16), False, 3)
    """
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, device, dtype)
    if isinstance(obj, Mapping):
        return _copy_mapping(obj, device, dtype)
    if isinstance(obj, list):
        return type(obj)(transfer_to_device(v, device, dtype=dtype) for v in obj)
    if isinstance(obj, tuple):
        items = [transfer_to_device(v, device, dtype=dtype) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _copy_dataclass(obj, device, dtype)
    return obj


def _copy_tensor(
    tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None
) -> torch.Tensor:
    target_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    # copy=True: a private copy even when the move and the cast are no-ops (no aliasing).
    return tensor.detach().to(device=device or tensor.device, dtype=target_dtype, copy=True)


def _copy_mapping(
    mapping: Mapping[Any, Any], device: torch.device | str | None, dtype: torch.dtype | None
) -> Mapping[Any, Any]:
    items = {key: transfer_to_device(value, device, dtype=dtype) for key, value in mapping.items()}
    try:
        result: Any = copy.copy(mapping)
        for key, value in items.items():
            result[key] = value
        return result
    except TypeError:  # immutable mapping types: fall back to a plain dict
        return items


def _copy_dataclass(obj: Any, device: torch.device | str | None, dtype: torch.dtype | None) -> Any:
    result = copy.copy(obj)
    for field in dataclasses.fields(obj):
        value = transfer_to_device(getattr(obj, field.name), device, dtype=dtype)
        object.__setattr__(result, field.name, value)  # works for frozen dataclasses too
    return result
