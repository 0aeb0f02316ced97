"""Activation patching from a store: each sample of a batch gets its own stored row.

:class:`StorePatch` patches a module's value with rows read from a store by the dataset
index of each sample of the batch (e.g. the clean activations a predict run dumped,
patched into a run of corrupted versions of the same samples). It cannot apply until it
knows the batch's indices: :meth:`StorePatch.for_batch` reads the rows and gives the
concrete edit of the batch, a :class:`~lightning_iocatch.capture.edits.Patch` (one row per
sample), or, for a store of token rows, a :class:`PatchAt` that patches exactly the
stored ``(sample, position)`` places and leaves every other place as it is.

The store is any object with ``rows_at(key, indices)`` returning ``(rows, sample,
position)`` as :meth:`FeatureStore.rows_at <lightning_iocatch.store.reader.FeatureStore.rows_at>`
does (this package imports no store): a sample the store does not hold is refused there,
naming it, never patched with zeros.

In a plain loop (``IOCaptureCallback(edits=[StorePatch(...)])`` does it per batch):

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher
    >>> class Clean:  # a stand-in for FeatureStore: the row of sample i is i
    ...     path = "clean"
    ...     def rows_at(self, key, indices):
    ...         rows = torch.tensor(indices, dtype=torch.float32)[:, None].expand(-1, 3)
    ...         return rows, torch.arange(len(indices)), None
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    >>> patch = StorePatch("0", Clean(), "0/outputs")
    >>> with ModelIOCatcher(net, "cpu")(edits=[patch.for_batch([4, 7])]):
    ...     out = net(torch.randn(2, 2))
    >>> out.tolist()
    [[4.0, 4.0, 4.0], [7.0, 7.0, 7.0]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from lightning_iocatch.capture.edits import Edit, Patch
from lightning_iocatch.errors import CaptureError

__all__ = ["PatchAt", "RowSource", "StorePatch", "refuse_left_padding"]


class RowSource(Protocol):
    """What :class:`StorePatch` reads from: a
    :class:`~lightning_iocatch.store.reader.FeatureStore`, or an object of your own.

    ``rows_at(key, indices)`` returns ``(rows, sample, position)``: the rows of ``key`` of
    the samples ``indices`` (dataset indices), each sample's rows together in the order
    asked, ``sample[i]`` the place in ``indices`` of ``rows[i]``'s sample, ``position[i]``
    its token position (``None`` for one row per sample); it raises for an index it does
    not hold. ``path`` says where it is (recorded by :meth:`StorePatch.describe`).
    """

    @property
    def path(self) -> Any: ...

    def rows_at(self, key: str, indices: Sequence[int]) -> Any: ...


class PatchAt(Edit):
    """Patching at chosen places of a ``[batch, seq, ...]`` value: ``value[sample[i],
    position[i]]`` becomes ``rows[i]`` (cast to the value's dtype); every other place is
    left as it is (and ``positions``, if given, restricts the places further).

    Args:
        rows: ``[n, ...]``, each row of the shape ``value.shape[2:]``.
        sample: ``[n]`` integers: the place in the batch of each row.
        position: ``[n]`` integers: the place in the sequence (dimension 1) of each row.
        batch_size: the number of samples the value must have (``None``: any).
    """

    def __init__(
        self,
        module: str,
        rows: torch.Tensor,
        sample: torch.Tensor,
        position: torch.Tensor,
        *,
        batch_size: int | None = None,
        **where: Any,
    ) -> None:
        super().__init__(module, **where)
        for name, places in (("sample", sample), ("position", position)):
            if places.dim() != 1 or len(places) != len(rows) or places.is_floating_point():
                raise ValueError(
                    f"`{name}` must be {len(rows)} integers, one per row of `rows`, got "
                    f"{places.dtype} of shape {tuple(places.shape)}"
                )
        self.rows, self.sample, self.position = rows, sample.long(), position.long()
        self.batch_size = batch_size

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        size = self.batch_size
        where = f"{self.module!r}'s {self.kind} of shape {tuple(value.shape)}"
        if value.dim() < 2 or (size is not None and len(value) != size):
            expected = f"[{size if size is not None else 'batch'}, seq, ...]"
            raise ValueError(f"PatchAt patches {expected} values: {where} is not one")
        if len(self.rows) and (
            int(self.sample.min()) < 0
            or int(self.sample.max()) >= value.shape[0]
            or int(self.position.min()) < 0
            or int(self.position.max()) >= value.shape[1]
        ):
            raise ValueError(
                f"PatchAt has places up to sample {int(self.sample.max())}, position "
                f"{int(self.position.max())} (smallest {int(self.sample.min())}, "
                f"{int(self.position.min())}): outside {where}"
            )
        if tuple(self.rows.shape[1:]) != tuple(value.shape[2:]):
            raise ValueError(
                f"PatchAt's rows have shape {tuple(self.rows.shape[1:])}, the places of "
                f"{where} {tuple(value.shape[2:])}: they must be equal"
            )
        device = value.device
        patched = value.clone()
        rows = self.rows.to(device=device, dtype=value.dtype)
        patched[self.sample.to(device), self.position.to(device)] = rows
        return patched


class StorePatch(Edit):
    """Activation patching by dataset index: each sample's value becomes its row of
    ``key`` in ``store`` (a :class:`~lightning_iocatch.store.reader.FeatureStore`, see
    :class:`RowSource`), cast to the value's dtype.

    It applies only through :meth:`for_batch`: ``IOCaptureCallback(edits=[...])`` gives it
    each batch's dataset indices (a DataLoader whose indices are unknown, an
    IterableDataset or a shuffling sampler, is refused); in a plain loop, open the
    session with ``edits=[patch.for_batch(indices)]`` per batch, or call
    ``session.set_batch_indices(indices)`` before each batch's forward.

    A store of one row per sample patches the whole value of each sample (``positions``
    may restrict the places, as for any edit). A store of token rows patches the places
    it stored, ``value[i, position]`` for each stored row of sample ``indices[i]``, and
    leaves the rest of the sequence as it is; its positions are taken as columns of the
    value (dimension 1), which they are for batches without left padding (a store's
    positions count from each sequence's first real token: ``IOCaptureCallback`` and
    ``InterventionEffects`` refuse a left-padded batch, see :func:`refuse_left_padding`).

    Args:
        module: the module's name (exact).
        store: where the rows are read from.
        key: the stored key, e.g. ``"model.layers.3/outputs"`` (``store.keys()``).
        where: ``kind``, ``call``, ``argument``, ``positions``, as for every :class:`Edit`.
    """

    def __init__(self, module: str, store: RowSource, key: str, **where: Any) -> None:
        super().__init__(module, **where)
        if not isinstance(key, str):
            raise TypeError(f"`key` must be a stored key (a str), got {type(key).__name__}")
        if not callable(getattr(store, "rows_at", None)):
            raise TypeError(
                "`store` must be a FeatureStore (or have `rows_at(key, indices)`), got "
                f"{type(store).__name__}"
            )
        found = store.rows_at(key, [])  # the store checks the key now, naming those it has
        self.store, self.key = store, key
        self._tokens = found[2] is not None  # token rows: patched at their positions

    def __repr__(self) -> str:
        return (
            f"StorePatch({self.module!r}, {str(getattr(self.store, 'path', self.store))!r}, "
            f"{self.key!r}, kind={self.kind!r}, call={self.call})"
        )

    def for_batch(self, indices: Sequence[int] | None) -> Edit:
        """The patch of a batch whose samples have the dataset ``indices``, in batch order:
        their rows read from the store now (an index it does not hold raises there)."""
        if indices is None:
            raise CaptureError(
                f"{self!r} patches each sample with its stored row, by dataset index, but "
                "this batch's dataset indices are unknown: its DataLoader has an "
                "IterableDataset, a shuffling sampler, or a batch sampler Lightning cannot "
                "re-create. Use a map-style Dataset in a DataLoader with `batch_size=` and "
                "no shuffling (in a plain loop, give `for_batch` the batch's indices)"
            )
        indices = [int(index) for index in indices]
        rows, sample, position = self.store.rows_at(self.key, indices)
        where: dict[str, Any] = dict(
            kind=self.kind, call=self.call, argument=self.argument, positions=self.positions
        )
        if position is None:
            if not torch.equal(sample, torch.arange(len(indices))):
                raise CaptureError(
                    f"{self!r}: the store gave {len(rows)} rows for {len(indices)} samples; "
                    "a store of one row per sample gives one each"
                )
            return Patch(self.module, rows, **where)
        stored = position >= 0  # -1: a sample without a selected token (reduce first/last)
        return PatchAt(
            self.module,
            rows[stored],
            sample[stored],
            position[stored],
            batch_size=len(indices),
            **where,
        )

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        raise CaptureError(
            f"{self!r} applies only to a batch whose dataset indices it knows: open the "
            "session with `edits=[patch.for_batch(indices)]`, or call "
            "`session.set_batch_indices(indices)` before the batch's forward "
            "(IOCaptureCallback does it for every batch)"
        )

    def describe(self) -> dict[str, Any]:
        """As :meth:`Edit.describe`, with the store by its path (and its dataloader index,
        where it has one), not by what it holds."""
        described = super().describe()
        described["store"] = str(getattr(self.store, "path", type(self.store).__name__))
        dataloader_idx = getattr(self.store, "dataloader_idx", None)
        if isinstance(dataloader_idx, int):
            described["dataloader_idx"] = dataloader_idx
        return described


def refuse_left_padding(edits: Sequence[Edit], batch: Any) -> None:
    """Raise where a :class:`StorePatch` of token rows meets a left-padded batch (a mapping
    whose ``attention_mask`` starts a sequence with padding): a store's token positions
    count from each sequence's first real token, so they would not be its columns.

    Examples:
        >>> refuse_left_padding([], {"attention_mask": torch.tensor([[0, 1]])})  # no patch
    """
    if not any(isinstance(edit, StorePatch) and edit._tokens for edit in edits):
        return
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and len(mask):
        left = (mask[:, 0] == 0) & mask.bool().any(1)
        if bool(left.any()):
            raise CaptureError(
                "a StorePatch of token rows patches each stored token at its position, "
                "counted from the sequence's first real token, but this batch is padded on "
                "the left (attention_mask starts with 0): the positions would not be its "
                "columns. Pad on the right (tokenizer.padding_side = 'right')"
            )
