"""Checks of user arguments at the boundary: one clear error naming the argument.

Examples:
    >>> parse_dtype("dtype", "bfloat16")
    torch.bfloat16
    >>> check_int("max_shard_bytes", True, minimum=1)
    Traceback (most recent call last):
    ...
    TypeError: `max_shard_bytes` must be an int, got bool (True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_bool", "check_int", "check_optional_bool", "parse_device", "parse_dtype"]


def _got(value: Any) -> str:
    return f"{type(value).__name__} ({value!r})"


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; a ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {_got(value)}")
    return value


def check_optional_bool(name: str, value: Any) -> bool | None:
    """``value`` if it is a bool or ``None``."""
    return None if value is None else check_bool(name, value)


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {_got(value)}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return value


def parse_device(name: str, value: Any) -> torch.device | None:
    """A ``torch.device`` from a device or its name (``"cpu"``, ``"cuda:0"``), or ``None``."""
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be a torch.device, a device name or None, got {_got(value)}"
        )
    try:
        return torch.device(value)
    except RuntimeError as error:
        raise ValueError(
            f"`{name}` {value!r} is not a device name such as 'cpu' or 'cuda:0'"
        ) from error


def parse_dtype(name: str, value: Any) -> torch.dtype | None:
    """A floating-point ``torch.dtype`` from a dtype or its name (``"float16"``), or ``None``."""
    if value is None:
        return None
    parsed = value
    if isinstance(value, str):
        parsed = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(parsed, torch.dtype) or not parsed.is_floating_point:
        raise ValueError(
            f"`{name}` must be a floating-point torch dtype or its name such as 'float16' or "
            f"'bfloat16', got {_got(value)}"
        )
    return parsed
