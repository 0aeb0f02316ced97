"""One route for a LightningModule's ``predict_step`` while capture callbacks are armed.

Early exit needs ``predict_step`` to run through the model's
:class:`~lightning_iocatch.capture.coordinator.ForwardCoordinator`, which absorbs the stop signal.
While a callback with early exit is armed, the step returns the captures of the armed
callbacks that have early exit (the forward may have stopped, so there is no output).
However many ``IOCaptureCallback``s arm the predict loop, the module's ``predict_step``
is replaced once, by the first to join, and put back exactly as it was (the instance
attribute it had, or none) when the last one leaves, in whatever order they leave.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.session import CaptureSession

__all__ = ["PredictMember", "join_predict_route", "leave_predict_route"]

_MISSING = object()


@dataclass(eq=False)
class PredictMember:
    """A callback armed in predict: its open session, and whether it skips the batch."""

    session: CaptureSession
    skips_batch: Callable[[], bool]


class _PredictRoute:
    def __init__(self, pl_module: pl.LightningModule, session: CaptureSession) -> None:
        self.members: list[PredictMember] = []
        self._module = weakref.ref(pl_module)
        self._own = vars(pl_module).get("predict_step", _MISSING)
        original = pl_module.predict_step

        def predict_step(*args: Any, **kwargs: Any) -> Any:
            members = list(self.members)
            if members and all(member.skips_batch() for member in members):
                return None  # every armed callback has this batch already
            coordinator = session.catcher.coordinator  # the process's: every session's
            result, _ = coordinator.call(session.root, original, *args, **kwargs)
            early = [member.session.buffer for member in members if member.session.early_exit]
            return _merged(early) if early else result

        setattr(pl_module, "predict_step", predict_step)  # noqa: B010

    def restore(self) -> None:
        module = self._module()
        if module is None:
            return
        if self._own is _MISSING:
            vars(module).pop("predict_step", None)
        else:
            setattr(module, "predict_step", self._own)  # noqa: B010


def _merged(buffers: list[CaptureBuffer]) -> CaptureBuffer:
    """The captures of several sessions in one buffer; a module captured twice counts once."""
    merged: dict[str, dict[str, list[Any]]] = {}
    for buffer in buffers:
        for name, kinds in buffer.items():  # settles
            slot = merged.setdefault(name, {})
            for kind, entries in kinds.items():
                if not slot.get(kind):
                    slot[kind] = list(entries)
    return CaptureBuffer(merged)


_routes: weakref.WeakKeyDictionary[pl.LightningModule, _PredictRoute] = weakref.WeakKeyDictionary()


def join_predict_route(pl_module: pl.LightningModule, member: PredictMember) -> None:
    """Route ``pl_module.predict_step`` through its coordinator while ``member`` is armed."""
    route = _routes.get(pl_module)
    if route is None:
        route = _routes[pl_module] = _PredictRoute(pl_module, member.session)
    if member not in route.members:
        route.members.append(member)


def leave_predict_route(pl_module: pl.LightningModule, member: PredictMember) -> None:
    """``member`` is no longer armed; the last member to leave restores ``predict_step``."""
    route = _routes.get(pl_module)
    if route is None or member not in route.members:
        return
    route.members.remove(member)
    if not route.members:
        del _routes[pl_module]
        route.restore()
