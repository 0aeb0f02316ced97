"""Asynchronous GPU-to-CPU copies of captured tensors that cannot race with the model.

Why it cannot race (PyTorch's CUDA semantics, https://pytorch.org/docs/stable/notes/cuda.html,
"Asynchronous execution" and "CUDA streams"): kernels on one stream run in the order
they were enqueued, and work on another stream is ordered against it only through
events (``wait_stream``/``wait_event``). For each captured tensor, inside the hook:

1. **Snapshot on the model's stream.** A device-to-device copy (cast included) is
   enqueued on the *current* stream, after the kernels that produced the tensor and
   before every kernel the model enqueues later. An in-place op after the captured
   module (``out += identity``, ``ReLU(inplace=True)``, a module changing its input)
   therefore runs after the snapshot was taken: it can never change a capture.
2. **Copy the snapshot to the host on a side stream.** The side stream waits for the
   current stream (so it starts after the snapshot is written), copies the snapshot,
   never the model's tensor, into a region of a :class:`~.pinned_ring.PinnedRing`, and
   records an event.
3. **Keep the snapshot's memory until the copy has read it.** ``record_stream`` tells
   the caching allocator that the side stream uses the snapshot, so its memory is not
   handed to new work before the copy is done, even though Python drops it at once.
4. **Read only after the event.** The captured value is an ordinary (pageable) tensor
   that is filled from the ring when the event has completed
   (:meth:`~lightning_iocatch.capture.pinned_ring.StagedCopy.synchronize`); the capture buffer
   calls that before any read, and the ring calls it before reusing the region.

Bounds, per catcher (each ``ModelIOCatcher`` and ``IOCaptureCallback`` has its own
ring): page-locked memory is the ring's ``capacity`` (``pinned_memory_bytes``), fixed.
Snapshots live on the GPU only while their copy is in flight, and every copy in flight
holds a region of the ring of at least the snapshot's size; the snapshot of the capture
being staged exists while the ring makes room for it, so the GPU memory held by
snapshots is at most ``pinned_memory_bytes`` plus the largest single capture. A tensor
larger than the whole ring, or not dense (sparse, nested, quantized), is copied
synchronously (``.to("cpu")``), which is ordered on the current stream as well. A copy
that fails before it starts (out of memory, Ctrl-C) gives its region back.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_iocatch.capture.pinned_ring import PinnedRing, StagedCopy

__all__ = ["CudaOps", "HostCopier"]


class CudaOps:
    """The CUDA calls of the asynchronous path; tests replace them with CPU fakes."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def is_source(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on a CUDA device (and so may be copied asynchronously)."""
        return tensor.is_cuda

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def snapshot(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A private, contiguous copy on the current stream (step 1)."""
        return tensor.detach().to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)

    def copy_to_host(self, staging: torch.Tensor, snapshot: torch.Tensor) -> Any:
        """Enqueue ``staging.copy_(snapshot)`` on the side stream (steps 2-3); its event."""
        device = snapshot.device
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        side = self._side[device]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            staging.copy_(snapshot, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        snapshot.record_stream(side)
        return done


class HostCopier:
    """Copies device tensors to the host through a fixed :class:`PinnedRing`.

    ``capacity`` is the ring's size in bytes. :meth:`copy` returns the host tensor and
    appends the :class:`StagedCopy` that must be waited for before the tensor is read.
    """

    def __init__(self, capacity: int, ops: CudaOps | None = None) -> None:
        self.ops = ops if ops is not None else CudaOps()
        self.ring = PinnedRing(capacity, allocate=self.ops.pinned)

    def accepts(self, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``tensor`` (cast to ``dtype``) takes the asynchronous path: a dense
        (strided, not nested or quantized) device tensor that fits the ring."""
        return (
            self.ops.is_source(tensor)
            and tensor.layout == torch.strided
            and not tensor.is_nested
            and not tensor.is_quantized
            and self.ring.fits(tensor.numel() * dtype.itemsize)
        )

    def copy(
        self, tensor: torch.Tensor, dtype: torch.dtype, pending: list[StagedCopy]
    ) -> torch.Tensor:
        snapshot = self.ops.snapshot(tensor, dtype)  # before anything can wait: step 1 first
        staged, staging = self.ring.stage(tensor.shape, dtype)
        try:
            destination = torch.empty(tensor.shape, dtype=dtype)
            staged.start(staging, destination, self.ops.copy_to_host(staging, snapshot))
        except BaseException:
            self.ring.cancel(staged)  # the region is free again; nothing waits on it
            raise
        pending.append(staged)
        return destination
