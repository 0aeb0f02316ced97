"""The monitor's transform of a watched batch: each captured tensor becomes its statistics
vector on its device (:func:`~lightning_iocatch.probes.health.health_statistics`), a
gradient under a GradScaler as that of the true gradient, with the scale of its own
backward (the transform is applied as each gradient arrives). Given the batch's number of
samples, it also flags, per key, the samples that hold a non-finite value.

Examples:
    >>> import torch
    >>> from lightning_iocatch.capture.transform import Site
    >>> statistics = _Statistics(None, histogram=False)
    >>> statistics.capture(torch.ones(2, 3), Site("m", "outputs", 0))[:2].tolist()
    [6.0, 1.0]
"""

from __future__ import annotations

import torch

from lightning_iocatch.capture.keys import entry_prefix
from lightning_iocatch.capture.transform import Site
from lightning_iocatch.probes.health import HEAD, health_statistics
from lightning_iocatch.token_mask import masks

__all__: list[str] = []


class _Statistics:
    """The transform of a watched batch: each floating tensor becomes its statistics
    vector, on its device; the order of the captures is kept (execution order)."""

    def __init__(
        self, rows: torch.Tensor | None, histogram: bool, samples: int | None = None
    ) -> None:
        self.rows, self.histogram, self.samples = rows, histogram, samples
        self.order: list[str] = []  # the keys' prefixes, in the order captured
        self.scale: torch.Tensor | None = None  # a GradScaler's scale of this backward
        self.bad_rows: dict[str, torch.Tensor | None] = {}  # prefix -> a flag per sample

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor:
        prefix = entry_prefix(site.module, site.kind, site.call)  # as the flat keys begin
        if prefix not in self.order:
            self.order.append(prefix)
        if not tensor.is_floating_point():
            return tensor.new_zeros(0, dtype=torch.float64)  # nothing to watch
        rows = self.rows if masks(tensor, self.rows) else None
        if self.samples is not None:
            self._note_rows(prefix, tensor, rows)
        if self.scale is None or not site.kind.startswith("grad_"):
            return health_statistics(tensor, rows, self.histogram)
        return _unscaled_statistics(tensor, rows, self.histogram, self.scale)

    def _note_rows(self, prefix: str, tensor: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Which of the batch's ``samples`` hold a non-finite value of ``tensor`` (at a real
        token, with ``rows``): a bool per sample, on the device (no host sync), where the
        tensor's first dimension is the samples; ``None`` where that cannot be told."""
        flags: torch.Tensor | None = None
        if tensor.dim() and tensor.shape[0] == self.samples:
            bad = ~torch.isfinite(tensor.detach())
            if rows is not None:  # the first two dimensions are (batch, sequence)
                bad = (bad.flatten(2).any(-1) if bad.dim() > 2 else bad) & rows.to(bad.device)
            flags = bad.flatten(1).any(1) if bad.dim() > 1 else bad
        if prefix in self.bad_rows:  # another tensor of the same key's prefix
            held = self.bad_rows[prefix]
            flags = None if held is None or flags is None else held | flags
        self.bad_rows[prefix] = flags


def _unscaled_statistics(
    tensor: torch.Tensor, rows: torch.Tensor | None, histogram: bool, scale: torch.Tensor
) -> torch.Tensor:
    """The statistics of a gradient taken in a backward of a loss multiplied by ``scale``
    (a GradScaler's), as those of the true gradient, on the device: the moments divided by
    the scale's powers, the counts unchanged (a histogram needs the values themselves)."""
    scale = scale.to(tensor.device, torch.float64)
    if histogram:
        return health_statistics(tensor.double() / scale, rows, histogram)
    vector = health_statistics(tensor, rows, histogram)
    one = torch.ones_like(scale)
    divisor = torch.cat([one, scale, scale**2, scale**3, scale**4, scale, one, one])
    return torch.cat([vector[:HEAD] / divisor, vector[HEAD:]])
