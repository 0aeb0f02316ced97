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

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_iocatch.store.export_columns import (
    INDEX_COLUMN,
    LAYOUTS,
    ExportColumn,
    ExportError,
    Layout,
    plain_columns,
    saelens_columns,
)
from lightning_iocatch.store.progress import progress_bar, show_progress
from lightning_iocatch.store.reader import FeatureStore, OnDuplicate

if TYPE_CHECKING:
    from datasets import Features

__all__ = ["ExportError", "export_dataset"]

_CHUNK_BYTES = 64 * 2**20  # default bound of one Arrow record batch


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
    progress: bool | None = None,
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
        progress: progress bars on stderr (rows written; on object storage, the commit
            records read when opening; ``datasets``' own bar of the save): ``True``,
            ``False``, or ``None`` (default) for bars only when stderr is a terminal.

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
    if layout not in LAYOUTS:
        raise ExportError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
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
    show = show_progress(progress)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"`out_dir` {str(out)!r} exists and is not an empty directory")
    store = FeatureStore(
        store_path,
        dataloader_idx=dataloader_idx,
        storage_options=storage_options,
        on_duplicate=on_duplicate,
        progress=show,
    )
    if store.backend.contains(out):
        raise ExportError(f"`out_dir` {str(out)!r} is inside the store; choose another directory")
    meta = store.metadata  # computed once: it walks every stored batch
    if layout == "columns":
        columns = plain_columns(meta, store.backend, keys)
    else:
        columns = saelens_columns(meta, store.backend, keys, hook_name, token_ids_key)
    _check_same_rows(store, columns)
    _write(store, columns, out, batch_rows, show)
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


def _check_same_rows(store: FeatureStore, columns: list[ExportColumn]) -> None:
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


def _features(columns: list[ExportColumn]) -> Features:
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
    store: FeatureStore, columns: list[ExportColumn], batch_rows: int
) -> Iterator[dict[str, np.ndarray]]:
    """ExportColumn arrays of at most ``batch_rows`` rows, stored batch by stored batch."""
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


def _to_numpy(rows: torch.Tensor, column: ExportColumn) -> np.ndarray:
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


def _write(
    store: FeatureStore,
    columns: list[ExportColumn],
    out: Path,
    batch_rows: int | None,
    progress: bool,
) -> None:
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
        rows = store.row_count(columns[0].key)
        with (
            ArrowWriter(features=features, path=str(arrow_file)) as writer,
            progress_bar(progress, "export", total=rows, unit="row") as advance,
        ):
            for chunk in _chunks(store, columns, batch_rows):
                writer.write_batch(chunk)
                advance(len(chunk[INDEX_COLUMN]))
            writer.finalize()
        dataset = Dataset.from_file(str(arrow_file))
        with _datasets_bars(progress):
            dataset.save_to_disk(str(out))
        del dataset
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _datasets_bars(show: bool) -> Iterator[None]:
    """``datasets`` draws its own bars whether or not stderr is a terminal: off while the
    block runs unless ``show`` (a switch of the whole process, put back afterwards)."""
    from datasets import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
