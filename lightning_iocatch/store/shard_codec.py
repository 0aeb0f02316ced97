"""A lossless codec over a shard's tensors: blocks of whole rows, each compressed on its own.

A shard written with ``codec="zstd"`` is still a safetensors file, whose tensors are the
coded ones: each tensor ``name`` is stored as a ``U8`` tensor of that name holding its
blocks' zstd frames one after the other. A block is ``rows`` whole rows (the tensor's first
dimension; a 0-d tensor is one block), about :data:`BLOCK_BYTES` uncompressed, so that a
read of some rows (a ranged request on object storage) fetches and decodes only the blocks
holding them. With ``shuffle`` (on for elements wider than a byte) a block's bytes are
reordered by byte plane before compression (every element's first byte, then every
second byte, ...): the exponent bytes of floats then lie together, which zstd compresses
much better. The shard's metadata ``codec`` (JSON) gives, per tensor, its dtype code,
shape, rows per block and each block's compressed size. The writer codes a shard's
tensors batch by batch as they come (:class:`ShardEncoder`); the result is the same.

Each frame carries zstd's checksum of its content (XXH64), and its decoded size is
checked: a damaged block is refused (:class:`~lightning_iocatch.StoreError` naming the
shard, tensor and block), never decoded into garbage. A hostile one is refused before it
is allocated: rows per block beyond the writer's rule when the metadata is parsed, a frame
declaring another size than its block's before it is decoded, and a frame declaring none
once it decodes past its block's size (with a window of at most 8 MiB or twice the block).
zstd comes from the maintained ``zstandard`` package (``pip install
lightning-iocatch[zstd]``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.shard_file import READABLE_CODES, STORABLE_DTYPES

__all__ = [
    "BLOCK_BYTES",
    "CODECS",
    "CodedTensor",
    "ShardEncoder",
    "check_codec",
    "decode_block",
    "encode_tensors",
    "parse_codec",
]

CODECS = ("zstd",)
"""The lossless codecs a shard can be written with."""

BLOCK_BYTES = 1 << 20
"""About how many uncompressed bytes a block holds (whole rows, at least one)."""

_LEVEL = 1  # level 3 measured slower and no smaller on shuffled float activations
_META = "codec"
_WINDOW_FLOOR = 8 << 20  # the window any frame of a block may have, whatever its size


def check_codec(value: Any) -> str | None:
    """``value`` as a codec name, or ``None``; a ``ValueError`` naming the allowed values,
    an ``ImportError`` naming the package to install when its library is missing."""
    if value is None:
        return None
    if value not in CODECS:
        raise ValueError(f"`codec` must be one of {CODECS} or None, got {value!r}")
    _zstd()
    return str(value)


def _zstd() -> ModuleType:
    try:
        import zstandard
    except ImportError as error:
        raise ImportError(
            "codec='zstd' needs the `zstandard` package, which is not installed: "
            "pip install lightning-iocatch[zstd]"
        ) from error
    return zstandard


@dataclass(frozen=True)
class CodedTensor:
    """One coded tensor: its dtype code and shape as written, rows per block, and each
    block's compressed size."""

    code: str
    shape: tuple[int, ...]
    rows: int
    sizes: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the whole tensor, for a 0-d one)."""
        return math.prod(self.shape[1:]) * READABLE_CODES[self.code].itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * READABLE_CODES[self.code].itemsize

    @property
    def block_bytes(self) -> int:
        """Uncompressed bytes of a full block."""
        return self.rows * self.row_bytes if self.shape else self.nbytes

    def block_size(self, block: int) -> int:
        """Uncompressed bytes of ``block`` (the last may be shorter)."""
        return min(self.block_bytes, self.nbytes - block * self.block_bytes)


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    *,
    shuffle: bool = True,
    block_bytes: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``tensors`` coded (``U8`` tensors of the same names) and the shard metadata that
    describes them (see the module docstring); blocks of about ``block_bytes``
    (default :data:`BLOCK_BYTES`)."""
    encoder = ShardEncoder(codec, shuffle=shuffle, block_bytes=block_bytes)
    encoder.add(tensors)
    return encoder.tensors, encoder.metadata()


class ShardEncoder:
    """A shard's tensors coded as they come (the writer codes each batch as it arrives, so
    that the coding runs beside the model's forwards rather than after the last), and the
    shard metadata of them all (see :func:`encode_tensors`)."""

    def __init__(self, codec: str, *, shuffle: bool = True, block_bytes: int | None = None):
        self.codec, self.shuffle = codec, shuffle
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self._described: dict[str, dict[str, Any]] = {}
        self._compressor = _zstd().ZstdCompressor(level=_LEVEL, write_checksum=True)

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Code ``tensors`` (CPU tensors of :data:`STORABLE_DTYPES`, names new to this shard)."""
        for name, tensor in tensors.items():
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            itemsize = tensor.element_size()
            row = math.prod(tensor.shape[1:]) * itemsize if tensor.dim() else len(data)
            rows = _rows_a_block(tensor.dim() > 0, row, self.block_bytes)
            step = rows * row  # 0 only for a tensor of no bytes: one empty block
            frames = []
            for start in range(0, len(data), step) if len(data) else [0]:
                block = data[start : start + step]
                if self.shuffle and itemsize > 1:
                    block = byte_planes(block, itemsize)
                frames.append(self._compressor.compress(np.ascontiguousarray(block).data))
            blob = np.empty(sum(map(len, frames)), dtype=np.uint8)  # never empty: headers
            ends = np.cumsum([len(frame) for frame in frames]).tolist()
            for frame, end in zip(frames, ends, strict=True):
                blob[end - len(frame) : end] = np.frombuffer(frame, dtype=np.uint8)
            self.tensors[name] = torch.from_numpy(blob)
            self._described[name] = {
                "dtype": STORABLE_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "rows": rows,
                "sizes": [len(frame) for frame in frames],
            }

    def metadata(self) -> dict[str, str]:
        """The shard metadata describing the tensors coded so far."""
        meta = {"name": self.codec, "shuffle": self.shuffle, "tensors": self._described}
        return {_META: json.dumps(meta, separators=(",", ":"), sort_keys=True)}


def parse_codec(metadata: Mapping[str, str], where: str) -> tuple[bool, dict[str, CodedTensor]]:
    """``(shuffle, coded tensors by name)`` from a coded shard's metadata; damage is a
    :class:`StoreError` naming ``where``."""
    try:
        meta = json.loads(metadata[_META])
        if meta["name"] not in CODECS:
            raise ValueError(f"an unknown codec {meta['name']!r}")
        _zstd()
        tensors = {
            name: CodedTensor(
                str(info["dtype"]),
                tuple(int(d) for d in info["shape"]),
                int(info["rows"]),
                tuple(int(s) for s in info["sizes"]),
            )
            for name, info in meta["tensors"].items()
        }
        for name, info in tensors.items():
            if info.code not in READABLE_CODES or info.rows < 1:
                raise ValueError(f"{name!r} has dtype {info.code!r} and {info.rows} rows a block")
            if info.rows > _most_rows(info):  # checked before any block is allocated
                raise ValueError(
                    f"{name!r} has {info.rows} rows a block, where the writer puts at most "
                    f"{_most_rows(info)} (rows of {info.row_bytes} bytes, blocks of about "
                    f"{BLOCK_BYTES})"
                )
            blocks = max(1, -(-info.nbytes // info.block_bytes)) if info.block_bytes else 1
            if len(info.sizes) != blocks:
                raise ValueError(f"{name!r} has {len(info.sizes)} blocks, its shape needs {blocks}")
        return bool(meta["shuffle"]), tensors
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        message = f"shard {where} is corrupted: its codec metadata is damaged ({error})"
        raise StoreError(message) from error


def _rows_a_block(has_rows: bool, row_bytes: int, block_bytes: int) -> int:
    """Rows a block holds (the writer's rule): as many whole rows as fit in
    ``block_bytes``, at least one; a 0-d tensor, or one of empty rows, is one block."""
    return max(1, block_bytes // row_bytes) if row_bytes and has_rows else 1


def _most_rows(info: CodedTensor) -> int:
    """The most rows a block of ``info`` may hold: the writer's with :data:`BLOCK_BYTES`, so
    that no block is bigger than a writer's (a store written with smaller blocks reads)."""
    return _rows_a_block(bool(info.shape), info.row_bytes, BLOCK_BYTES)


def decode_block(
    raw: bytes | memoryview,
    info: CodedTensor,
    block: int,
    shuffle: bool,
    where: str,
    *,
    into: np.ndarray | None = None,
) -> np.ndarray:
    """The uncompressed bytes of ``block`` of a tensor (``where`` names the shard, tensor and
    block in errors): checked against the frame's checksum and the block's size. ``into``:
    memory of the block's size (``uint8``, owning its memory) that bytes put back in order
    from byte planes may be written to (a block of byte planes only).

    Nothing beyond the block's size is allocated for a damaged or hostile frame: a frame
    that declares another content size is refused before it is decoded, and one that
    declares none is decoded as a stream of at most the block's size and one byte more,
    with a window of at most :func:`_window_limit` bytes.
    """
    zstandard = _zstd()
    size = info.block_size(block)
    try:
        if not zstandard.get_frame_parameters(raw).has_checksum:  # the writer's always has
            raise StoreError(f"{where} is damaged: its frame carries no checksum")
        declared = zstandard.frame_content_size(raw)
        if declared not in (-1, size):
            raise StoreError(
                f"{where} is damaged: its frame declares {declared} bytes, the block holds {size}"
            )
        decoder = zstandard.ZstdDecompressor(max_window_size=_window_limit(size))
        if declared == -1:
            data = _read_at_most(decoder.stream_reader(raw), size + 1)
        else:
            data = decoder.decompress(raw, allow_extra_data=False)
    except zstandard.ZstdError as error:
        raise StoreError(f"{where} is damaged: it cannot be decoded ({error})") from None
    if len(data) != size:
        got = f"more than {size}" if len(data) > size else str(len(data))
        raise StoreError(f"{where} is damaged: it decodes to {got} bytes, not {size}")
    array = np.frombuffer(data, dtype=np.uint8)
    itemsize = READABLE_CODES[info.code].itemsize
    if shuffle and itemsize > 1 and size:
        array = from_byte_planes(array, itemsize, into=into)
    return array


def byte_planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes ``data`` (elements of ``itemsize`` bytes) by byte plane: every element's
    first byte, then every second byte, ... (:func:`from_byte_planes` undoes it)."""
    return np.ascontiguousarray(data.reshape(-1, itemsize).T).reshape(-1)


def from_byte_planes(
    planes: np.ndarray, itemsize: int, *, into: np.ndarray | None = None
) -> np.ndarray:
    """The bytes whose byte planes (see :func:`byte_planes`) are ``planes``, in ``into``
    (of their size) or in new memory: one strided copy per plane (NumPy's transposing copy
    of the whole block measured 3 to 6 times slower on 1 MiB blocks)."""
    rows = planes.reshape(itemsize, -1)
    out = np.empty(len(planes), dtype=np.uint8) if into is None else into
    elements = out.reshape(-1, itemsize)
    for plane in range(itemsize):
        elements[:, plane] = rows[plane]
    return out


def _window_limit(size: int) -> int:
    """The largest zstd window a block of ``size`` bytes is decoded with: a frame the writer
    compresses whole has one of at most twice its size (or 8 MiB, for frames of other
    encoders); zstd's own limit (128 MiB) would let a forged frame take that much."""
    return min(max(2 * size, _WINDOW_FLOOR), 1 << 31)


def _read_at_most(reader: Any, limit: int) -> bytes:
    """Up to ``limit`` decoded bytes of ``reader`` (fewer at the end of its frame)."""
    parts, have = [], 0
    with reader:
        while have < limit and (part := reader.read(limit - have)):
            parts.append(part)
            have += len(part)
    return b"".join(parts)
