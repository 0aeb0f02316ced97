"""Unit statistics over a store: a :class:`~lightning_iocatch.probes.UnitActivations`
fed every stored row of a key once, each sample's tokens together.

Examples:
    >>> import tempfile
    >>> from lightning_iocatch.store.plan import prepare_store
    >>> from lightning_iocatch.store.writer import ShardWriter
    >>> path = tempfile.mkdtemp() + "/store"
    >>> writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", {"spec": None}))
    >>> writer.write({"h": torch.tensor([[1.0, 0.0], [3.0, 2.0]])}, indices=[4, 5])
    2
    >>> writer.close()
    >>> summary = summarize_store(path, "h", UnitActivations(k=1, window=0))
    >>> summary.top_index.tolist(), summary.density().tolist()
    ([[5], [5]], [1.0, 0.5])
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.probes.units import UnitActivations
from lightning_iocatch.store.reader import FeatureStore
from lightning_iocatch.store.stored_batches import RowBatch

__all__ = ["summarize_store"]


def summarize_store(
    store: FeatureStore | str | os.PathLike[str],
    key: str,
    probe: UnitActivations | None = None,
    *,
    rows_per_step: int = 8192,
    storage_options: dict[str, Any] | None = None,
) -> UnitSummary:
    """``probe`` (default ``UnitActivations()``) over every row of ``key`` in ``store``.

    Reads each stored batch once, in commit order (:meth:`FeatureStore.row_batches`),
    and feeds the rows in steps of about ``rows_per_step`` rows cut between samples
    (smaller stored batches joined), so a sample's tokens (and an example's window) are
    always seen together. Token rows
    carry their dataset index, position and token id; a store of one row per sample
    gives examples without positions. The result does not depend on the batches the
    store was written in, nor on ``rows_per_step``.

    In several processes (``torch.distributed`` initialised, e.g. by a launcher or inside a
    Lightning hook), call it in every process: each reads every ``world``-th stored batch
    and the probe merges the processes' results, the same as one process's.

    Args:
        store: a :class:`~lightning_iocatch.FeatureStore`, or the path or URL of one.
        key: a key with one row per token or sample (``store.keys()``).
        probe: the probe to feed (its settings: ``k``, ``window``, ``of=`` an encoder...);
            it is reset first.
        rows_per_step: rows given to the probe at a time (memory: this many rows of the
            probe's units, e.g. an encoder's latents, besides the stored batches of one
            shard, which are read together).
        storage_options: fsspec options when ``store`` is a URL.
    """
    if not isinstance(store, FeatureStore):
        store = FeatureStore(store, storage_options=storage_options)
    probe = UnitActivations() if probe is None else probe
    if not isinstance(probe, UnitActivations):
        raise TypeError(f"`probe` must be a UnitActivations, got {type(probe).__name__}")
    if rows_per_step < 1:
        raise ValueError(f"`rows_per_step` must be at least 1, got {rows_per_step}")
    probe.reset()
    distributed = dist.is_available() and dist.is_initialized()
    share = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    pending: list[RowBatch] = []  # stored batches smaller than a step, fed together
    for batch in store.row_batches(key, share):
        if batch.rows.dim() > 2:
            raise ValueError(
                f"{key!r} holds whole sequences {tuple(batch.rows.shape[1:])} a row, padding "
                "included: dump it with FeatureWriter(tokens=TokenRows()) for one row per real "
                "token, or give the probe the sequences with their mask (probe.update(..., "
                "tokens=attention_mask))"
            )
        if pending and pending[0].rows.shape[1:] != batch.rows.shape[1:]:
            _feed(probe, _joined(pending), rows_per_step)  # the probe refuses the new width
            pending = []
        pending.append(batch)
        if sum(len(part.indices) for part in pending) >= rows_per_step:
            _feed(probe, _joined(pending), rows_per_step)
            pending = []
    if pending:
        _feed(probe, _joined(pending), rows_per_step)
    return probe.compute().with_key(key)


def _feed(probe: UnitActivations, batch: RowBatch, rows_per_step: int) -> None:
    """``batch`` into ``probe`` in steps of about ``rows_per_step`` rows."""
    for start, stop in _steps(batch.indices, rows_per_step):
        probe.update(
            batch.rows[start:stop],
            indices=batch.indices[start:stop],
            positions=None if batch.positions is None else batch.positions[start:stop],
            token_ids=None if batch.token_ids is None else batch.token_ids[start:stop],
        )


def _joined(batches: list[RowBatch]) -> RowBatch:
    """Stored batches as one (each holds whole samples: so does the whole)."""
    if len(batches) == 1:
        return batches[0]

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts)  # type: ignore[arg-type]

    indices = torch.cat([part.indices for part in batches])
    rows = torch.cat([part.rows for part in batches])
    positions = cat([part.positions for part in batches])
    return RowBatch(indices, positions, cat([part.token_ids for part in batches]), rows)


def _steps(index: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of about ``size`` rows (more for a longer sample),
    never cutting a run of equal ``index`` (a sample's tokens)."""
    rows = index.shape[0]
    if rows <= size:
        return [(0, rows)]
    changes = (index[1:] != index[:-1]).nonzero().squeeze(1) + 1
    bounds = torch.cat([changes, torch.tensor([rows])])  # where each sample ends
    steps, start = [], 0
    while start < rows:
        last = int(torch.searchsorted(bounds, start + size, right=True)) - 1
        stop = int(bounds[last]) if last >= 0 else 0
        if stop <= start:  # one sample longer than a step: it is the step
            stop = int(bounds[int(torch.searchsorted(bounds, start, right=True))])
        steps.append((start, stop))
        start = stop
    return steps
