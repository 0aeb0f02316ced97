"""Which rows and keys of a batch a store gets, decided on the calling thread.

The rules a :class:`~lightning_iocatch.store.writer.ShardWriter` applies through a
:class:`RowSelector`, before anything is queued for its writer thread:

- **Each dataset index once.** A row whose dataset index is already committed (an earlier,
  interrupted run) or already written in this run, or that a sampler marks as padding, is
  dropped; the rest of its batch is written. The decision is per row, per dataloader.
- **Rows and batches.** A tensor whose first dimension is the batch's number of samples
  is stored row by row. Any other tensor (no dimension, or a first dimension of another
  size, such as rotary position embeddings with batch dimension 1) is stored once per
  batch and listed in the ledger record's ``per_batch``. A key keeps the kind it got when
  first stored (also across a resume): a key stored row by row that later arrives without
  a row per sample is not stored for that batch and is named, with the reason, in the
  record's ``skipped``. A key in ``required`` that lacks a row per sample is refused.
- **Token rows.** With a batch's :class:`~lightning_iocatch.store.tokens.TokenSelection`,
  the tensors it selected have one row per selected token and are stored row by row,
  each row with its sample's dataset index and the coordinate keys ``__position__`` and
  ``__token_id__``; every other tensor is stored once per batch. A sample's rows are
  kept or dropped together; a sample without a selected token is listed in its batch
  record's ``without_rows``, so that it counts as stored.
- **Storage dtype.** ``dtype`` casts floating tensors; an 8-bit float ``dtype``
  (:data:`~lightning_iocatch.store.shard_file.SCALED_DTYPES`) stores each floating tensor
  with a float32 scale per row (:func:`~lightning_iocatch.store.shard_file.quantize`,
  computed on the tensor's device before its copy to the host).
- **Refused on the calling thread.** A tensor safetensors cannot store (sparse, nested,
  meta, or a dtype outside :data:`~lightning_iocatch.store.shard_file.STORABLE_DTYPES`) raises
  :class:`~lightning_iocatch.StoreError` naming its key.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.index_set import IndexSet
from lightning_iocatch.store.names import INDEX_KEY, POSITION_KEY, RESERVED_KEYS, TOKEN_ID_KEY
from lightning_iocatch.store.plan import StorePlan
from lightning_iocatch.store.records import BatchRecord
from lightning_iocatch.store.shard_file import (
    SCALED_DTYPES,
    STORABLE_DTYPES,
    dtype_name,
    quantize,
    unscaled,
)
from lightning_iocatch.store.tokens import TokenSelection

__all__ = ["RowSelector", "SelectedBatch"]

_ROWS, _BATCH = "rows", "batch"
_LARGEST = 2**63 - 1  # dataset indices are stored as int64


@dataclass
class SelectedBatch:
    """What a store gets of one batch: the tensors of its new rows, ready to be written."""

    record: BatchRecord
    tensors: dict[str, torch.Tensor]  # includes INDEX_KEY
    per_batch: frozenset[str]
    skipped: dict[str, str]
    nbytes: int
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # of keys stored scaled


class RowSelector:
    """Selects the rows and keys of each batch that a store gets (see the module docstring).

    Args:
        plan: what :func:`~lightning_iocatch.store.plan.prepare_store` returned: the
            dataset indices already committed and the kind of each key already stored.
        dtype: cast floating tensors to this dtype for storage; an 8-bit float stores
            them with a scale per row (see the module docstring).
    """

    def __init__(self, plan: StorePlan, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self._seen = {loader: copy.deepcopy(seen) for loader, seen in plan.committed.items()}
        self._kinds = {key: _ROWS for key in plan.row_keys} | {k: _BATCH for k in plan.batch_keys}
        self._single: dict[str, bool] = {}  # key -> rows of one value: float32, not scaled

    def has(self, dataloader_idx: int, indices: Sequence[int]) -> bool:
        """True when every one of ``indices`` is committed or already written in this run."""
        seen = self._seen.get(dataloader_idx)
        try:
            values = _as_array(indices)
        except (TypeError, OverflowError):  # not indices: select() names the problem
            return False
        return seen is not None and bool(seen.contains(values).all())

    def select(
        self,
        tensors: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        dataloader_idx: int,
        batch_idx: int,
        repeated: Sequence[bool] | None,
        required: Collection[str],
        tokens: TokenSelection | None = None,
        token_keys: Collection[str] = (),
    ) -> SelectedBatch | None:
        """The new rows of one batch (``None`` when it has none), marked as written.

        ``tensors`` by key, ``indices`` the dataset index of each sample; ``repeated`` marks
        samples that are padding; ``required`` names keys that must have a row per sample.
        ``tokens``: the batch's token selection (see :mod:`lightning_iocatch.store.tokens`);
        ``token_keys``: the keys of the tensors it selected (one row per token; rows get
        its coordinates).

        Raises:
            StoreError: a tensor that cannot be stored (naming its key), or an index that is
                not a non-negative integer.
        """
        reserved = sorted(set(RESERVED_KEYS) & set(tensors))
        if reserved:
            raise StoreError(f"{reserved[0]!r} is a key the store keeps for itself; rename it")
        samples = len(indices)
        storable = {key: self._storable(key, tensor) for key, tensor in tensors.items()}
        scales = {key: scale for key, (_, scale) in storable.items() if scale is not None}
        stored = {key: tensor for key, (tensor, _) in storable.items()}
        rows = samples if tokens is None else len(tokens)
        if tokens is not None and tokens.shape[0] != samples:
            raise StoreError(
                f"the token selection is for a batch of {tokens.shape[0]} samples, but "
                f"batch {batch_idx} has {samples} dataset indices"
            )
        has_rows = {
            key: self._has_rows(key, tensor, rows, tokens, token_keys)
            for key, tensor in stored.items()
        }
        for key in required:
            if key in stored and not has_rows[key]:
                shape = tuple(stored[key].shape)
                raise StoreError(
                    f"FeatureWriter stores one row per sample, but {key!r} has shape {shape} "
                    f"for a batch of {samples} samples; capture a module whose output has the "
                    "batch dimension first"
                    if tokens is None
                    else f"FeatureWriter stores token rows, but {key!r} was not a (batch, seq, "
                    f"...) tensor of this batch's {tokens.shape} tokens (its copy has shape "
                    f"{shape}); capture a module whose output is (batch, seq, ...)"
                )
        keep = self._new_rows(dataloader_idx, batch_idx, indices, repeated)
        if not keep:
            return None
        self._seen.setdefault(dataloader_idx, IndexSet()).add(list(keep.values()))
        sample = torch.arange(samples) if tokens is None else tokens.sample
        kept = torch.zeros(samples, dtype=torch.bool)
        kept[list(keep)] = True
        by_position = torch.full((samples,), -1, dtype=torch.int64)
        by_position[list(keep)] = torch.tensor(list(keep.values()), dtype=torch.int64)
        select = kept[sample].nonzero().squeeze(1) if len(keep) < samples else None
        batch = {INDEX_KEY: by_position[sample if select is None else sample[select]]}
        without_rows: tuple[int, ...] = ()  # a sample of a row per sample has its row
        if tokens is not None:
            tokens_of = torch.bincount(sample, minlength=samples).tolist()
            without_rows = tuple(
                index for position, index in keep.items() if not tokens_of[position]
            )
            coordinates = _coordinates(tokens)
            stored.update(coordinates)
            has_rows.update(dict.fromkeys(coordinates, True))
        per_batch: set[str] = set()
        skipped: dict[str, str] = {}
        kept_scales: dict[str, torch.Tensor] = {}
        for key, tensor in stored.items():
            kind = self._kinds.setdefault(key, _ROWS if has_rows[key] else _BATCH)
            if kind == _BATCH and has_rows[key] and tokens is not None:
                skipped[key] = (
                    f"its {tokens.shape} leading dimensions made it token rows in a batch, "
                    "though earlier batches stored this key once per batch"
                )
            elif kind == _BATCH:
                batch[key] = tensor.contiguous()
                per_batch.add(key)
                if key in scales:
                    kept_scales[key] = scales[key].contiguous()
            elif has_rows[key]:
                batch[key] = tensor.index_select(0, select) if select is not None else tensor
                batch[key] = batch[key].contiguous()
                if key in scales:
                    scale = scales[key]
                    scale = scale.index_select(0, select) if select is not None else scale
                    kept_scales[key] = scale.contiguous()
            else:
                unit = "samples" if tokens is None else "selected tokens"
                skipped[key] = (
                    f"shape {tuple(tensor.shape)} has no row per "
                    f"{unit.removesuffix('s')} in a batch of {rows} {unit}, though earlier "
                    "batches stored this key row by row"
                )
        every = [*batch.values(), *kept_scales.values()]
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in every)
        record = BatchRecord.of(dataloader_idx, batch_idx, batch[INDEX_KEY], without_rows)
        return SelectedBatch(record, batch, frozenset(per_batch), skipped, nbytes, kept_scales)

    @staticmethod
    def _has_rows(
        key: str,
        stored: torch.Tensor,
        rows: int,
        tokens: TokenSelection | None,
        token_keys: Collection[str],
    ) -> bool:
        """Whether a tensor has a row per row of the batch (a selected tensor, for tokens)."""
        if tokens is not None and tokens.reduce is None:
            return key in token_keys
        return bool(stored.dim()) and stored.shape[0] == rows

    def _storable(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor as stored (on the CPU), with its scale per row where it is scaled."""
        problem = None
        scale = None
        if tensor.is_nested:
            problem = "a nested tensor; store its components as separate outputs"
        elif tensor.layout != torch.strided:
            problem = f"a {tensor.layout} tensor; make it dense (`.to_dense()`) in the model"
        elif tensor.is_meta:
            problem = "a meta tensor, which holds no data"
        else:
            single = tensor.dim() < 2 or math.prod(tensor.shape[1:]) == 1
            if self.dtype in SCALED_DTYPES and tensor.is_floating_point():
                if self._single.setdefault(key, single):  # a scale would outweigh the value
                    tensor = unscaled(tensor.detach(), self.dtype, key)
                else:
                    tensor, scale = quantize(tensor.detach(), self.dtype, key)
                    scale = scale.to("cpu")
            elif self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            if tensor.dtype not in STORABLE_DTYPES:
                names = ", ".join(dtype_name(dtype) for dtype in STORABLE_DTYPES)
                problem = (
                    f"of dtype {dtype_name(tensor.dtype)}, which safetensors cannot store "
                    f"(it stores {names}); convert it in the model"
                )
        if problem is not None:
            raise StoreError(f"FeatureWriter cannot store {key!r}: it is {problem}")
        return tensor.detach().to("cpu").resolve_conj().resolve_neg(), scale

    def _new_rows(
        self,
        dataloader_idx: int,
        batch_idx: int,
        indices: Sequence[int],
        repeated: Sequence[bool] | None,
    ) -> dict[int, int]:
        """The rows to write (new indices, first occurrence, not padding): position -> index."""
        checked = []
        for value in indices:
            try:
                index = operator.index(value)
            except TypeError:
                index = -1
            if not 0 <= index <= _LARGEST or isinstance(value, bool):
                raise StoreError(
                    f"FeatureWriter needs a non-negative integer dataset index (below 2**63) "
                    f"for every sample, but batch {batch_idx} of dataloader {dataloader_idx} has "
                    f"{value!r}; use a sampler that yields dataset positions"
                )
            checked.append(index)
        seen = self._seen.get(dataloader_idx)
        stored = seen.contains(_as_array(checked)).tolist() if seen else [False] * len(checked)
        keep: dict[int, int] = {}
        fresh: set[int] = set()
        for position, (index, known) in enumerate(zip(checked, stored, strict=True)):
            padding = repeated is not None and position < len(repeated) and repeated[position]
            if known or index in fresh or padding:
                continue
            keep[position] = index
            fresh.add(index)
        return keep


def _as_array(indices: Sequence[int]) -> np.ndarray:
    return np.fromiter((operator.index(i) for i in indices), dtype=np.int64, count=len(indices))


def _coordinates(tokens: TokenSelection) -> dict[str, torch.Tensor]:
    """The coordinate keys of a token selection's rows: position and token id, where known."""
    coordinates = {}
    if tokens.position is not None:
        coordinates[POSITION_KEY] = tokens.position.to(torch.int32)
    if tokens.token_id is not None:
        coordinates[TOKEN_ID_KEY] = tokens.token_id
    return coordinates
