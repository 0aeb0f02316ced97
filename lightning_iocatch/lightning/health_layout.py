"""The layout of a watched step's statistics in the monitor's one collective.

Every process must send a vector of the same length to an ``all_gather``, whatever it
watched. The processes agree on the layout (the keys, and each key's per-unit width) once,
on the first watched step, with two small gathers of the keys' names; the layout is cached
and on later steps each process packs its statistics into it, so a watched step costs one
``all_gather``. Each key's block is ``[head | units | flag]``: a key a process did not see
sends zeros (a count of 0, which merges as nothing), a key whose width differs from the
layout's sends its head, zeros for its units and ``flag = 1``, so the merged dead fraction
of that key is left out (NaN) rather than wrong. The vector's last entry counts the keys
a process saw that the layout lacks (warned about, once a key) and the keys whose width
does not fit the layout (a width that changed since the agreement, or that differed
between processes then): since every process reads every process's count, all of them
agree on a new layout on the next watched step, so a dead fraction is NaN for that one
step, not for the rest of the fit. Nothing here can leave one process waiting for the
others.

Examples:
    >>> layout = HealthLayout(head=2)
    >>> layout.agree(None, {"a": torch.tensor([1.0, 2.0, 1.0])})  # one process: no collective
    >>> layout.pack({"a": torch.tensor([1.0, 2.0, 1.0])}).tolist()
    [1.0, 2.0, 1.0, 0.0, 0.0]
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

from lightning_iocatch.probes.base import _gather_tensors
from lightning_iocatch.probes.health import HealthFigures, merge_statistics

__all__ = ["HealthLayout", "alone_figures"]

Figures = tuple[dict[str, HealthFigures], dict[str, torch.Tensor]]
"""Each key's figures and its part of the vectors read (a row a counted process)."""


class HealthLayout:
    """The keys and per-unit widths every process packs its statistics into.

    Args:
        head: the length of a statistics vector before its per-unit part.
    """

    def __init__(self, head: int) -> None:
        self.head = head
        self.widths: dict[str, int] | None = None  # key -> units (0: widths differed)
        self.unknown: list[str] = []  # keys seen in the last pack that the layout lacks
        self._warned: set[str] = set()

    def agree(self, strategy: Any, vectors: dict[str, torch.Tensor]) -> None:
        """Agree on the keys (the union over processes) and their widths (a width that
        differs between processes: none). ``strategy=None``: this process alone."""
        mine = {key: len(vector) - self.head for key, vector in vectors.items()}
        if strategy is None:
            self.widths = dict(sorted(mine.items()))
            return
        every = _gather_objects(strategy, sorted(mine.items()))
        widths: dict[str, set[int]] = {}
        for pairs in every:
            for key, width in pairs:
                widths.setdefault(key, set()).add(width)
        self.widths = {
            key: next(iter(w)) if len(w) == 1 else 0 for key, w in sorted(widths.items())
        }

    def forget(self) -> None:
        """Agree again on the next watched step."""
        self.widths = None

    def pack(
        self, vectors: dict[str, torch.Tensor], device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """This process's statistics as one vector in the layout's order on ``device`` (the
        collective's), its last entry the number of keys the layout lacks (each warned
        about once) or whose width does not fit it."""
        assert self.widths is not None, "agree() first"  # internal order, not user input
        options: dict[str, Any] = {"dtype": torch.float64, "device": device}
        parts = []
        misfits = 0
        for key, width in self.widths.items():
            vector = vectors.get(key)
            if vector is None:
                parts.append(torch.zeros(self.head + width + 1, **options))
            elif len(vector) == self.head + width:
                parts += [vector.to(device), torch.zeros(1, **options)]
            else:  # the per-unit part does not fit the layout: left out of the merge
                parts += [vector[: self.head].to(device), torch.zeros(width, **options)]
                parts.append(torch.ones(1, **options))
                misfits += 1
        self.unknown = [key for key in vectors if key not in self.widths]
        for key in self.unknown:
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"ActivationMonitor: {key!r} was not watched on the step the processes "
                    "agreed on the logged keys; it is left out of this step's figures and "
                    "the processes agree again on the next watched step",
                    stacklevel=2,
                )
        parts.append(torch.full((1,), float(len(self.unknown) + misfits), **options))
        return torch.cat(parts)

    def unpack(self, gathered: torch.Tensor) -> dict[str, tuple[torch.Tensor, bool]]:
        """Each key's ``[processes, head + units]`` part of the gathered vectors, and
        whether the per-unit part is valid on every process."""
        assert self.widths is not None, "agree() first"
        found: dict[str, tuple[torch.Tensor, bool]] = {}
        start = 0
        for key, width in self.widths.items():
            end = start + self.head + width
            found[key] = (gathered[:, start:end], not bool(gathered[:, end].any()))
            start = end + 1
        return found

    def gathered_figures(
        self, strategy: Any, vectors: dict[str, torch.Tensor], counted: list[int],
        histogram: bool,
    ) -> Figures:  # fmt: skip
        """The figures of every process's statistics, gathered in one collective (the
        ``counted`` processes' rows: each sample once) and merged; a process that saw a
        key the layout lacks makes every process agree again on the next step."""
        flat = self.pack(vectors, strategy.root_device)
        gathered = _gather_tensors(flat).reshape(strategy.world_size, -1).cpu()
        gathered = gathered[counted]
        blocks = self.unpack(gathered)
        if self.any_unknown(gathered):
            self.forget()
        figures: dict[str, HealthFigures] = {}
        parts: dict[str, torch.Tensor] = {}
        for key, (part, units_valid) in blocks.items():
            merged = merge_statistics(part)
            found = HealthFigures.of(merged if units_valid else merged[: self.head], histogram)
            if found.count or found.nan or found.inf:  # not a key no process saw
                figures[key], parts[key] = found, part
        return figures, parts

    @staticmethod
    def any_unknown(gathered: torch.Tensor) -> bool:
        """Whether a process saw keys the layout lacks or a width that does not fit it
        (then agree again)."""
        return bool(gathered[:, -1].any())


def _gather_objects(strategy: Any, value: Any) -> list[Any]:
    """``value`` of every process (JSON), through ``torch.distributed.all_gather``: the
    lengths first, then the bytes padded to the longest."""
    device = strategy.root_device
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    sizes = _gather_tensors(torch.tensor([len(data)], device=device)).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: len(data)] = data
    every = _gather_tensors(padded).reshape(len(sizes), -1).cpu()
    return [
        json.loads(bytes(row[:size].tolist()).decode())
        for row, size in zip(every, sizes, strict=True)
    ]


def alone_figures(
    device: torch.device | str, vectors: dict[str, torch.Tensor], histogram: bool
) -> Figures:
    """The figures of one process's statistics (the only process: nothing to agree on or
    merge), keys in a layout's order, read off the device in one transfer a vector length.

    Examples:
        >>> from lightning_iocatch.probes.health import health_statistics
        >>> figures, _ = alone_figures("cpu", {"a": health_statistics(torch.ones(2))}, False)
        >>> figures["a"].count, figures["a"].mean
        (2, 1.0)
    """
    keys = sorted(vectors)
    by_length: dict[int, list[str]] = {}  # vectors of one length read together
    for key in keys:
        by_length.setdefault(len(vectors[key]), []).append(key)
    found: dict[str, HealthFigures] = {}
    for same in by_length.values():
        stacked = torch.stack([vectors[key].to(device) for key in same])
        found.update(zip(same, HealthFigures.of_many(stacked, histogram), strict=True))
    figures: dict[str, HealthFigures] = {}
    parts: dict[str, torch.Tensor] = {}
    for key in keys:
        if found[key].count or found[key].nan or found[key].inf:  # not a key unseen
            figures[key], parts[key] = found[key], vectors[key][None]
    return figures, parts
