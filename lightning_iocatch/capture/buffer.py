"""CaptureBuffer: captured values by module name, readable only once they are complete.

A value copied asynchronously from a GPU is not part of the buffer until its copy has
completed: it waits in a private queue, and every way of reading the buffer (``[]``,
``get``, ``in``, iteration, ``len``, ``keys``/``items``/``values``, ``dict(buf)``,
``{**buf}``, ``buf.copy()``) first waits for the copies and moves the finished values in,
in the order they were captured. A list taken out of the buffer earlier therefore only
ever holds complete values. The buffer is a read-only ``Mapping``; the lists inside it
are plain lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol

from lightning_iocatch.capture.spec import canonical_name, unknown_name_message
from lightning_iocatch.errors import UnknownModuleError

__all__ = ["CaptureBuffer", "Kind", "Pending"]

Kind = Literal["inputs", "outputs"]
Entries = dict[str, list[Any]]


class Pending(Protocol):
    """An asynchronous copy still in flight (a :class:`~.pinned_ring.StagedCopy`)."""

    def synchronize(self) -> None:
        """Wait until the copy is complete and its value readable."""


class CaptureBuffer(Mapping[str, Entries]):
    """Captured values: ``buf[name]["inputs"]`` and ``buf[name]["outputs"]``, one entry a call.

    An input entry is ``{"args": tuple, "kwargs": dict}``; an output entry is whatever the
    module returned, with tensors copied (see :class:`~lightning_iocatch.NotCaptured` for
    the objects that are not). Names are those of ``model.named_modules()`` without the
    components that wrappers insert (:data:`~lightning_iocatch.capture.spec.WRAPPER_COMPONENTS`);
    a name with them is accepted too.

    Example:
        >>> buf = CaptureBuffer.empty(["h.0"])
        >>> import torch
        >>> buf.add("h.0", "outputs", torch.zeros(2))
        >>> len(buf["h.0"]["outputs"]), list(buf)
        (1, ['h.0'])
        >>> {**buf} == dict(buf.items())
        True
    """

    def __init__(self, data: Mapping[str, Mapping[str, Iterable[Any]]] | None = None) -> None:
        self._data: dict[str, Entries] = {
            name: {kind: list(entries) for kind, entries in kinds.items()}
            for name, kinds in (data or {}).items()
        }
        self._waiting: list[tuple[str, Kind, Any]] = []  # captured, copy not yet complete
        self._events: list[Pending] = []

    @classmethod
    def empty(cls, names: Iterable[str]) -> CaptureBuffer:
        """A buffer with no entries yet for each of ``names``."""
        return cls({name: {"inputs": [], "outputs": []} for name in names})

    def add(self, name: str, kind: Kind, value: Any, events: Iterable[Pending] = ()) -> None:
        """Add a captured value; it becomes readable once every one of ``events`` completed."""
        events = list(events)
        if not events and not self._waiting:
            self._data[name][kind].append(value)
            return
        self._events.extend(events)
        self._waiting.append((name, kind, value))

    def settle(self) -> None:
        """Wait for every asynchronous copy and make the values readable, in capture order."""
        done = 0
        try:
            for event in self._events:  # oldest first, the order the copies were enqueued
                event.synchronize()
                done += 1
        finally:  # one that raised stays, with all after it: their values stay unread
            del self._events[:done]
        waiting, self._waiting = self._waiting, []
        for name, kind, value in waiting:
            self._data[name][kind].append(value)

    @property
    def settled(self) -> bool:
        """True when no captured value is still waiting for its copy."""
        return not self._waiting

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save``, ``copy.deepcopy``) once settled: the values, no copy in
        flight."""
        self.settle()
        return {"_data": self._data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._data = state["_data"]
        self._waiting, self._events = [], []

    def __getitem__(self, name: str) -> Entries:
        self.settle()
        if name in self._data:
            return self._data[name]
        if isinstance(name, str) and canonical_name(name) in self._data:
            return self._data[canonical_name(name)]
        raise UnknownModuleError(
            f"nothing was captured for {name!r}: " + unknown_name_message(name, list(self._data))
        )

    def __contains__(self, name: object) -> bool:
        return name in self._data or (isinstance(name, str) and canonical_name(name) in self._data)

    def __iter__(self) -> Iterator[str]:
        self.settle()
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def copy(self) -> CaptureBuffer:
        """A settled copy: new containers, the same captured values."""
        self.settle()
        return CaptureBuffer(self._data)

    def __repr__(self) -> str:
        self.settle()
        counts = {name: {k: len(v) for k, v in kinds.items()} for name, kinds in self._data.items()}
        return f"{type(self).__name__}({counts})"
