"""The columns of an export: which keys can be a column, named what, of which Arrow type.

Every check of :func:`~lightning_iocatch.store.export.export_dataset` that needs only the
store's metadata runs here, before anything is written: ``"columns"`` gives one column per
key (:func:`plain_columns`); ``"saelens"`` the one activation column of shape
``(context_size, d_in)`` that SAELens' cached-activations reader takes, with its token ids
(:func:`saelens_columns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.suggest import close_names

__all__ = [
    "ARROW_DTYPES",
    "INDEX_COLUMN",
    "LAYOUTS",
    "TOKEN_IDS_COLUMN",
    "ExportColumn",
    "ExportError",
    "Layout",
    "plain_columns",
    "saelens_columns",
]

Layout = Literal["columns", "saelens"]


LAYOUTS = ("columns", "saelens")


INDEX_COLUMN = "index"


TOKEN_IDS_COLUMN = "token_ids"


# Arrow has no bfloat16: it is widened, losslessly, to float32. A key stored in 8-bit
# floats with a scale per row is exported as the FeatureStore reads it: dequantized, float32.
ARROW_DTYPES = {
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
class ExportColumn:
    """One exported column: which key it reads, its name, row shape and Arrow dtype."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: str  # an Arrow/``datasets`` Value dtype


def _key_info(meta: dict[str, Any], path: StoreBackend, key: str) -> tuple[tuple[int, ...], str]:
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
    dtype = info.get("read_as", info["dtype"])  # scaled 8-bit floats: read dequantized
    if dtype not in ARROW_DTYPES:
        raise ExportError(
            f"{key!r} is stored as {info['dtype']}, which Arrow cannot hold; exportable "
            f"dtypes: {sorted(ARROW_DTYPES)}"
        )
    shape = tuple(info["shape"])
    if len(shape) > 5:
        raise ExportError(f"{key!r} has rows of {len(shape)} dimensions; at most 5 can export")
    return shape, dtype


def plain_columns(
    meta: dict[str, Any], path: StoreBackend, keys: Sequence[str] | None
) -> list[ExportColumn]:
    columns = []
    for key in _normalise_keys(meta, path, keys):
        shape, dtype = _key_info(meta, path, key)
        columns.append(ExportColumn(key, key, shape, ARROW_DTYPES[dtype]))
    return columns


def _normalise_keys(
    meta: dict[str, Any], path: StoreBackend, keys: Sequence[str] | None
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


def saelens_columns(
    meta: dict[str, Any],
    path: StoreBackend,
    keys: Sequence[str] | None,
    hook_name: str | None,
    token_ids_key: str | None,
) -> list[ExportColumn]:
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
            activations.append(ExportColumn(key, "", shape, ARROW_DTYPES[dtype]))
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
    columns = [ExportColumn(act.key, name, act.shape, act.dtype)]
    tokens = _token_ids_key(meta, path, token_ids_key, act.shape[0])
    if tokens is not None:
        columns.append(ExportColumn(tokens, TOKEN_IDS_COLUMN, (act.shape[0],), "int32"))
    return columns


def _token_ids_key(
    meta: dict[str, Any], path: StoreBackend, token_ids_key: str | None, context: int
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
