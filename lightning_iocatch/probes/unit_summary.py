"""UnitSummary: what :class:`~lightning_iocatch.probes.UnitActivations` found, in one file.

Per unit: its top examples (value, dataset index, token position, the tokens around it
with the unit's value on each) and its density (how often it is active, its mean when
active, a histogram of its log10 values). Saved as one safetensors file
(:meth:`UnitSummary.save`, :meth:`UnitSummary.load`): tensors plus the settings in the
header, readable without this package (``safetensors.torch.load_file``).

Examples:
    >>> import tempfile, os
    >>> from lightning_iocatch.probes import UnitActivations
    >>> probe = UnitActivations(k=2, window=0)
    >>> probe.update(torch.tensor([[0.0, 3.0], [2.0, 5.0], [0.5, 0.0]]), indices=[10, 11, 12])
    >>> summary = probe.compute()
    >>> summary.top_index.tolist(), summary.density().tolist()
    ([[11, 12], [11, 10]], [0.6666666666666666, 0.6666666666666666])
    >>> path = os.path.join(tempfile.mkdtemp(), "units.safetensors")
    >>> summary.save(path)
    >>> UnitSummary.load(path).top_values.tolist()
    [[2.0, 0.5], [5.0, 3.0]]
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

__all__ = ["FORMAT", "UnitSummary"]

FORMAT = "lightning-iocatch-units/1"
_TENSORS = (
    "active",
    "active_sum",
    "histogram",
    "top_values",
    "top_index",
    "top_position",
    "context_ids",
    "context_values",
)


@dataclass
class UnitSummary:
    """Per-unit statistics of one captured value (see the module docstring).

    Attributes:
        rows: the rows counted (real tokens, or samples for per-sample values).
        active: ``(U,)`` rows where the unit was above ``threshold``.
        active_sum: ``(U,)`` float64 sum of those values.
        histogram: ``(U, bins)`` counts of log10 of the active values over
            ``log10_range`` (lower values in the first bin, higher in the last).
        top_values: ``(U, k)`` float64, best first; NaN in an empty slot.
        top_index: ``(U, k)`` the example's dataset index; -1 in an empty slot.
        top_position: ``(U, k)`` its token position (as token rows store it); -1 for a
            whole sample or an empty slot.
        context_ids: ``(U, k, 2 * window + 1)`` token ids around the example (its own in
            the middle); -1 where there is no token (or no ids were known).
        context_values: ``(U, k, 2 * window + 1)`` float32: the unit's value on each of
            those tokens; NaN where there is none.
        threshold, above, log10_range: the settings they were computed with.
        key: the captured value's flat key (``""`` when unknown).
    """

    rows: int
    active: Tensor
    active_sum: Tensor
    histogram: Tensor
    top_values: Tensor
    top_index: Tensor
    top_position: Tensor
    context_ids: Tensor
    context_values: Tensor
    threshold: float
    above: float | None
    log10_range: tuple[float, float]
    key: str = ""

    def __post_init__(self) -> None:
        self.reshape()

    def reshape(self, shape: tuple[int, int, int] | None = None) -> UnitSummary:
        """Give each tensor its documented shape again, in place (torchmetrics squeezes the
        one-element tensors a ``compute()`` returns: those of one unit, and with ``k=1``
        and ``window=0`` its context too): ``shape`` is ``(units, k, 2 * window + 1)``,
        by default :attr:`context_ids`' own."""
        units, slots, span = self.context_ids.shape if shape is None else shape
        self.active, self.active_sum = self.active.reshape(units), self.active_sum.reshape(units)
        bins = self.histogram.numel() // units if units else self.histogram.shape[-1]
        self.histogram = self.histogram.reshape(units, bins)
        for name in ("top_values", "top_index", "top_position"):
            setattr(self, name, getattr(self, name).reshape(units, slots))
        for name in ("context_ids", "context_values"):
            setattr(self, name, getattr(self, name).reshape(units, slots, span))
        return self

    @property
    def units(self) -> int:
        """The number of units (the captured value's last dimension, or its trailing ones)."""
        return int(self.active.shape[0])

    @property
    def k(self) -> int:
        """Slots of top examples per unit."""
        return int(self.top_values.shape[1])

    @property
    def window(self) -> int:
        """Tokens each side of an example in its context."""
        return int(self.context_ids.shape[2]) // 2

    def density(self) -> Tensor:
        """``(U,)`` float64: the fraction of rows where each unit is active."""
        return self.active.double() / max(self.rows, 1)

    def mean_active(self) -> Tensor:
        """``(U,)`` float64: each unit's mean over its active rows (NaN if never active)."""
        return self.active_sum / self.active.double()

    def edges(self) -> Tensor:
        """The ``bins + 1`` edges of :attr:`histogram`, in log10 units."""
        low, high = self.log10_range
        return torch.linspace(low, high, self.histogram.shape[1] + 1, dtype=torch.float64)

    def density_histogram(self, per_decade: int = 5) -> tuple[Tensor, Tensor, int]:
        """The layer's feature-density histogram: ``(counts, edges, dead)``.

        ``counts`` of the units active at least once, by ``log10(density)`` over bins of
        ``1 / per_decade`` decade from the decade of one row in all (``log10(1 / rows)``,
        floored) to 0 (the last bin includes 0); ``dead`` the units never active.

        Examples:
            >>> from lightning_iocatch.probes import UnitActivations
            >>> probe = UnitActivations(k=0)
            >>> rows = torch.tensor([[1.0, 0.0, 0.0]] * 99 + [[1.0, 1.0, 0.0]])
            >>> probe.update(rows)  # densities 1, 0.01 and 0
            >>> counts, edges, dead = probe.compute().density_histogram(per_decade=1)
            >>> counts.tolist(), edges.tolist(), dead
            ([1, 1], [-2.0, -1.0, 0.0], 1)
        """
        density = self.density()
        alive = density[self.active > 0]
        low = math.floor(math.log10(1 / max(self.rows, 1))) if self.rows > 1 else -1
        bins = max(1, -low * per_decade)
        edges = torch.linspace(low, 0, bins + 1, dtype=torch.float64)
        slot = ((alive.log10() - low) * per_decade).floor().long().clamp(0, bins - 1)
        counts = torch.bincount(slot, minlength=bins)
        return counts, edges, int((self.active == 0).sum())

    def scalars(self) -> dict[str, float]:
        """The few numbers a logger gets: ``dead_frac`` (units never active),
        ``density_median`` (over the units, the mean of the two middle ones for an even
        number, as NumPy's) and ``rows``."""
        density = self.density()
        median = float(density.quantile(0.5)) if self.units else math.nan
        dead = float((self.active == 0).double().mean()) if self.units else math.nan
        return {"dead_frac": dead, "density_median": median, "rows": float(self.rows)}

    def examples(self, unit: int) -> list[dict[str, Any]]:
        """The filled slots of ``unit``, best first: ``value``, ``index``, ``position``,
        ``context_ids`` and ``context_values`` (lists)."""
        found = []
        for slot in range(self.k):
            if int(self.top_index[unit, slot]) < 0:
                break
            found.append(
                {
                    "value": float(self.top_values[unit, slot]),
                    "index": int(self.top_index[unit, slot]),
                    "position": int(self.top_position[unit, slot]),
                    "context_ids": self.context_ids[unit, slot].tolist(),
                    "context_values": self.context_values[unit, slot].tolist(),
                }
            )
        return found

    def with_key(self, key: str) -> UnitSummary:
        """This summary named for the captured value ``key``."""
        return replace(self, key=key)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write one safetensors file: the tensors, the settings in its header."""
        settings = {
            "format": FORMAT,
            "rows": self.rows,
            "threshold": self.threshold,
            "above": self.above,
            "log10_range": list(self.log10_range),
            "key": self.key,
        }
        tensors = {name: getattr(self, name).contiguous().cpu() for name in _TENSORS}
        save_file(tensors, os.fspath(path), metadata={"settings": json.dumps(settings)})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> UnitSummary:
        """Read a file :meth:`save` wrote.

        Raises:
            ValueError: the file is not a saved summary.
        """
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), "pt") as handle:
                header = handle.metadata() or {}
        except SafetensorError as error:
            raise ValueError(
                f"{os.fspath(path)!r} is not a unit summary (not a safetensors file: {error}); "
                "give the file that UnitSummary.save wrote"
            ) from None
        try:
            settings = json.loads(header["settings"])
            if settings.get("format") != FORMAT:
                raise KeyError("format")
        except (KeyError, json.JSONDecodeError):
            raise ValueError(
                f"{os.fspath(path)!r} is not a unit summary ({FORMAT}): make one with a "
                "UnitActivations probe (summarize_store(store, key, probe) over a dump, or "
                "capture.probes.summaries[key] after validation) and save it with .save(path)"
            ) from None
        tensors = load_file(os.fspath(path))
        low, high = settings["log10_range"]
        return cls(
            rows=int(settings["rows"]),
            threshold=float(settings["threshold"]),
            above=settings["above"],
            log10_range=(float(low), float(high)),
            key=settings["key"],
            **{name: tensors[name] for name in _TENSORS},
        )

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in ("key", "rows", "threshold", "above")
        )
        return f"UnitSummary(units={self.units}, k={self.k}, window={self.window}, {shown})"
