"""A shard file: the dtypes it holds and its safetensors serializer, straight from memory.

A shard is a plain safetensors file. :func:`write_safetensors` writes one from the
tensors' own memory (no serialized copy) and computes its CRC-32 on the way, for the
ledger record (see :mod:`lightning_iocatch.store.commits`).

**Scaled fp8.** A key stored in an 8-bit float dtype (:data:`SCALED_DTYPES`) is stored
with a float32 scale per row, the tensor :func:`scale_name` beside it in the same shard
(``b{j}.scale/{key}``, a name no key's tensor ``b{j}/{key}`` can have): a row (the
tensor's first dimension; a 0-d tensor is one row) is stored as ``x / scale`` with
``scale = max|x| / max`` of the row's finite values, ``max`` the format's largest value
(448 for ``float8_e4m3fn``), and read as ``stored * scale`` (:func:`dequantize`). A row of
zeros gets scale 1 (read back as exact zeros); values saturate at ``±max``, never overflow.
A NaN is stored as NaN; an infinity as infinity where the format has one
(``float8_e5m2``), else as NaN (``float8_e4m3fn`` has none, and torch's cast would
saturate it to 448 silently); the row's other values keep their scale. The rule is
recorded in the shard's metadata and its record (``scaled``: key -> ``"row"``). A row
holding a float64 value beyond float32's range is refused (:class:`StoreError`): it is read
in float32. A key whose rows are single values is stored as float32, unscaled
(:func:`unscaled`): a 4-byte scale per 1-byte value would outweigh it.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np
import torch

from lightning_iocatch.errors import StoreError

__all__ = [
    "READABLE_CODES",
    "SCALED_DTYPES",
    "SCALE_RULE",
    "STORABLE_DTYPES",
    "dequantize",
    "dtype_name",
    "quantize",
    "scale_name",
    "unscaled",
    "write_all",
    "write_safetensors",
]

STORABLE_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
"""The dtypes a store holds, with their safetensors names (safetensors has no complex128)."""

READABLE_CODES: dict[str, torch.dtype] = {code: dtype for dtype, code in STORABLE_DTYPES.items()}
"""Every safetensors dtype code a store's shards are read with: those written, and
``F8_E8M0`` (read, never written), where this torch has it."""
if hasattr(torch, "float8_e8m0fnu"):
    READABLE_CODES["F8_E8M0"] = torch.float8_e8m0fnu


SCALED_DTYPES = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)
"""The storage dtypes stored with a float32 scale per row (see the module docstring)."""

_HAS_INFINITY = frozenset({torch.float8_e5m2})

SCALE_RULE = "row"
"""How a record names the rule of :func:`quantize`: a scale per row, ``max|x| / max``."""


def scale_name(position: int, key: str) -> str:
    """The name of the scales of ``key`` in batch ``position`` of a shard."""
    return f"b{position}.scale/{key}"


def quantize(
    tensor: torch.Tensor, dtype: torch.dtype, key: str = "tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (floating) as ``dtype`` (one of :data:`SCALED_DTYPES`) and its float32
    scale per row (see the module docstring), on ``tensor``'s device. A row holding a value
    beyond float32's range (float64 only), which it would be read in, is refused with a
    :class:`StoreError` naming ``key`` and the value.

    Example:
        >>> stored, scale = quantize(torch.tensor([[896.0, -1.0], [0.0, 0.0]]), torch.float8_e4m3fn)
        >>> scale.tolist(), dequantize(stored, scale, torch.float32).tolist()
        ([2.0, 1.0], [[896.0, -1.0], [0.0, 0.0]])
    """
    largest = torch.finfo(dtype).max
    rows = tensor.reshape(_rows_of(tensor.shape))
    wide = rows.to(torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    peak = wide.abs().amax(1) if wide.numel() else wide.new_zeros(len(wide))
    finite = None  # every value finite: the common case, checked on the peaks alone
    if not bool(torch.isfinite(peak).all()):
        finite = torch.isfinite(wide)
        peak = torch.where(finite, wide.abs(), 0).amax(1)
    scale = torch.where(peak > 0, peak / largest, 1.0).to(torch.float32)
    _check_range(peak, dtype, key)
    scale = torch.where(scale > 0, scale, torch.finfo(torch.float32).tiny)  # underflowed
    scaled = (wide / scale.to(wide.dtype)[:, None]).clamp_(-largest, largest)
    if finite is not None:
        scaled = torch.where(finite, scaled, wide)  # NaN and infinities as they are
    stored = _to_float8(scaled, dtype, finite=finite is None)  # no infinity: NaN
    return stored.reshape(tensor.shape), scale.reshape(tensor.shape[:1])


def unscaled(tensor: torch.Tensor, dtype: torch.dtype, key: str = "tensor") -> torch.Tensor:
    """``tensor`` (floating, rows of one value) as float32, where a store in ``dtype`` (one
    of :data:`SCALED_DTYPES`) keeps it: a value beyond float32 refused as by :func:`quantize`."""
    if tensor.dtype == torch.float64 and tensor.numel():
        wide = tensor.reshape(-1, 1)
        _check_range(torch.where(torch.isfinite(wide), wide.abs(), 0).amax(1), dtype, key)
    return tensor.to(torch.float32)


def _check_range(peak: torch.Tensor, dtype: torch.dtype, key: str) -> None:
    """Refuse a row whose largest finite value ``peak`` is beyond float32 (read in it)."""
    highest = torch.finfo(torch.float32).max
    if bool((peak > highest).any()):  # float64 only
        row = int((peak > highest).nonzero()[0])
        raise StoreError(
            f"cannot store {key!r} in {dtype_name(dtype)}: row {row} holds "
            f"{float(peak[row]):.4g}, beyond {highest:.4g}, the largest float32 (a scaled "
            "row is read in float32); store it with FeatureWriter(dtype=None), as captured, "
            "or bring its values down in the model"
        )


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``stored`` (a :data:`SCALED_DTYPES` tensor) with their ``scale`` per
    row applied, computed in float32 and returned as the floating ``dtype``.

    On the CPU the bytes are widened two at a time by a look-up in a table of the 65,536
    pairs of values of the dtype (torch's own cast of each byte, NaNs included: the same
    bits), about eight times faster than torch's cast (one byte at a time where their
    number is odd); the product with the scale is float32's, as on other devices.
    """
    shape = _rows_of(stored.shape)
    if stored.device.type == "cpu" and scale.device.type == "cpu":
        codes = np.ascontiguousarray(stored.reshape(shape).view(torch.uint8).numpy())
        if codes.size % 2:
            values = np.take(_float32_table(stored.dtype), codes)
        else:  # two codes a look-up: the table's entry is their two float32 values
            pairs = np.take(_pair_table(stored.dtype), codes.reshape(-1).view(np.uint16))
            values = pairs.view(np.float32).reshape(codes.shape)
        with np.errstate(all="ignore"):  # NaN, infinity and overflow as torch's, silently
            values *= scale.reshape(-1, 1).to(torch.float32).numpy()
        rows = torch.from_numpy(values)
    else:
        rows = stored.to(torch.float32).reshape(shape) * scale.reshape(-1)[:, None]
    return rows.reshape(stored.shape).to(dtype)


@functools.cache
def _pair_table(dtype: torch.dtype) -> np.ndarray:
    """For each two bytes read as one native ``uint16``, their two float32 values of the
    8-bit float ``dtype`` in memory order, as one ``uint64`` (a table of 512 KiB)."""
    single = _float32_table(dtype)
    pair = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)  # memory order
    table = np.take(single, pair).view(np.uint64).reshape(-1)
    table.flags.writeable = False
    return table


@functools.cache
def _float32_table(dtype: torch.dtype) -> np.ndarray:
    """The float32 value of each of the 256 bytes of the 8-bit float ``dtype``, by torch."""
    table = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()
    table.flags.writeable = False
    return table


def _to_float8(values: torch.Tensor, dtype: torch.dtype, *, finite: bool = False) -> torch.Tensor:
    """``values`` (within ``dtype``'s range, or not finite) as ``dtype``; an infinity is NaN
    where ``dtype`` has none (torch's cast would saturate it to the largest value).
    ``finite``: the caller knows every value is finite."""
    if dtype in _HAS_INFINITY or finite:
        return values.to(dtype)
    return torch.where(torch.isinf(values), torch.nan, values).to(dtype)


def _rows_of(shape: torch.Size) -> tuple[int, int]:
    """A shape as (rows, values per row): its first dimension is the rows; 0-d is one row."""
    return (1, 1) if not shape else (shape[0], math.prod(shape[1:]))


def dtype_name(dtype: torch.dtype) -> str:
    """The name a ledger record gives ``dtype`` (``"float32"`` for ``torch.float32``)."""
    return str(dtype).removeprefix("torch.")


def write_all(handle: IO[bytes], data: bytes | memoryview) -> None:
    """Write all of ``data`` to an unbuffered ``handle`` (which may write less per call)."""
    view = memoryview(data)
    while view:
        written = handle.write(view)
        view = view[written or 0 :]


def write_safetensors(
    handle: IO[bytes],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    chunk_bytes: int,
    before_chunk: Callable[[], None],
) -> tuple[int, int]:
    """Write ``tensors`` as a safetensors file to ``handle``; return its CRC-32 and size.

    The tensors must be on the CPU, of :data:`STORABLE_DTYPES`. The data is
    written straight from their memory, largest element size first so that every tensor
    is aligned, ``chunk_bytes`` at a time with a call to ``before_chunk`` before each (it
    may raise to stop the write); the CRC-32 is that of the file's bytes, computed on the
    way.
    """
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": STORABLE_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    crc = zlib.crc32(head)
    write_all(handle, head)
    for name in order:
        data = tensors[name].reshape(-1).view(torch.uint8).numpy().data
        for start in range(0, len(data), chunk_bytes):
            before_chunk()
            chunk = data[start : start + chunk_bytes]
            crc = zlib.crc32(chunk, crc)
            write_all(handle, chunk)
    return crc, len(head) + offset
