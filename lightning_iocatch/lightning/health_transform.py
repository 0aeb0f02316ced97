"""The monitor's transform of a watched batch: each captured tensor becomes its statistics
vector on its device (:func:`~lightning_iocatch.probes.health.health_statistics`), a
gradient under a GradScaler as that of the true gradient, with the scale of its own
backward (the transform is applied as each gradient arrives). Given the batch's number of
samples, it also flags, per key, the samples that hold a non-finite value.

A small tensor (at most 65,536 values of float32, float16 or bfloat16: a block's output
on a fast step) is not reduced alone: its values are copied, as float64, into a block
of its shape kept from one watched step to the next (:class:`StatisticsBlocks`), and
the block is reduced in one call (:func:`~lightning_iocatch.probes.health.batch_statistics`)
when the batch's captures are read (:meth:`_Statistics.vector`), or when it is full: a
few dozen operations for all of them instead of as many for each, and no fresh memory.
Until then the capture holds a placeholder (its place, an ``int64`` tensor of one value
on the CPU); the figures are those of the tensor alone, bit for bit.

Examples:
    >>> import torch
    >>> from lightning_iocatch.capture.transform import Site
    >>> statistics = _Statistics(None, histogram=False)
    >>> held = statistics.capture(torch.ones(2, 3), Site("m", "outputs", 0))
    >>> statistics.vector(held)[:2].tolist()
    [6.0, 1.0]
"""

from __future__ import annotations

import threading

import torch

from lightning_iocatch.capture.keys import entry_prefix
from lightning_iocatch.capture.transform import Site
from lightning_iocatch.probes.health import (
    HEAD,
    _selected,
    batch_statistics,
    batched,
    health_statistics,
)
from lightning_iocatch.token_mask import masks

__all__: list[str] = []

_BLOCK = 32
"""The most tensors of one shape reduced together (a block of 32 x 65,536 float64 values
and its scratch: 32 MiB at most)."""

Shape = tuple[int, int, torch.device]  # rows, units, device


class StatisticsBlocks:
    """The float64 blocks the small tensors of a watched batch are copied into, one per
    shape (rows, units, device) with its scratch, kept from step to step (the monitor
    holds them for a fit): after the first watched step a capture allocates nothing."""

    def __init__(self) -> None:
        self._blocks: dict[Shape, tuple[torch.Tensor, torch.Tensor]] = {}
        self._used: set[Shape] = set()  # the shapes asked for since :meth:`keep_used`

    def block(self, shape: Shape, tensors: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block of ``shape`` and its scratch, room for ``tensors`` at least (grown,
        its first entries kept, when it has less)."""
        self._used.add(shape)
        held = self._blocks.get(shape)
        if held is not None and len(held[0]) >= tensors:
            return held
        rows, units, device = shape
        size = min(_BLOCK, max(tensors, 2 * len(held[0]) if held is not None else tensors))
        new = torch.empty(size, rows, units, dtype=torch.float64, device=device)
        if held is not None:
            new[: len(held[0])] = held[0]
        grown = new, torch.empty_like(new)
        self._blocks[shape] = grown
        return grown

    def keep_used(self) -> None:
        """Drop the blocks of shapes no tensor asked for since the last call (a batch's
        real tokens change its rows from step to step: each would otherwise stay)."""
        self._blocks = {shape: b for shape, b in self._blocks.items() if shape in self._used}
        self._used = set()

    def clear(self) -> None:
        """Drop the blocks (the fit ended)."""
        self._blocks, self._used = {}, set()


class _Statistics:
    """The transform of a watched batch: each floating tensor becomes its statistics
    vector, on its device, or for a small one a placeholder :meth:`vector` reads; the
    order of the captures is kept (execution order)."""

    def __init__(
        self,
        rows: torch.Tensor | None,
        histogram: bool,
        samples: int | None = None,
        blocks: StatisticsBlocks | None = None,
    ) -> None:
        self.rows, self.histogram, self.samples = rows, histogram, samples
        self.order: dict[str, None] = {}  # the keys' prefixes, in the order captured
        self.scale: torch.Tensor | None = None  # a GradScaler's scale of this backward
        self.bad_rows: dict[str, torch.Tensor | None] = {}  # prefix -> a flag per sample
        self._blocks = blocks if blocks is not None else StatisticsBlocks()
        self._waiting: dict[Shape, list[tuple[int, torch.Tensor | None]]] = {}  # by shape
        self._vectors: list[torch.Tensor | None] = []  # by place: reduced, or still waiting
        self._lock = threading.Lock()

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor:
        prefix = entry_prefix(site.module, site.kind, site.call)  # as the flat keys begin
        self.order.setdefault(prefix)
        if not tensor.is_floating_point():
            return tensor.new_zeros(0, dtype=torch.float64)  # nothing to watch
        rows = self.rows if masks(tensor, self.rows) else None
        if self.samples is not None:
            self._note_rows(prefix, tensor, rows)
        scale = self.scale if site.kind.startswith("grad_") else None
        if batched(tensor) and (scale is None or not self.histogram):
            return self._defer(tensor, rows, scale)
        if scale is None:
            return health_statistics(tensor, rows, self.histogram)
        return _unscaled_statistics(tensor, rows, self.histogram, scale)

    def _defer(
        self, tensor: torch.Tensor, rows: torch.Tensor | None, scale: torch.Tensor | None
    ) -> torch.Tensor:
        """Copy ``tensor``'s selected rows into its shape's block; its place, as a tensor."""
        values = _selected(tensor, rows)
        units = values.shape[-1] if values.dim() else 1
        if values.numel() == 0:  # no row selected: nothing to reduce together
            return health_statistics(tensor, rows, self.histogram)
        shape = (values.numel() // units, units, values.device)
        with self._lock:  # gradients of two devices arrive on two autograd threads
            waiting = self._waiting.setdefault(shape, [])
            block, _ = self._blocks.block(shape, len(waiting) + 1)
            block[len(waiting)].copy_(values.reshape(shape[:2]))  # float64, a private copy
            place = len(self._vectors)
            self._vectors.append(None)
            waiting.append((place, scale))
            if len(waiting) == _BLOCK:  # full: reduced now
                self._reduce(shape)
        return torch.full((1,), place, dtype=torch.int64)  # on the CPU: no transfer

    def _reduce(self, shape: Shape) -> None:
        """Reduce the tensors waiting in ``shape``'s block, in one call."""
        waiting = self._waiting.pop(shape, [])
        if not waiting:
            return
        block, scratch = self._blocks.block(shape, len(waiting))
        found = batch_statistics(block[: len(waiting)], self.histogram, scratch[: len(waiting)])
        for (place, scale), vector in zip(waiting, found, strict=True):
            self._vectors[place] = vector if scale is None else _unscaled(vector, scale)

    def vector(self, captured: torch.Tensor) -> torch.Tensor:
        """The statistics vector of a capture: itself, or the one its placeholder holds
        the place of (every tensor waiting is reduced first)."""
        if captured.dtype != torch.int64:
            return captured
        for shape in list(self._waiting):
            self._reduce(shape)
        vector = self._vectors[int(captured)]
        assert vector is not None  # reduced above
        return vector

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
    if histogram:
        scale = scale.to(tensor.device, torch.float64)
        return health_statistics(tensor.double() / scale, rows, histogram)
    return _unscaled(health_statistics(tensor, rows, histogram), scale)


def _unscaled(vector: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A statistics vector (no histogram) of a gradient of the loss times ``scale``, as
    that of the true gradient: the moments divided by the scale's powers."""
    scale = scale.to(vector.device, torch.float64)
    one = torch.ones_like(scale)
    divisor = torch.cat([one, scale, scale**2, scale**3, scale**4, scale, one, one])
    return torch.cat([vector[:HEAD] / divisor, vector[HEAD:]])
