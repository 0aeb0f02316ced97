"""PinnedRing: a fixed pinned staging area for asynchronous device-to-host copies.

One page-locked buffer of ``capacity`` bytes, allocated once on first use, is handed out
in ring order. A copy lands in a region of it; when the copy is complete (its event has
been waited for), its bytes move to ordinary memory and the region is free again. So
page-locked memory never grows past ``capacity``, whatever consumers keep, and a full
ring waits only for its oldest copy in flight, whose end the host link bounds: never for
a consumer, never on a timer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["PinnedRing", "StagedCopy"]


class _Event(Protocol):
    def synchronize(self) -> None: ...


class StagedCopy:
    """One copy through the ring: ``staging`` (a view of the ring) fills asynchronously.

    :meth:`synchronize` waits for the copy's event, moves the bytes from ``staging`` to
    ``destination`` (ordinary memory: the value consumers see) and frees the region.
    It is what a :class:`~lightning_iocatch.CaptureBuffer` waits on before it lets anyone
    read ``destination``; calling it again does nothing.
    """

    def __init__(self, ring: PinnedRing, offset: int, nbytes: int) -> None:
        self.ring, self.offset, self.nbytes = ring, offset, nbytes
        self.staging: torch.Tensor | None = None
        self.destination: torch.Tensor | None = None
        self.event: _Event | None = None
        self.done = False

    def start(self, staging: torch.Tensor, destination: torch.Tensor, event: _Event) -> None:
        """The copy into ``staging`` is enqueued; ``event`` completes when it has landed."""
        self.staging, self.destination, self.event = staging, destination, event

    def synchronize(self) -> None:
        with self.ring._lock:
            if self.done:
                return
            if self.event is None or self.staging is None or self.destination is None:
                raise RuntimeError("a staged copy was waited for before it was started")
            self.event.synchronize()
            # A capture made under torch.inference_mode() (Lightning's predict and evaluation
            # loops) is an inference tensor, as on the synchronous path; it may only be
            # filled in that mode, whichever mode reads it.
            with torch.inference_mode(self.destination.is_inference()):
                self.destination.copy_(self.staging)
            self.staging = None
            self.done = True
            self.ring.in_flight_bytes -= self.nbytes
            self.ring._drop_finished()


class PinnedRing:
    """``capacity`` bytes of pinned memory, handed out in ring order to copies in flight.

    ``allocate(nbytes)`` makes the buffer (:meth:`~.host_copy.CudaOps.pinned` allocates
    page-locked host memory; tests pass ordinary memory). Regions start at
    multiples of ``align`` bytes. Thread-safe.

    Examples:
        >>> ring = PinnedRing(1024, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
        >>> copy, staging = ring.stage(torch.Size([64]), torch.float32)  # 256 bytes
        >>> ring.in_flight_bytes
        256
        >>> class Done:
        ...     def synchronize(self): pass
        >>> destination = torch.empty(64)
        >>> copy.start(staging, destination, Done())
        >>> copy.synchronize(); ring.in_flight_bytes
        0
    """

    def __init__(
        self,
        capacity: int,
        *,
        align: int = 256,
        allocate: Callable[[int], torch.Tensor],
    ) -> None:
        if capacity <= 0 or align <= 0:
            raise ValueError("`capacity` and `align` must be > 0")
        self.capacity, self.align = capacity, align
        self._allocate = allocate
        self._buffer: torch.Tensor | None = None
        self._fifo: deque[StagedCopy] = deque()  # in ring order, oldest first
        self._head = 0  # where the next region starts, if it fits
        self._lock = threading.RLock()
        self.waits = 0  # times a copy had to wait for the oldest one in flight
        self.in_flight_bytes = 0  # held by copies not yet moved to ordinary memory
        self.peak_in_flight = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` can ever go through the ring."""
        return 0 < nbytes <= self.capacity

    def stage(self, shape: torch.Size, dtype: torch.dtype) -> tuple[StagedCopy, torch.Tensor]:
        """Reserve a region for a tensor of ``shape`` and ``dtype``; return it and its view.

        Waits for the oldest copies in flight while the ring has no room. The caller
        enqueues the copy into the view, then calls :meth:`StagedCopy.start`.
        """
        nbytes = shape.numel() * dtype.itemsize
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes do not fit a ring of {self.capacity} bytes")
        with self._lock:
            if self._buffer is None:  # a normal tensor, also when first used in inference mode
                with torch.inference_mode(False):
                    self._buffer = self._allocate(self.capacity)
            offset = self._place(nbytes)
            while offset is None:
                self.waits += 1
                self._fifo[0].synchronize()  # the oldest copy in flight; frees its region
                offset = self._place(nbytes)
            copy = StagedCopy(self, offset, nbytes)
            self._fifo.append(copy)
            self._head = offset + self._rounded(nbytes)
            self.in_flight_bytes += nbytes
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight_bytes)
            view = self._buffer[offset : offset + nbytes].view(dtype).view(shape)
            return copy, view

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def _place(self, nbytes: int) -> int | None:
        """Where a region of ``nbytes`` fits now, or ``None``."""
        size = self._rounded(nbytes)
        if not self._fifo:
            self._head = 0
            return 0 if nbytes <= self.capacity else None
        tail = self._fifo[0].offset  # start of the oldest region still held
        if self._head > tail:  # held: [tail, head); free: [head, end) and [0, tail)
            if self._head + nbytes <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None  # free: [head, tail)

    def cancel(self, copy: StagedCopy) -> None:
        """Give back the region of a copy that failed before it was started."""
        with self._lock:
            if not copy.done and copy.event is None:
                copy.done = True
                self.in_flight_bytes -= copy.nbytes
                self._drop_finished()

    def _drop_finished(self) -> None:
        while self._fifo and self._fifo[0].done:
            self._fifo.popleft()
