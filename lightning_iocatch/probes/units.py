"""UnitActivations: what excites each unit (top examples) and how often (density), streamed.

Memory is ``O(units * k * window)`` per process whatever the rows; see
:mod:`~lightning_iocatch.probes.top_examples` for the order of examples (value, then
dataset index, then position: the same result whatever the batches, their order or the
processes) and :mod:`~lightning_iocatch.probes.unit_density` for the density.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_iocatch.probes.base import _checked_tokens, _kept, _ProbeMetric, masked_by
from lightning_iocatch.probes.top_examples import Rows, Top, empty_top, merge_tops
from lightning_iocatch.probes.unit_density import Density, empty_density
from lightning_iocatch.probes.unit_pass import update_units
from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.token_mask import token_coordinates

__all__ = ["UnitActivations"]

_TOP = tuple(f"top_{name}" for name in Top._fields)
_DENSITY = Density._fields
_DTYPES = {
    name: state.dtype
    for names, states in ((_TOP, empty_top(0, 0, 0)), (_DENSITY, empty_density(0, 1)))
    for name, state in zip(names, states, strict=True)
}


class UnitActivations(_ProbeMetric):
    """Per unit of a captured value: its ``k`` top examples and its activation density.

    ``compute()`` returns a :class:`~lightning_iocatch.probes.UnitSummary` (save it and
    look at it with ``lightning-iocatch browse``). Through ``IOCaptureCallback(probes=...)``
    it is computed for each captured value at the end of each validation or test epoch
    (``capture.probes.summaries[key]``), merged across processes.

    Units are the last dimension of a ``(rows, units)`` tensor, or the trailing
    dimensions after ``(batch, seq)`` of a larger one. A ``(batch, seq, ...)`` tensor is
    one row per real token (the ``tokens`` mask, as every probe counts them; each token's
    position counted from its sequence's first real token, as token rows store it); a
    2-dimensional one is one row per sample, or per stored token row when ``positions``
    are given. Rows flagged in ``repeated`` (a sampler's padding) are left out.

    Args:
        k: top examples kept per unit (0: density only).
        window: tokens each side of an example kept with it (ids and this unit's values).
        above: only values greater than this fill example slots: by default 0, what
            excites a unit (the zeros of ReLU-like units would otherwise tie); ``None``: the
            ``k`` largest, whatever they are. NaN and ``-inf`` never do.
        threshold: a unit is active on a row where its value is greater than this.
        log10_range: the range of the histogram of log10 active values, in decades.
        bins: the histogram's number of equal bins.
        index: ``index(batch)`` gives each sample's dataset index where the loop does
            not know it (a shuffled validation loader; ``indices`` win where known), e.g.
            ``lambda batch: batch["index"]``.
        of: a module or function applied to the values first (under ``torch.no_grad``),
            keeping their leading dimensions: e.g. a sparse autoencoder's encoder, to
            follow its latents. A module moves with the probe (``.to(device)``) and gets
            the values on its parameters' device and in their dtype (bfloat16 captures of
            a ``bf16-mixed`` run into a float32 encoder; a dump's rows into an encoder on a
            GPU, where the probe then counts).
        name: the probe's name in logged names and ``capture.probes.summaries``
            (``{key}/{name}``): give two such probes of one value different names.

    Examples:
        >>> probe = UnitActivations(k=2, window=1)
        >>> hidden = torch.tensor([[[0.0, 1.0], [4.0, 0.0], [2.0, 2.0]]])  # (batch, seq, units)
        >>> probe.update(hidden, indices=[7], token_ids=torch.tensor([[11, 12, 13]]))
        >>> summary = probe.compute()
        >>> summary.top_values[0].tolist(), summary.top_position[0].tolist()
        ([4.0, 2.0], [1, 2])
        >>> summary.context_ids[0, 0].tolist(), summary.context_values[0, 0].tolist()
        ([11, 12, 13], [0.0, 4.0, 2.0])
    """

    wants_coordinates: ClassVar[bool] = True
    rows: Tensor
    active: Tensor
    active_sum: Tensor
    histogram: Tensor

    def __init__(
        self,
        k: int = 20,
        window: int = 8,
        above: float | None = 0.0,
        threshold: float = 0.0,
        log10_range: tuple[float, float] = (-4.0, 3.0),
        bins: int = 70,
        index: Callable[[Any], Any] | None = None,
        of: Callable[[Tensor], Tensor] | None = None,
        name: str = "units",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for option, value in (("k", k), ("window", window), ("bins", bins)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{option}` must be a non-negative int, got {value!r}")
        low, high = (float(edge) for edge in log10_range)
        if not low < high or bins < 1:
            raise ValueError(
                f"`log10_range` must be (low, high) with low < high and `bins` at least 1, "
                f"got {log10_range!r} and {bins!r}"
            )
        if index is not None and not callable(index):
            raise TypeError(f"`index` must be a function of the batch, got {index!r:.60}")
        if of is not None and not callable(of):
            raise TypeError(f"`of` must be a module or a function of the values, got {of!r:.60}")
        self.k, self.window, self.bins, self.index, self.of = k, window, bins, index, of
        owner = getattr(of, "__self__", None)
        if isinstance(owner, torch.nn.Module) and not isinstance(of, torch.nn.Module):
            self.of_module = owner  # a method of a module (sae.encode): it moves with the probe
        self.name = name
        for option, number in (("above", above), ("threshold", threshold)):
            if number is not None and not math.isfinite(float(number)):
                raise ValueError(f"`{option}` must be a finite number, got {number!r}")
        self.above = None if above is None else float(above)
        self.threshold, self.log10_range = float(threshold), (low, high)
        for state_name, state in zip(_TOP, empty_top(0, k, window), strict=True):
            self.add_state(state_name, state, dist_reduce_fx=None)  # stacked, merged in compute
        for state_name, state in zip(_DENSITY, empty_density(0, bins), strict=True):
            self.add_state(state_name, state, dist_reduce_fx="sum")

    def update(
        self,
        features: Tensor,
        batch: Any = None,
        indices: Sequence[int] | Tensor | None = None,
        repeated: Sequence[bool] | None = None,
        tokens: Tensor | None = None,
        positions: Tensor | None = None,
        token_ids: Tensor | None = None,
    ) -> None:
        """Count one batch.

        Args:
            features: ``(batch, seq, ...)`` or ``(rows, units)`` floating values.
            batch: the batch (for ``index(batch)``, and its ``attention_mask`` and
                ``input_ids`` where ``positions`` and ``token_ids`` are not given).
            indices: each sample's (or row's) dataset index; needed when ``k > 0``.
            repeated: per sample, whether it is padding to leave out.
            tokens: the bool ``(batch, seq)`` mask of real tokens.
            positions: each token's position, ``(batch, seq)`` (or ``(rows,)`` for rows);
                by default from the batch, as token rows record them.
            token_ids: each token's id, of the same shape; by default the batch's
                ``input_ids``.
        """
        if not isinstance(features, Tensor) or not features.is_floating_point():
            raise ValueError(f"UnitActivations takes floating tensors, got {features!r:.80}")
        if features.dim() == 0:
            raise ValueError(
                f"UnitActivations takes values of shape (rows, units), (rows,) or (batch, seq, "
                f"...), got a 0-d tensor {features!r:.40}: give a row per sample or token"
            )
        values = features.detach()
        if self.of is not None:
            with torch.no_grad():
                holder = getattr(self, "of_module", self.of)
                values = self.of(values.to(*_placement_of(holder, values)))
            if (
                not isinstance(values, Tensor)
                or values.dim() == 0
                or values.shape[: features.dim() - 1] != features.shape[:-1]
            ):
                shown = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
                raise ValueError(
                    f"UnitActivations(of=...) must keep the leading dimensions of the values "
                    f"{tuple(features.shape[:-1])}, got {shown}"
                )
        values = values[:, None] if values.dim() == 1 else values
        rows = self._rows(values, batch, indices, repeated, tokens, positions, token_ids)
        self._take(rows)

    def _rows(
        self,
        values: Tensor,
        batch: Any,
        indices: Any,
        repeated: Any,
        tokens: Tensor | None,
        positions: Tensor | None,
        token_ids: Tensor | None,
    ) -> Rows:
        samples = values.shape[0]
        index = self._index(batch, indices, samples, values.device)
        tokens = _checked_tokens(tokens, samples)
        tokens = None if tokens is None else tokens.to(values.device)
        keep = _kept(repeated, samples, values.device, tokens)
        if values.dim() == 2:
            where = slice(None) if keep is None else keep
            position = _per_row(positions, samples, values.device, default=-1)
            ids = None if token_ids is None else _per_row(token_ids, samples, values.device)
            return Rows(
                values[where], index[where], position[where], None if ids is None else ids[where]
            )
        seq = values.shape[1]
        values = values.reshape(samples, seq, -1) if values.numel() else values.flatten(2)
        real = tokens if masked_by(values, tokens) else None
        mask = (
            torch.ones(samples, seq, dtype=torch.bool, device=values.device)
            if real is None
            else real
        )
        if positions is None or (token_ids is None and self.window):
            # where the batch has no padding mask of its own, the mask of real tokens says
            # where each sequence starts (left padding)
            padding = None if _has_padding_mask(batch, mask) else (lambda _: mask)
            found_positions, found_ids = token_coordinates(batch, mask, padding=padding)
            positions = found_positions if positions is None else positions
            token_ids = found_ids if token_ids is None else token_ids
        for name, given in (("positions", positions), ("token_ids", token_ids)):
            if given is not None and tuple(given.shape) != (samples, seq):
                raise ValueError(
                    f"UnitActivations: `{name}` has shape {tuple(given.shape)} for values of "
                    f"(batch, seq) = {(samples, seq)}"
                )
        device = values.device
        flat = values.flatten(0, 1)  # a view where it can be (an empty batch too)
        if real is None and keep is None:  # every token counts: the rows as they are
            at = None
            sample = torch.arange(samples, device=device).repeat_interleave(seq)
        else:
            counted = mask if keep is None else mask & keep[:, None]
            at = counted.reshape(-1).nonzero().squeeze(1)  # sample * seq + column
            sample, flat = at // seq, flat.index_select(0, at)
        position = _tokens_at(positions.to(device, torch.int64), at)
        ids = None if token_ids is None else _tokens_at(token_ids.to(device, torch.int64), at)
        return Rows(flat, index[sample], position, ids)

    def _index(self, batch: Any, indices: Any, samples: int, device: torch.device) -> Tensor:
        """Each sample's dataset index: ``indices`` where known, else ``index(batch)``; when
        neither is known (only allowed with ``k=0``), -1."""
        found = indices
        if found is None and self.index is not None and batch is not None:
            found = self.index(batch)
        if found is None:
            if self.k:
                raise ValueError(
                    "UnitActivations names each example by its dataset index, and this "
                    "batch's are unknown (a shuffled or custom sampler): pass "
                    "`index=lambda batch: ...` giving them (return them from your "
                    "dataset), use an unshuffled loader, or k=0 for the density only"
                )
            return torch.full((samples,), -1, dtype=torch.int64, device=device)
        found = torch.as_tensor(found, dtype=torch.int64).reshape(-1).to(device)
        if found.shape[0] != samples:
            raise ValueError(
                f"UnitActivations: {found.shape[0]} dataset indices for a batch of "
                f"{samples} samples (or rows)"
            )
        return found

    def _take(self, rows: Rows) -> None:
        units = rows.values.shape[1]
        if self.active.shape[0] == 0 and units:
            self._set(empty_top(units, self.k, self.window, rows.values.device))
            self._set(empty_density(units, self.bins, rows.values.device))
        elif units != self.active.shape[0]:
            raise ValueError(
                f"UnitActivations: this batch has {units} units, earlier ones "
                f"{self.active.shape[0]}; a probe follows one value of a fixed width"
            )
        if rows.values.shape[0] == 0:
            return
        states = update_units(self._top(), self._density(), rows, above=self.above,
                              threshold=self.threshold, log10_range=self.log10_range)  # fmt: skip
        for state in states:
            self._set(state)

    def _top(self) -> Top:
        return Top(*(getattr(self, name) for name in _TOP))

    def _density(self) -> Density:
        return Density(*(getattr(self, name) for name in _DENSITY))

    def _set(self, state: Top | Density) -> None:
        names = _TOP if isinstance(state, Top) else _DENSITY
        for name, value in zip(names, state, strict=True):
            setattr(self, name, value)

    def _layout(self) -> int:
        return int(self.active.shape[0])

    def _align(self, layouts: list[int]) -> None:
        widths = sorted({units for units in layouts if units})
        if len(widths) > 1:
            raise ValueError(
                f"UnitActivations: the processes saw {widths} units; one value, one width"
            )
        if widths and self.active.shape[0] == 0:
            self._set(empty_top(widths[0], self.k, self.window, self.active.device))
            self._set(empty_density(widths[0], self.bins, self.active.device))

    def _wrap_compute(self, compute: Callable) -> Callable:
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(wrapped)
        def shaped(*args: Any, **kwargs: Any) -> Any:
            summary = wrapped(*args, **kwargs)  # squeezed by torchmetrics where one unit
            if not isinstance(summary, UnitSummary):
                return summary
            units = summary.histogram.numel() // self.bins  # (units, bins), bins >= 1
            return summary.reshape((units, self.k, 2 * self.window + 1))

        return shaped

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        """``forward`` and ``merge_state``: ``incoming_state`` taken in by the rules of a
        sync (examples by their order, counts and sums added)."""
        units = incoming_state["active"].shape[0]
        if units == 0:
            return
        if self.active.shape[0] == 0:
            for name in (*_TOP, *_DENSITY):
                setattr(self, name, incoming_state[name].clone())
            return
        if units != self.active.shape[0]:
            raise ValueError(
                f"UnitActivations: merging states of {units} and {self.active.shape[0]} units"
            )
        mine = self._top()
        theirs = Top(*(incoming_state[name] for name in _TOP))
        self._set(merge_tops(Top(*(torch.stack(pair) for pair in zip(theirs, mine, strict=True)))))
        for name in _DENSITY:
            setattr(self, name, getattr(self, name) + incoming_state[name])

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> torch.nn.Module:
        """``.to(...)``: the states move, and keep their dtypes (an ``of=`` module converts)."""
        this = super()._apply(fn, exclude_state)
        defaults: dict[str, Any] = self._defaults  # super()._apply returns self
        for name, dtype in _DTYPES.items():
            setattr(self, name, getattr(self, name).to(dtype))
            defaults[name] = defaults[name].to(dtype)
        return this

    def compute(self) -> UnitSummary:
        top = self._top()
        if top.values.dim() == 3:  # synced: one top per process, stacked
            top = merge_tops(top)
        values = torch.where(top.values == float("-inf"), torch.nan, top.values)
        return UnitSummary(
            rows=int(self.rows),
            active=self.active,
            active_sum=self.active_sum,
            histogram=self.histogram,
            top_values=values,
            top_index=top.indices,
            top_position=top.positions,
            context_ids=top.context_ids,
            context_values=top.context_values,
            threshold=self.threshold,
            above=self.above,
            log10_range=self.log10_range,
        )


def _has_padding_mask(batch: Any, mask: Tensor) -> bool:
    """Whether ``batch`` holds an ``attention_mask`` of the mask's shape (the padding mask
    token rows count positions from)."""
    found = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return isinstance(found, Tensor) and tuple(found.shape) == tuple(mask.shape)


def _placement_of(of: Any, values: Tensor) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of a module's first floating parameter (an encoder on a GPU
    gets the rows there, in its dtype); the values' own for a function."""
    if isinstance(of, torch.nn.Module):
        for parameter in of.parameters():
            if parameter.is_floating_point():
                return parameter.device, parameter.dtype
    return values.device, values.dtype


def _tokens_at(given: Tensor, at: Tensor | None) -> Tensor:
    """The ``(batch, seq)`` ``given`` of the tokens ``at`` (flat numbers; ``None``: all)."""
    flat = given.reshape(-1)
    return flat if at is None else flat.index_select(0, at)


def _per_row(given: Tensor | None, rows: int, device: torch.device, default: int = -1) -> Tensor:
    if given is None:
        return torch.full((rows,), default, dtype=torch.int64, device=device)
    found = torch.as_tensor(given).reshape(-1).to(device, torch.int64)
    if found.shape[0] != rows:
        raise ValueError(
            f"UnitActivations: {found.shape[0]} positions or token ids for {rows} rows"
        )
    return found
