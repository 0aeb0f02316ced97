"""A shard file: the dtypes it holds and its safetensors serializer, straight from memory.

A shard is a plain safetensors file. :func:`write_safetensors` writes one from the
tensors' own memory (no serialized copy) and computes its CRC-32 on the way, for the
ledger record (see :mod:`lightning_iocatch.store.commits`).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

__all__ = ["READABLE_CODES", "STORABLE_DTYPES", "dtype_name", "write_all", "write_safetensors"]

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
