"""The record of a committed shard: its file, size and checksum, its batches and keys.

A record is one JSON object, written as a ledger line on disk
(:mod:`lightning_iocatch.store.commits`) or as a commit record object on object storage
(:mod:`lightning_iocatch.store.backends.objects`). The rules it follows, enforced here:

- **Record checksums.** Each record carries ``record_crc32``: the CRC-32 of its JSON object
  without that field, serialized canonically (keys sorted, no whitespace, ASCII:
  ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``). Required from format ``/2``
  on; format ``/1`` stores (written before it existed) accept records without it and
  check the records that have it.
- **Index summaries.** From format ``/3`` on, each batch carries ``index``: a summary of
  its ``__index__`` tensor (the dataset index of each row): the first and last index, the
  number of distinct samples, the step of the samples when they are an arithmetic
  progression in row order (``0`` otherwise), and the CRC-32 of the tensor's bytes
  (:class:`IndexSummary`). Whatever reads a batch's indices checks them against it
  (:meth:`IndexSummary.check`): an index that disagrees with its record (a flipped bit)
  is damage, named, never read.
- **Shard checksums.** A record's ``crc32`` is that of its shard's bytes.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import INDEX_KEY, shard_name, shard_rank_and_seq
from lightning_iocatch.store.shard_codec import CODECS
from lightning_iocatch.store.shard_file import SCALE_RULE

__all__ = ["RECORD_CHECKSUM", "BatchRecord", "IndexSummary", "ShardRecord", "format_version"]

RECORD_CHECKSUM = "record_crc32"


def format_version(store_format: str) -> int:
    """``3`` for ``"lightning-iocatch-store/3"``: what a store's records must carry."""
    return int(store_format.rpartition("/")[2])


@dataclass(frozen=True)
class IndexSummary:
    """What a batch record says of the batch's ``__index__`` tensor (format ``/3``): enough
    to plan reads, resumes and checks without reading the indices.

    ``first``/``last``: the indices of its first and last row; ``low``/``high``: the
    smallest and largest (all four ``None`` without rows); ``samples``: the number of
    distinct indices; ``step``: when the indices, runs of one index counted once, are
    ``first, first + step, ..., last`` (``step >= 1``; ``1`` for one sample), else ``0``;
    ``crc32``: the CRC-32 of the tensor's bytes (int64, little-endian).

    Examples:
        >>> IndexSummary.of(torch.tensor([4, 4, 6, 8, 8]))
        IndexSummary(first=4, last=8, low=4, high=8, samples=3, step=2, crc32=...)
    """

    first: int | None
    last: int | None
    low: int | None
    high: int | None
    samples: int
    step: int
    crc32: int

    def __repr__(self) -> str:  # the checksum is noise to a reader
        return (
            f"IndexSummary(first={self.first}, last={self.last}, low={self.low}, "
            f"high={self.high}, samples={self.samples}, step={self.step}, crc32=...)"
        )

    @classmethod
    def of(cls, index: torch.Tensor) -> IndexSummary:
        """The summary of a batch's ``__index__`` tensor (int64, one entry per row)."""
        crc = _tensor_crc32(index)
        if not index.numel():
            return cls(None, None, None, None, 0, 0, crc)
        runs = torch.unique_consecutive(index)
        samples = int(torch.unique(runs).numel())
        step = 1 if runs.numel() == 1 else int(runs[1] - runs[0])
        if runs.numel() > 1 and (step < 1 or not bool((runs.diff() == step).all())):
            step = 0
        first, last = int(index[0]), int(index[-1])
        return cls(first, last, int(index.min()), int(index.max()), samples, step, crc)

    @property
    def progression(self) -> tuple[int, int, int] | None:
        """``(start, step, count)`` of the distinct indices when they are a progression in
        row order (then they need not be read to be known), else ``None``."""
        if not self.step or self.first is None:
            return None
        return self.first, self.step, self.samples

    def check(self, index: torch.Tensor, where: str) -> None:
        """Raise a :class:`StoreError` naming ``where`` unless ``index`` is what this says."""
        if _tensor_crc32(index) != self.crc32:
            raise StoreError(
                f"{where}: its {INDEX_KEY} does not match the CRC-32 its record gives (the "
                "dataset indices were changed after they were written): the shard is damaged"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, rows: int) -> IndexSummary:
        """Parse and check a batch's ``index``; ``ValueError`` says what is wrong."""
        if not isinstance(data, dict) or sorted(data) != sorted(_SUMMARY_FIELDS):
            raise ValueError(f"`index` must be {{{', '.join(_SUMMARY_FIELDS)}}}, got {data!r}")
        names = ("first", "last", "low", "high")
        first = last = low = high = None
        if rows:
            first, last, low, high = (_count(data[name], f"`index.{name}`") for name in names)
            if not low <= min(first, last) <= max(first, last) <= high:
                raise ValueError(f"`index` {first}..{last} is not within [{low}, {high}]")
        elif any(data[name] is not None for name in names):
            raise ValueError("`index.first`, `last`, `low` and `high` must be null without rows")
        samples = _count(data["samples"], "`index.samples`")
        step = _count(data["step"], "`index.step`")
        if samples > rows or bool(samples) != bool(rows):
            raise ValueError(f"`index.samples` {samples} does not fit a batch of {rows} rows")
        if step and (
            first is None
            or last is None
            or (low, high) != (first, last)
            or last - first != step * (samples - 1)
        ):
            raise ValueError(
                f"`index.step` {step} does not lead from {first} to {last} in {samples} samples"
            )
        crc = _count(data["crc32"], "`index.crc32`", 1 << 32)
        return cls(first, last, low, high, samples, step, crc)


_SUMMARY_FIELDS = ("crc32", "first", "high", "last", "low", "samples", "step")


def _tensor_crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)


@dataclass(frozen=True)
class BatchRecord:
    """One batch inside a shard: tensors ``b{position}/...``, ``rows`` rows.

    ``without_rows``: dataset indices of samples written with no row (token rows of a
    sample without a selected token), so that they count as stored. ``index``: the
    summary of its ``__index__`` (format ``/3``; ``None`` in records of earlier formats).
    ``keys``: the keys this batch holds where they are not all of its shard's (format
    ``/3``; ``None``: all of them).
    """

    dataloader_idx: int
    batch_idx: int
    rows: int
    without_rows: tuple[int, ...] = ()
    index: IndexSummary | None = None
    keys: tuple[str, ...] | None = None

    @classmethod
    def of(
        cls,
        dataloader_idx: int,
        batch_idx: int,
        index: torch.Tensor,
        without_rows: tuple[int, ...] = (),
    ) -> BatchRecord:
        """The record of a batch whose rows have the dataset indices ``index``."""
        summary = IndexSummary.of(index)
        return cls(dataloader_idx, batch_idx, int(index.numel()), without_rows, summary)

    def check_indices(self, index: torch.Tensor, where: str) -> None:
        """Raise a :class:`StoreError` naming ``where`` unless ``index`` agrees with this."""
        if tuple(index.shape) != (self.rows,):
            raise StoreError(
                f"{where}: its {INDEX_KEY} has shape {tuple(index.shape)}, its record says "
                f"[{self.rows}]: the shard is damaged"
            )
        if self.index is not None:
            self.index.check(index, where)
        elif bool((index < 0).any()):
            raise StoreError(f"{where}: it has negative dataset indices: the shard is damaged")


@dataclass(frozen=True)
class ShardRecord:
    """One committed shard: its file, size and checksum, its batches and keys.

    ``keys`` maps every key stored in the shard (in some or all of its batches) to its
    dtype; ``shapes`` gives a key's row shape (``None`` where batches differ). Keys in
    ``per_batch`` are stored once per batch, without a row per sample: their ``shapes``
    entry is the whole tensor's shape. ``skipped`` maps keys the writer did not store to
    the reason. ``scaled`` maps keys stored in 8-bit floats with a float32 scale per row
    to that rule (``"row"``; see :mod:`~lightning_iocatch.store.shard_file`). ``codec``
    names the lossless codec of the shard's tensors (see
    :mod:`~lightning_iocatch.store.shard_codec`), ``None`` for none. The JSON carries
    ``record_crc32`` (see the module docstring).
    """

    file: str
    rank: int
    bytes: int
    crc32: int
    batches: tuple[BatchRecord, ...]
    keys: dict[str, str]  # key -> dtype
    shapes: dict[str, list[int] | None]  # key -> shape of a row; None where batches differ
    per_batch: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    scaled: dict[str, str] = field(default_factory=dict)
    codec: str | None = None

    def to_json(self) -> str:
        """The record's JSON (one line, without a newline), with its ``record_crc32``."""
        data = asdict(self)
        for optional in ("per_batch", "skipped", "scaled", "codec"):
            if not data[optional]:
                del data[optional]
        for batch in data["batches"]:
            for optional in ("without_rows", "index", "keys"):
                if batch[optional] is None or batch[optional] == ():
                    del batch[optional]
        data[RECORD_CHECKSUM] = _record_crc32(data)
        return _canonical(data)

    @classmethod
    def from_json(cls, line: str, *, version: int) -> ShardRecord:
        """Parse and check one record of a store of format ``/{version}``; ``ValueError``
        says what is wrong with it."""
        return parse_record(json.loads(line), version=version)


def _canonical(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _record_crc32(data: dict[str, Any]) -> int:
    return zlib.crc32(_canonical(data).encode("ascii"))


_FIELDS = ("file", "rank", "bytes", "crc32", "batches", "keys", "shapes")
_BATCH_FIELDS = ("batch_idx", "dataloader_idx", "rows")
_OPTIONAL = ("per_batch", "skipped", "scaled", "codec", RECORD_CHECKSUM)


def _count(value: Any, what: str, below: int | None = None) -> int:
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def parse_record(data: Any, *, version: int) -> ShardRecord:
    """The record in ``data`` (parsed JSON) of a store of format ``/{version}``, checked."""
    if not isinstance(data, dict):
        raise ValueError(f"not a record: a JSON {type(data).__name__}, not an object")
    if RECORD_CHECKSUM in data:
        check = data.pop(RECORD_CHECKSUM)
        if check != _record_crc32(data):
            raise ValueError(
                f"its {RECORD_CHECKSUM} does not match its content: the line was changed "
                "after it was written"
            )
    elif version >= 2:
        raise ValueError(f"it has no {RECORD_CHECKSUM}, which this store's format requires")
    unknown = sorted(set(data) - {*_FIELDS, *_OPTIONAL})
    missing = [name for name in _FIELDS if name not in data]
    if unknown or missing:
        raise ValueError(f"not a record: unknown fields {unknown}, missing fields {missing}")
    name = data["file"]
    named = shard_rank_and_seq(name) if isinstance(name, str) else None
    if named is None:
        raise ValueError(
            f"`file` {name!r} is not a shard name like {shard_name(0, 0)!r}; a store reads "
            "only its own files inside its directory"
        )
    rank = _count(data["rank"], "`rank`")
    if named[0] != rank:
        raise ValueError(f"`file` {name!r} is not a shard of rank {rank}")
    batches = data["batches"]
    if not isinstance(batches, list) or not batches:
        raise ValueError(f"`batches` must be a non-empty list, got {batches!r}")
    parsed = [_batch(batch, version) for batch in batches]
    keys, shapes = data["keys"], data["shapes"]
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and k != INDEX_KEY and isinstance(v, str) for k, v in keys.items()
    ):
        raise ValueError(f"`keys` must map keys to dtype names, got {keys!r}")
    for batch in parsed:
        if batch.keys is not None and not set(batch.keys) <= set(keys):
            raise ValueError(f"a batch's `keys` {list(batch.keys)} are not keys of the record")
    if not isinstance(shapes, dict) or not all(
        k in keys and (v is None or (isinstance(v, list) and all(_is_count(d) for d in v)))
        for k, v in shapes.items()
    ):
        raise ValueError(f"`shapes` must map keys of `keys` to lists of sizes or null: {shapes!r}")
    per_batch = data.get("per_batch", [])
    if not isinstance(per_batch, list) or not all(k in keys for k in per_batch):
        raise ValueError(f"`per_batch` must list keys of `keys`, got {per_batch!r}")
    skipped = data.get("skipped", {})
    if not isinstance(skipped, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in skipped.items()
    ):
        raise ValueError(f"`skipped` must map keys to reasons, got {skipped!r}")
    scaled = data.get("scaled", {})
    if not isinstance(scaled, dict) or not all(
        k in keys and v == SCALE_RULE for k, v in scaled.items()
    ):
        raise ValueError(f"`scaled` must map keys of `keys` to {SCALE_RULE!r}, got {scaled!r}")
    codec = data.get("codec")
    if codec not in (None, *CODECS):
        raise ValueError(f"`codec` must be one of {list(CODECS)}, got {codec!r}")
    return ShardRecord(
        file=name,
        rank=rank,
        bytes=_count(data["bytes"], "`bytes`"),
        crc32=_count(data["crc32"], "`crc32`", below=1 << 32),
        batches=tuple(parsed),
        keys=keys,
        shapes=shapes,
        per_batch=tuple(per_batch),
        skipped=skipped,
        scaled=scaled,
        codec=codec,
    )


def _batch(batch: Any, version: int) -> BatchRecord:
    """One batch of a record; from format ``/3`` on it must carry its ``index`` summary."""
    allowed = {*_BATCH_FIELDS, "without_rows", "index", "keys"}
    fields = set(batch) if isinstance(batch, dict) else None
    if fields is None or not set(_BATCH_FIELDS) <= fields <= allowed:
        shape = "{dataloader_idx, batch_idx, rows[, without_rows][, index][, keys]}"
        raise ValueError(f"a batch must be {shape}, got {batch!r}")
    if version >= 3 and "index" not in fields:
        raise ValueError("a batch has no `index` summary, which this store's format requires")
    without = batch.get("without_rows", [])
    if not isinstance(without, list) or (not without and "without_rows" in batch):
        raise ValueError(f"`without_rows` must be a non-empty list, got {without!r}")
    counts = {k: _count(batch[k], f"`{k}`") for k in _BATCH_FIELDS}
    samples = tuple(_count(index, "an index of `without_rows`") for index in without)
    summary = IndexSummary.from_json(batch["index"], counts["rows"]) if "index" in batch else None
    keys = batch.get("keys")
    if keys is not None and (
        not isinstance(keys, list) or not all(isinstance(key, str) for key in keys)
    ):
        raise ValueError(f"a batch's `keys` must be a list of keys, got {keys!r}")
    return BatchRecord(
        **counts,
        without_rows=samples,
        index=summary,
        keys=None if keys is None else tuple(keys),
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0
