"""Checks of user arguments at the boundary: one clear error naming the argument.

Examples:
    >>> parse_dtype("dtype", "bfloat16")
    torch.bfloat16
    >>> try:
    ...     parse_dtype("dtype", "fp8")
    ... except ValueError as error:
    ...     print(str(error).split("; ")[1])
    got str ('fp8'): did you mean 'float8_e4m3fn'?
    >>> check_int("max_shard_bytes", True, minimum=1)
    Traceback (most recent call last):
    ...
    TypeError: `max_shard_bytes` must be an int, got bool (True)
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

_FLOATS = [
    name
    for name in dir(torch)
    if isinstance(dtype := getattr(torch, name, None), torch.dtype) and dtype.is_floating_point
]

_WIDE_FLOATS = [name for name in _FLOATS if getattr(torch, name).itemsize > 1]

__all__ = [
    "check_bool",
    "check_int",
    "check_optional_bool",
    "parse_capture_dtype",
    "parse_device",
    "parse_dtype",
    "parse_read_dtype",
]

_CLOSE = {  # names people write for a dtype torch spells otherwise
    "fp8": "float8_e4m3fn",
    "f8": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "fp64": "float64",
    "f64": "float64",
}


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
    """A floating-point ``torch.dtype`` from a dtype or its name (``"float16"``), or ``None``:
    a dtype to store in, 8-bit floats included (a store scales them per row)."""
    return _parse_float(
        name,
        value,
        _FLOATS,
        "'float32', 'float16', 'bfloat16', or to store 'float8_e4m3fn' or 'float8_e5m2' "
        "(scaled per row)",
    )


def parse_capture_dtype(name: str, value: Any) -> torch.dtype | None:
    """:func:`parse_dtype` for the dtype captures are cast to: 8-bit floats refused (a cast
    has no scale: in float8_e4m3fn 1000 would be 448 and 0.0007 would be 0), pointing to
    ``FeatureWriter(dtype=...)``, which scales per row; a misspelt name is matched
    against the other floating dtypes only.

    Examples:
        >>> parse_capture_dtype("dtype", "bfloat16")
        torch.bfloat16
        >>> try:
        ...     parse_capture_dtype("dtype", "flaot16")
        ... except ValueError as error:
        ...     print(str(error).split("; ")[1])
        got str ('flaot16'): did you mean 'float16'?
    """
    parsed = _parse_float(name, value, _WIDE_FLOATS, "'float32', 'float16', 'bfloat16'")
    if parsed is not None and parsed.itemsize == 1:
        short = str(parsed).removeprefix("torch.")
        raise ValueError(
            f"`{name}` {short} is not a capture dtype: an 8-bit float capture would be cast "
            "without a scale (in float8_e4m3fn 1000 becomes 448 and 0.0007 becomes 0). "
            "Capture in float32, bfloat16 or float16, and store 8-bit floats with "
            f"`FeatureWriter(dtype={short!r})`, which scales each row"
        )
    return parsed


def _parse_float(name: str, value: Any, floats: list[str], allowed: str) -> torch.dtype | None:
    """A floating-point dtype from ``value``; a misspelt name gets the close one of
    ``floats`` (the names that may be suggested), the error lists ``allowed``."""
    if value is None:
        return None
    parsed = value
    if isinstance(value, str):
        parsed = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(parsed, torch.dtype) or not parsed.is_floating_point:
        close = ""
        if isinstance(value, str):
            key = value.strip().lower().removeprefix("torch.").replace("-", "_")
            known = _CLOSE.get(key)  # a name people write: that dtype or none
            found = (
                (known if known in floats else None)
                if known
                else next(iter(difflib.get_close_matches(key, floats)), None)
            )
            close = f": did you mean {found!r}?" if found else ""
        raise ValueError(
            f"`{name}` must be a floating-point torch dtype or its name: {allowed}; got "
            f"{_got(value)}{close}"
        )
    return parsed


def parse_read_dtype(name: str, value: Any) -> torch.dtype | None:
    """:func:`parse_dtype` for a dtype to read a store in: 8-bit floats refused (a plain
    cast, without the store's scale per row, would turn 1000 into 448 and 1e-4 into 0).

    Examples:
        >>> parse_read_dtype("dtype", "float16")
        torch.float16
        >>> try:
        ...     parse_read_dtype("dtype", torch.float8_e4m3fn)
        ... except ValueError as error:
        ...     print(str(error).split(". ")[1].split(":")[0])
        Read as float32, bfloat16 or float16
    """
    parsed = parse_dtype(name, value)
    if parsed is not None and parsed.itemsize == 1:
        raise ValueError(
            f"`{name}` {str(parsed).removeprefix('torch.')} cannot be read into: an 8-bit "
            "float has no room for the values of most rows without their scale (1000 would "
            "read 448, 1e-4 would read 0). Read as float32, bfloat16 or float16: a key "
            "stored in 8-bit floats is read dequantized (float32 by default)."
        )
    return parsed
