"""CaptureBuffer: captured values by module name, readable only once they are complete.

A value copied asynchronously from a GPU is not part of the buffer until its copy has
completed: it waits in a private queue, and every way of reading the buffer (``[]``,
``get``, ``in``, iteration, ``len``, ``keys``/``items``/``values``, ``dict(buf)``,
``{**buf}``, ``buf.copy()``) first waits for the copies and moves the finished values in,
in the order they were captured. A list taken out of the buffer earlier therefore only
ever holds complete values. The buffer is a read-only ``Mapping``; the lists inside it
are plain lists.

A buffer holds one batch's captures: it carries the batch's
:class:`~lightning_iocatch.capture.transform.CaptureTransform` (``buf.transform``) and the
flat keys of the values that transform changed (:meth:`CaptureBuffer.transformed_keys`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, Protocol

from lightning_iocatch.capture.keys import entry_prefix
from lightning_iocatch.capture.spec import canonical_name, unknown_name_message
from lightning_iocatch.capture.transform import CaptureTransform, Kind
from lightning_iocatch.errors import UnknownModuleError

__all__ = ["CaptureBuffer", "Kind", "Pending"]

Entries = dict[str, list[Any]]


_KINDS = ("inputs", "outputs")  # a name's kinds unless told otherwise


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

    Examples:
        >>> buf = CaptureBuffer.empty(["h.0"])
        >>> import torch
        >>> buf.add("h.0", "outputs", torch.zeros(2))
        >>> len(buf["h.0"]["outputs"]), list(buf)
        (1, ['h.0'])
        >>> {**buf} == dict(buf.items())
        True
    """

    def __init__(
        self,
        data: Mapping[str, Mapping[str, Iterable[Any]]] | None = None,
        transform: CaptureTransform | None = None,
    ) -> None:
        self._data: dict[str, Entries] = {
            name: {kind: list(entries) for kind, entries in kinds.items()}
            for name, kinds in (data or {}).items()
        }
        self.transform = transform
        # captured, copy not yet complete: (name, kind, value, paths the transform changed)
        self._waiting: list[tuple[str, Kind, Any, frozenset[str]]] = []
        self._events: list[Pending] = []
        self._transformed: dict[tuple[str, str, int], frozenset[str]] = {}

    @classmethod
    def empty(
        cls,
        names: Iterable[str] | Mapping[str, Iterable[str] | None],
        transform: CaptureTransform | None = None,
    ) -> CaptureBuffer:
        """A buffer with no entries yet for each of ``names``, captured with ``transform``.

        ``names`` may map each name to its kinds (default ``inputs`` and ``outputs``; a
        session that asks for gradients adds ``grad_inputs`` or ``grad_outputs``)."""
        kinds = names if isinstance(names, Mapping) else dict.fromkeys(names)
        return cls({name: dict.fromkeys(kinds[name] or _KINDS, ()) for name in kinds}, transform)

    def add(
        self,
        name: str,
        kind: Kind,
        value: Any,
        events: Iterable[Pending] = (),
        transformed: Collection[str] = (),
    ) -> None:
        """Add a captured value; it becomes readable once every one of ``events`` completed.

        ``transformed``: the paths inside ``value`` (``""`` for the value itself, ``"/0"``
        for its first element, as in its flat keys) that the buffer's transform changed.
        """
        events = list(events)
        if not events and not self._waiting:
            self._append(name, kind, value, frozenset(transformed))
            return
        self._events.extend(events)
        self._waiting.append((name, kind, value, frozenset(transformed)))

    def _append(self, name: str, kind: Kind, value: Any, transformed: frozenset[str]) -> None:
        entries = self._data[name].setdefault(kind, [])
        if transformed:
            self._transformed[(name, kind, len(entries))] = transformed
        entries.append(value)

    def calls(self, name: str, kind: Kind) -> int:
        """How many values of ``name``'s ``kind`` the buffer holds or waits for."""
        waiting = sum(1 for n, k, _, _ in self._waiting if (n, k) == (name, kind))
        return len(self._data[name].get(kind, ())) + waiting

    def transformed_keys(self) -> set[str]:
        """The flat keys (see :mod:`~lightning_iocatch.capture.keys`) of the tensors the
        buffer's transform changed."""
        self.settle()
        return {
            entry_prefix(name, kind, call) + path
            for (name, kind, call), paths in self._transformed.items()
            for path in paths
        }

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
        for name, kind, value, transformed in waiting:
            self._append(name, kind, value, transformed)

    @property
    def settled(self) -> bool:
        """True when no captured value is still waiting for its copy."""
        return not self._waiting

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save``, ``copy.deepcopy``) once settled: the values, no copy in
        flight."""
        self.settle()
        return {"_data": self._data, "_transformed": self._transformed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._data, self._transformed = state["_data"], state["_transformed"]
        self._waiting, self._events, self.transform = [], [], None

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
        copied = CaptureBuffer(self._data, self.transform)
        copied._transformed = dict(self._transformed)
        return copied

    def __repr__(self) -> str:
        self.settle()
        counts = {name: {k: len(v) for k, v in kinds.items()} for name, kinds in self._data.items()}
        return f"{type(self).__name__}({counts})"
