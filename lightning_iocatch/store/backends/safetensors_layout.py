"""Where a shard's tensors lie: a safetensors header parsed once, then read by byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte offsets) and the tensors' bytes. A :class:`Span` is one tensor's
place in the file; both backends keep a shard's spans once read and read rows of a tensor
as one byte range (:func:`row_range`), so a reader of many small pieces of a shard never
parses its header twice.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.shard_file import READABLE_CODES

__all__ = [
    "Span",
    "header_length",
    "header_metadata",
    "parse_header",
    "byte_rows",
    "row_range",
    "row_width",
    "to_tensor",
]


@dataclass(frozen=True, slots=True)
class Span:
    """One tensor: its safetensors dtype code, shape and absolute byte offsets in the file."""

    code: str
    shape: tuple[int, ...]
    start: int
    end: int


def header_length(head: bytes, where: str) -> int:
    """The header's length, from the first 8 bytes of the shard at ``where``."""
    if len(head) < 8:
        raise StoreError(f"shard {where} is corrupted: it has no header")
    return int(struct.unpack("<Q", head[:8])[0])


def parse_header(raw: bytes, size: int, where: str) -> dict[str, Span]:
    """The spans of a shard of ``size`` bytes whose JSON header is ``raw``; damage is a
    :class:`StoreError` naming ``where``."""
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        spans = {}
        base = 8 + len(raw)
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            code, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dtype = READABLE_CODES.get(code)
            if dtype is None:
                raise ValueError(f"{tensor!r} has an unknown dtype {code!r}")
            count = math.prod(int(extent) for extent in shape)
            if not 0 <= start <= end <= size - base or end - start != count * dtype.itemsize:
                raise ValueError(f"{tensor!r} has offsets {[start, end]} that do not fit")
            spans[tensor] = Span(code, shape, base + start, base + end)
    except (ValueError, KeyError, TypeError) as error:
        raise StoreError(f"shard {where} is corrupted: its header is damaged ({error})") from error
    return spans


def header_metadata(raw: bytes, where: str) -> dict[str, str]:
    """The ``__metadata__`` of a shard whose JSON header is ``raw`` (checked by
    :func:`parse_header` first)."""
    try:
        metadata = json.loads(raw.decode("utf-8")).get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("its metadata is not an object")
    except (ValueError, AttributeError) as error:
        raise StoreError(f"shard {where} is corrupted: its header is damaged ({error})") from error
    return metadata


def row_range(span: Span, first: int, stop: int) -> Span:
    """Rows ``[first, stop)`` of the tensor at ``span``, as a span of their own."""
    row = row_width(span)
    shape = (stop - first, *span.shape[1:])
    return Span(span.code, shape, span.start + first * row, span.start + stop * row)


def row_width(span: Span) -> int:
    """The bytes of one row of the tensor at ``span`` (0 for a tensor of no rows)."""
    return (span.end - span.start) // span.shape[0] if span.shape and span.shape[0] else 0


def byte_rows(data: np.ndarray, width: int) -> np.ndarray:
    """A read-only view of ``data`` (bytes) whose row ``i`` is ``data[i : i + width]``: rows at
    any offsets are then gathered in one indexing."""
    rows = len(data) - width + 1
    return np.lib.stride_tricks.as_strided(data, (rows, width), (1, 1), writeable=False)


def to_tensor(raw: bytes | bytearray | memoryview, span: Span) -> torch.Tensor:
    """The tensor of ``span`` from its bytes (copied into memory of its own)."""
    dtype = READABLE_CODES[span.code]
    if not raw:
        return torch.empty(span.shape, dtype=dtype)
    data = raw if isinstance(raw, bytearray) else bytearray(raw)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(span.shape)
