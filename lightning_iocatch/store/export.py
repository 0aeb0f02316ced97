"""Export a feature store to a Hugging Face ``datasets`` dataset (Arrow), shard by shard.

The dataset is written with the ``datasets`` library's own Arrow writer and saved with
``Dataset.save_to_disk``, so ``datasets.load_from_disk(out_dir)`` reads it. Two layouts:

- ``"columns"``: one column per exported key (named by the key, a row of its stored
  shape and dtype) plus ``"index"``, the dataset index of the row.
- ``"saelens"``: the layout SAELens' ``CacheActivationsRunner`` writes and its
  ``ActivationsStore`` reads for cached activations (SAELens 6.x): a column named after the
  hook point holding each sequence's activations as ``Array2D((context_size, d_in))``,
  and ``"token_ids"`` as ``int32`` sequences of length ``context_size``, plus ``"index"``
  (SAELens reads only the columns it knows).

``datasets`` is imported when an export runs, not with this module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from lightning_iocatch.store.backends.location import StoreLocation
from lightning_iocatch.store.reader import FeatureStore, OnDuplicate
from lightning_iocatch.suggest import close_names

if TYPE_CHECKING:
    from datasets import Features

__all__ = ["ExportError", "export_dataset"]

Layout = Literal["columns", "saelens"]
_LAYOUTS = ("columns", "saelens")
INDEX_COLUMN = "index"
TOKEN_IDS_COLUMN = "token_ids"
_CHUNK_BYTES = 64 * 2**20  # default bound of one Arrow record batch
# Arrow has no bfloat16: it is widened, losslessly, to float32.
_ARROW_DTYPES = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
}
_INTEGER = ("uint8", "int8", "int16", "int32", "int64")


class ExportError(ValueError):
    """A store, or the keys asked for, cannot be exported in the requested layout."""


@dataclass(frozen=True)
class _Column:
    """One exported column: which key it reads, its name, row shape and Arrow dtype."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: str  # an Arrow/``datasets`` Value dtype


def export_dataset(
    store_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    layout: Layout = "columns",
    hook_name: str | None = None,
    token_ids_key: str | None = None,
    batch_rows: int | None = None,
    dataloader_idx: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    on_duplicate: OnDuplicate = "error",
) -> Path:
    """Write the rows of a feature store as a Hugging Face dataset that ``load_from_disk`` reads.

    Rows are streamed shard by shard (``FeatureStore.batches``) and written in Arrow record
    batches of at most ``batch_rows`` rows, so memory stays bounded by about one shard of
    the exported keys plus one record batch, whatever the store's size. The dataset first goes
    to a temporary Arrow file next to ``out_dir`` (removed at the end, also on errors) and
    is then saved there with ``Dataset.save_to_disk``: the export needs about twice the
    dataset's size on disk while it runs.

    Rows come in the store's commit order (rank by rank, shard by shard), not sorted: the
    ``"index"`` column holds each row's dataset index (``dataset.sort("index")`` orders
    them). A store holding an index twice is refused, or read from its first commits with
    ``on_duplicate="first"``, as :class:`~lightning_iocatch.FeatureStore` does.

    Args:
        store_path: a directory :class:`~lightning_iocatch.FeatureWriter` wrote, or its fsspec
            URL (with ``storage_options``).
        out_dir: where to save the dataset; must not exist or be an empty directory.
        keys: the store keys to export (default: every key). Each must have one row per
            sample with the same shape and dtype in every batch, and all of them must
            cover the same dataset indices; per-batch keys (``metadata["per_batch"]``)
            and keys whose row shape varies are refused, naming them.
        layout: ``"columns"`` (one column per key, named by the key) or ``"saelens"``.
        hook_name: ``"saelens"`` only: the name of the activation column, the
            ``hook_name`` of SAELens' config (default: the key's module name, the part
            before the first ``/``).
        token_ids_key: ``"saelens"`` only: the integer key of row shape
            ``(context_size,)`` holding the token ids (e.g. ``"model/inputs/args/0"``).
            Default: the one such key in the store, if exactly one exists; with none,
            the dataset has no ``token_ids`` column (SAELens treats it as optional).
        batch_rows: rows per Arrow record batch (default: as many as fit in 64 MiB).
        dataloader_idx: which predict dataloader's rows to export.
        storage_options: fsspec options for a URL ``store_path``.
        on_duplicate: as :class:`~lightning_iocatch.FeatureStore`'s: ``"error"`` refuses a
            store holding an index twice, ``"first"`` exports each from its first commit.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ExportError: a key is unknown or cannot be a column, the keys cover different
            rows, ``out_dir`` is not empty, or an argument is invalid.
        ImportError: ``datasets`` is not installed.

    With ``layout="saelens"``, exactly one floating key of row shape ``(context_size,
    d_in)`` is exported (``keys`` selects it when the store has several). SAELens'
    ``ActivationsStore``, which its training runner builds with
    ``use_cached_activations=True`` and ``cached_activations_path=out_dir``, reads it
    given ``hook_name`` as here and the same ``context_size`` and ``d_in`` (tested with
    sae-lens 6.54). Token ids are stored as int32, as SAELens stores them.

    In both layouts, bfloat16 rows are stored as float32 (Arrow has no bfloat16).
    """
    if layout not in _LAYOUTS:
        raise ExportError(f"`layout` must be one of {_LAYOUTS}, got {layout!r}")
    if batch_rows is not None and (type(batch_rows) is not int or batch_rows < 1):
        raise ExportError(f"`batch_rows` must be a positive int or None, got {batch_rows!r}")
    if layout == "columns" and (hook_name is not None or token_ids_key is not None):
        raise ExportError(
            "`hook_name` and `token_ids_key` apply to layout='saelens' only; "
            "pass layout='saelens' or leave them out"
        )
    if hook_name is not None and (not isinstance(hook_name, str) or not hook_name):
        raise ExportError(f"`hook_name` must be a non-empty str, got {hook_name!r}")
    _require_datasets()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"`out_dir` {str(out)!r} exists and is not an empty directory")
    store = FeatureStore(
        store_path,
        dataloader_idx=dataloader_idx,
        storage_options=storage_options,
        on_duplicate=on_duplicate,
    )
    if isinstance(store.path, Path) and out.resolve().is_relative_to(store.path.resolve()):
        raise ExportError(f"`out_dir` {str(out)!r} is inside the store; choose another directory")
    meta = store.metadata  # computed once: it walks every stored batch
    if layout == "columns":
        columns = _plain_columns(meta, store.path, keys)
    else:
        columns = _saelens_columns(meta, store.path, keys, hook_name, token_ids_key)
    _check_same_rows(store, columns)
    _write(store, columns, out, batch_rows)
    return out


def _require_datasets() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "export needs Hugging Face `datasets`, which is not installed: "
            "pip install 'datasets>=4'"
        ) from error


# Choosing the columns: every check before anything is written


def _key_info(meta: dict[str, Any], path: StoreLocation, key: str) -> tuple[tuple[int, ...], str]:
    """``(row shape, stored dtype)`` of a key that can be a column, else an ExportError."""
    if key not in meta["keys"]:
        close = close_names(key, meta["keys"], cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise ExportError(
            f"no key {key!r} in {path}; {hint}keys: {list(meta['keys'])} "
            "(list them with `lightning-iocatch inspect`)"
        )
    info = meta["keys"][key]
    if key in meta["per_batch"]:
        raise ExportError(
            f"{key!r} is stored once per batch, without a row per sample, so it cannot be a "
            "column; choose the keys to export with `keys=` (`--keys`)"
        )
    if info["shape"] is None:
        raise ExportError(
            f"{key!r} has rows of different shapes across batches (a sequence length that "
            "varies by batch); a column needs one row shape: pad to a fixed length when "
            "dumping, or leave it out with `keys=` (`--keys`)"
        )
    if "|" in info["dtype"]:
        raise ExportError(
            f"{key!r} is stored as {info['dtype'].replace('|', ' and ')} in different batches; "
            "a column needs one dtype: leave it out with `keys=` (`--keys`)"
        )
    if info["dtype"] not in _ARROW_DTYPES:
        raise ExportError(
            f"{key!r} is stored as {info['dtype']}, which Arrow cannot hold; exportable "
            f"dtypes: {sorted(_ARROW_DTYPES)}"
        )
    shape = tuple(info["shape"])
    if len(shape) > 5:
        raise ExportError(f"{key!r} has rows of {len(shape)} dimensions; at most 5 can export")
    return shape, info["dtype"]


def _plain_columns(
    meta: dict[str, Any], path: StoreLocation, keys: Sequence[str] | None
) -> list[_Column]:
    columns = []
    for key in _normalise_keys(meta, path, keys):
        shape, dtype = _key_info(meta, path, key)
        columns.append(_Column(key, key, shape, _ARROW_DTYPES[dtype]))
    return columns


def _normalise_keys(
    meta: dict[str, Any], path: StoreLocation, keys: Sequence[str] | None
) -> list[str]:
    if keys is None:
        chosen = list(meta["keys"])
    elif isinstance(keys, str) or not all(isinstance(key, str) for key in keys):
        raise ExportError(f"`keys` must be a sequence of key names, got {keys!r}")
    else:
        chosen = list(dict.fromkeys(keys))
    if not chosen:
        where = f"in {path}" if keys is None else "given"
        raise ExportError(f"nothing to export: no keys {where}")
    return chosen


def _saelens_columns(
    meta: dict[str, Any],
    path: StoreLocation,
    keys: Sequence[str] | None,
    hook_name: str | None,
    token_ids_key: str | None,
) -> list[_Column]:
    if (meta.get("tokens") or {}).get("reduce", "") is None:
        raise ExportError(
            f"{path} holds token rows (FeatureWriter(tokens=...)), one row per token, while "
            "layout='saelens' exports whole sequences of (context_size, d_in); export the token "
            "rows with layout='columns', or dump the sequences without `tokens`"
        )
    if token_ids_key is not None:  # checked first: it must not pass for the activations
        shape, dtype = _key_info(meta, path, token_ids_key)
        if dtype not in _INTEGER or len(shape) != 1:
            raise ExportError(
                f"`token_ids_key` {token_ids_key!r} has rows of shape {shape} and dtype "
                f"{dtype}; token ids need integer rows of shape (context_size,)"
            )
    candidates = [key for key in _normalise_keys(meta, path, keys) if key != token_ids_key]
    activations = []
    for key in candidates:
        shape = meta["keys"].get(key, {}).get("shape")
        if keys is None and (key in meta["per_batch"] or shape is None or len(shape) != 2):
            continue  # with every key offered, only sequence activations are candidates
        shape, dtype = _key_info(meta, path, key)
        if len(shape) == 2 and dtype not in _INTEGER and dtype != "bool":
            activations.append(_Column(key, "", shape, _ARROW_DTYPES[dtype]))
        elif keys is not None:
            raise ExportError(
                f"{key!r} has rows of shape {shape} and dtype {dtype}; layout='saelens' "
                "needs floating rows of shape (context_size, d_in)"
            )
    if len(activations) != 1:
        found = [column.key for column in activations]
        raise ExportError(
            f"layout='saelens' exports one key of floating rows (context_size, d_in); "
            f"{'found ' + repr(found) if found else 'found none'}: name one with `keys=` (`--keys`)"
        )
    act = activations[0]
    name = hook_name if hook_name is not None else act.key.split("/", 1)[0]
    columns = [_Column(act.key, name, act.shape, act.dtype)]
    tokens = _token_ids_key(meta, path, token_ids_key, act.shape[0])
    if tokens is not None:
        columns.append(_Column(tokens, TOKEN_IDS_COLUMN, (act.shape[0],), "int32"))
    return columns


def _token_ids_key(
    meta: dict[str, Any], path: StoreLocation, token_ids_key: str | None, context: int
) -> str | None:
    """The key of the token ids: the one given (checked), or the only candidate, or None."""
    if token_ids_key is None:
        found = [
            key
            for key, info in meta["keys"].items()
            if info["dtype"] in _INTEGER
            and info["shape"] == [context]
            and key not in meta["per_batch"]
        ]
        if len(found) > 1:
            raise ExportError(
                f"several keys could hold the token ids: {found}; name one with "
                "`token_ids_key=` (`--token-ids-key`)"
            )
        return found[0] if found else None
    shape, dtype = _key_info(meta, path, token_ids_key)
    if dtype not in _INTEGER or shape != (context,):
        raise ExportError(
            f"`token_ids_key` {token_ids_key!r} has rows of shape {shape} and dtype {dtype}; "
            f"token ids need integer rows of shape ({context},), the activations' context size"
        )
    return token_ids_key


def _check_same_rows(store: FeatureStore, columns: list[_Column]) -> None:
    first = store.indices_of(columns[0].key)
    for column in columns[1:]:
        other = store.indices_of(column.key)
        if not torch.equal(first, other):
            raise ExportError(
                f"{columns[0].key!r} and {column.key!r} are stored for different samples "
                f"({first.numel()} and {other.numel()} rows): export them separately with "
                "`keys=` (`--keys`)"
            )


# Writing


def _features(columns: list[_Column]) -> Features:
    from datasets import Array2D, Array3D, Array4D, Array5D, Features, List, Value

    arrays: dict[int, Any] = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
    spec: dict[str, Any] = {}
    for column in columns:
        if not column.shape:
            spec[column.name] = Value(column.dtype)
        elif len(column.shape) == 1:
            spec[column.name] = List(Value(column.dtype), length=column.shape[0])
        else:
            spec[column.name] = arrays[len(column.shape)](shape=column.shape, dtype=column.dtype)
    spec[INDEX_COLUMN] = Value("int64")
    return Features(spec)


def _chunks(
    store: FeatureStore, columns: list[_Column], batch_rows: int
) -> Iterator[dict[str, np.ndarray]]:
    """Column arrays of at most ``batch_rows`` rows, stored batch by stored batch."""
    streams = [store.batches(column.key) for column in columns]
    for parts in zip(*streams, strict=True):
        indices = parts[0][0]
        for other, _ in parts[1:]:
            if not torch.equal(other, indices):  # same holders, so never; but never silently
                raise ExportError("the exported keys are stored in different batches")
        for start in range(0, indices.numel(), batch_rows):
            stop = start + batch_rows
            chunk = {
                column.name: _to_numpy(rows[start:stop], column)
                for column, (_, rows) in zip(columns, parts, strict=True)
            }
            chunk[INDEX_COLUMN] = indices[start:stop].numpy()
            yield chunk


def _to_numpy(rows: torch.Tensor, column: _Column) -> np.ndarray:
    target = getattr(torch, column.dtype)
    if rows.dtype != target:  # bfloat16 widened; token ids narrowed to int32, never wrapped
        if not target.is_floating_point and rows.numel():
            low, high = int(rows.min()), int(rows.max())
            limits = torch.iinfo(target)
            if low < limits.min or high > limits.max:
                raise ExportError(
                    f"{column.key!r} holds values from {low} to {high}, outside {column.dtype}"
                )
        rows = rows.to(target)
    return rows.contiguous().numpy()


def _write(store: FeatureStore, columns: list[_Column], out: Path, batch_rows: int | None) -> None:
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    if batch_rows is None:
        row_bytes = sum(
            int(np.prod(column.shape, dtype=np.int64)) * np.dtype(column.dtype).itemsize
            for column in columns
        )
        batch_rows = max(1, _CHUNK_BYTES // max(1, row_bytes + 8))
    features = _features(columns)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".iocatch-export-", dir=out.parent))
    try:
        arrow_file = scratch / "rows.arrow"
        with ArrowWriter(features=features, path=str(arrow_file)) as writer:
            for chunk in _chunks(store, columns, batch_rows):
                writer.write_batch(chunk)
            writer.finalize()
        dataset = Dataset.from_file(str(arrow_file))
        dataset.save_to_disk(str(out))
        del dataset
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
