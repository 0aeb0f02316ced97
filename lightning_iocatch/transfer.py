"""Copy captured values out of a live forward: detach, clone, move and cast, keeping structure.

This module is the only place where captured tensors change device or dtype. Two ways:

- :func:`transfer_to_device`: synchronous; what it returns is complete.
- :class:`CaptureTransfer`: what the catcher uses. CUDA tensors bound for the CPU are
  copied asynchronously into pinned host memory on a side stream, ordered after the
  kernels that produced them; it returns the CUDA events that mark the copies done, and
  nothing may read the host tensors before those events complete (the capture buffer
  waits for them on every read). Pinned memory is capped by a :class:`PinnedBudget`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "CaptureTransfer",
    "NotCaptured",
    "PinnedBudget",
    "map_tensors",
    "snapshot",
    "transfer_to_device",
]

# Values kept as they are in a capture: immutable, so they cannot change after it.
_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    slice,
    range,
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


@dataclasses.dataclass(frozen=True)
class NotCaptured:
    """Stands in a capture for an object the library does not copy.

    A capture is a snapshot: tensors are copied, and mappings, lists, tuples, namedtuples
    and dataclasses are rebuilt around the copies; immutable values (numbers, strings,
    ``None``, dtypes, devices, enums) are kept. Any other object, such as the cache that
    Hugging Face passes to every decoder layer as ``past_key_values``, is live state of
    the running model that may change right after the capture: it is replaced by this
    placeholder, which names its type.

    Example:
        >>> class Cache: ...
        >>> snapshot({"x": torch.ones(1), "cache": Cache(), "n": 3})["cache"]
        NotCaptured(type_name='lightning_iocatch.transfer.Cache')
    """

    type_name: str

    @classmethod
    def of(cls, obj: object) -> NotCaptured:
        kind = type(obj)
        return cls(f"{kind.__module__}.{kind.__qualname__}")


def _keep(obj: Any) -> Any:
    return obj


def map_tensors(
    obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], other: Callable[[Any], Any] = _keep
) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor inside it.

    Recurses through mappings (the mapping type is kept: an ``OrderedDict`` stays one, a
    Hugging Face ``ModelOutput`` stays a ``ModelOutput``), lists, tuples, namedtuples and
    dataclasses; containers are always new objects; anything else becomes ``other(obj)``
    (by default: returned as it is).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _map_mapping(obj, fn, other)
    if isinstance(obj, list):
        return type(obj)(map_tensors(v, fn, other) for v in obj)
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn, other) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if type(obj) is tuple:
            return tuple(items)
        return type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_dataclass(obj, fn, other)
    return other(obj)


def _keep_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _placeholder_unless_immutable(obj: Any) -> Any:
    return obj if isinstance(obj, _IMMUTABLE) else NotCaptured.of(obj)


def _map_mapping(
    mapping: Mapping[Any, Any],
    fn: Callable[[torch.Tensor], torch.Tensor],
    other: Callable[[Any], Any],
) -> Any:
    items = {key: map_tensors(value, fn, other) for key, value in mapping.items()}
    try:
        result: Any = copy.copy(mapping)
        for key, value in items.items():
            result[key] = value
        return result
    except TypeError:  # immutable mapping types: fall back to a plain dict
        return items


def _map_dataclass(
    obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], other: Callable[[Any], Any]
) -> Any:
    result = copy.copy(obj)
    for field in dataclasses.fields(obj):
        value = map_tensors(getattr(obj, field.name), fn, other)
        object.__setattr__(result, field.name, value)  # works for frozen dataclasses too
    return result


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _copy_tensor(
    tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None
) -> torch.Tensor:
    # copy=True: a private copy even when the move and the cast are no-ops (no aliasing).
    return tensor.detach().to(
        device=device or tensor.device, dtype=_target_dtype(tensor, dtype), copy=True
    )


def transfer_to_device(
    obj: Any, device: torch.device | str | None, *, dtype: torch.dtype | None = None
) -> Any:
    """Return a copy of ``obj`` whose tensors are detached, private and on ``device``.

    Structure is kept as :func:`map_tensors` says. Every tensor is detached from
    autograd and copied, also when it is already on ``device`` (or when ``device`` is
    ``None``), so later in-place operations of the model cannot change a captured value.
    ``dtype`` casts floating-point tensors only. Copies from a GPU to the CPU are
    synchronous, so a returned tensor is always complete.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> out = transfer_to_device({"h": (x * 2,), "n": 3}, "cpu", dtype=torch.float16)
        >>> out["h"][0], out["h"][0].requires_grad, out["n"]
        (tensor([2., 2.], dtype=torch.float16), False, 3)
    """
    return map_tensors(obj, lambda tensor: _copy_tensor(tensor, device, dtype))


def snapshot(
    obj: Any, device: torch.device | str | None = None, *, dtype: torch.dtype | None = None
) -> Any:
    """What a capture keeps of ``obj``: :func:`transfer_to_device`, and a :class:`NotCaptured`
    placeholder for every object that is neither a tensor, a container of the kinds
    :func:`map_tensors` rebuilds, nor an immutable value.
    """
    copied = map_tensors(obj, lambda tensor: _copy_tensor(tensor, device, dtype))
    return map_tensors(copied, _keep_tensor, _placeholder_unless_immutable)


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class PinnedBudget:
    """At most ``cap_bytes`` of pinned host memory held by captured tensors at once.

    :meth:`empty` hands out a pinned tensor and counts its bytes until the tensor is
    garbage collected (a consumer such as a feature writer dropped it). When the budget
    is spent it waits up to ``wait_s`` seconds for consumers to drop tensors, then gives
    up (returns ``None``) so that the caller copies synchronously into ordinary memory
    instead of pinning without bound. Thread-safe.

    Example:
        >>> budget = PinnedBudget(64, allocate=lambda shape, dtype: torch.empty(shape, dtype=dtype))
        >>> first = budget.empty(torch.Size([8]), torch.float32)   # 32 bytes
        >>> budget.in_use, budget.empty(torch.Size([16]), torch.float32)  # over the cap
        (32, None)
        >>> del first
        >>> budget.in_use
        0
    """

    def __init__(
        self,
        cap_bytes: int,
        *,
        wait_s: float = 0.0,
        allocate: Callable[[torch.Size, torch.dtype], torch.Tensor] = _pinned_empty,
    ) -> None:
        if cap_bytes < 0 or wait_s < 0:
            raise ValueError("`cap_bytes` and `wait_s` must be >= 0")
        self.cap_bytes = cap_bytes
        self.wait_s = wait_s
        self.in_use = 0
        self.peak = 0
        self._allocate = allocate
        self._free = threading.Condition()
        self._starved = False

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A pinned tensor counted against the budget, or ``None`` if it does not fit."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes > self.cap_bytes:
            return None
        with self._free:
            fits = self._free.wait_for(
                lambda: self.in_use + nbytes <= self.cap_bytes,
                timeout=0.0 if self._starved else self.wait_s,
            )
            if not fits:
                self._starved = True  # no more waiting until some memory comes back
                return None
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        try:
            tensor = self._allocate(shape, dtype)
        except BaseException:
            self._release(nbytes)
            raise
        weakref.finalize(tensor, self._release, nbytes)
        return tensor

    def _release(self, nbytes: int) -> None:
        with self._free:
            self.in_use -= nbytes
            self._starved = False
            self._free.notify_all()


class CaptureTransfer:
    """The catcher's copy of captured values: detached, private, on ``device``, cast.

    CUDA tensors bound for the CPU go through pinned memory asynchronously (see the
    module docstring); everything else is copied as :func:`transfer_to_device` does.
    ``pinned_bytes=0`` turns the asynchronous path off.
    """

    def __init__(
        self,
        device: torch.device | None,
        dtype: torch.dtype | None = None,
        *,
        pinned_bytes: int = 256 << 20,
        wait_s: float = 5.0,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.budget = PinnedBudget(pinned_bytes, wait_s=wait_s) if pinned_bytes else None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._warned = False

    def __call__(self, obj: Any) -> tuple[Any, list[torch.cuda.Event]]:
        """``(copy of obj, events)``: read the copy only once every event has completed."""
        events: list[torch.cuda.Event] = []

        def copy_one(tensor: torch.Tensor) -> torch.Tensor:
            if self._asynchronous(tensor):
                copied = self._copy_to_pinned(tensor, events)
                if copied is not None:
                    return copied
            return _copy_tensor(tensor, self.device, self.dtype)

        return map_tensors(obj, copy_one, _placeholder_unless_immutable), events

    def _asynchronous(self, tensor: torch.Tensor) -> bool:
        return (
            self.budget is not None
            and tensor.is_cuda
            and self.device is not None
            and self.device.type == "cpu"
        )

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _copy_to_pinned(
        self, tensor: torch.Tensor, events: list[torch.cuda.Event]
    ) -> torch.Tensor | None:
        assert self.budget is not None
        dtype = _target_dtype(tensor, self.dtype)
        host = self.budget.empty(tensor.shape, dtype)
        if host is None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"pinned memory for captures is spent ({self.budget.cap_bytes} bytes held "
                    "by captured tensors still alive); copying synchronously instead. Drop "
                    "captures sooner, stream them to a writer, or raise `pinned_memory_bytes`",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        side = self._side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # after the producing kernels
        with torch.cuda.stream(side):
            source = tensor.detach()
            if source.dtype != dtype:
                source = source.to(dtype)  # cast on the GPU: fewer bytes cross the bus
            host.copy_(source, non_blocking=True)
            # The caching allocator must not hand the model's memory to new work on the
            # producing stream before this copy has read it.
            tensor.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        events.append(done)
        return host
