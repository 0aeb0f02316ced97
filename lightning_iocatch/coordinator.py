"""ForwardCoordinator: the open capture sessions on one model, and where forwards stop.

Several sessions may be open on one model at once (one per catcher, e.g. two
``IOCaptureCallback``s): they share the model's coordinator, which lets a forward stop
early only once every open session on the model has early exit and has captured
everything it asked for. One session without early exit keeps forwards whole.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from lightning_iocatch.catcher import CaptureSession

__all__ = ["ForwardCoordinator", "StopForward"]


class StopForward(BaseException):
    """The early-exit signal, caught only by its coordinator. A ``BaseException`` so that
    ``except Exception`` in model code cannot eat it."""

    def __init__(self, coordinator: ForwardCoordinator) -> None:
        super().__init__("early exit: every open session has its captures")
        self.coordinator = coordinator


class ForwardCoordinator:
    """The open capture sessions on one model, and the one place that stops its forwards.

    There is one per model (:meth:`of`). Forwards that may stop early go through
    :meth:`call`; a forward stops once every open session has ``early_exit`` and has
    captured all it asked for in this forward.
    """

    _by_model: ClassVar[weakref.WeakKeyDictionary[nn.Module, ForwardCoordinator]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.sessions: list[CaptureSession] = []
        self.run_depth = 0
        self._stop_sent = False

    @classmethod
    def of(cls, model: nn.Module) -> ForwardCoordinator:
        """The coordinator of ``model`` (created on first use)."""
        if model not in cls._by_model:
            cls._by_model[model] = cls()
        return cls._by_model[model]

    def maybe_stop(self) -> None:
        """Stop the forward if every open session is done with it (called by the hooks)."""
        if self.run_depth and all(s.early_exit and s.done for s in self.sessions):
            self._stop_sent = True
            raise StopForward(self)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
        """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when early exit cut it short."""
        for session in self.sessions:
            session._begin_forward()
        self._stop_sent = False
        self.run_depth += 1
        try:
            result = fn(*args, **kwargs)
        except StopForward as stop:
            if stop.coordinator is not self:
                raise
            return None, True
        finally:
            self.run_depth -= 1
        if self._stop_sent:
            self._stop_sent = False
            warnings.warn(
                "the model swallowed the early-exit signal (a bare `except:` or `except "
                "BaseException:` in its forward), so the whole forward ran",
                RuntimeWarning,
                stacklevel=3,
            )
        return result, False
