"""ForwardCoordinator: the open capture sessions of the process, and where forwards stop.

Several sessions may be open at once: on one model (two ``IOCaptureCallback``s), or on
a model and one of its submodules (a callback on the LightningModule and a user's
``ModelIOCatcher(self.model, ...)``). A forward run through :meth:`ForwardCoordinator.call`
involves every open session whose model shares modules with the model it runs (one is
inside the other), and stops early only once every involved session has ``early_exit``
and has captured all it asked for; one involved session without early exit keeps the
forward whole. Sessions on unrelated models are not involved.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

__all__ = ["COORDINATOR", "ForwardCoordinator", "Participant", "StopForward"]


class Participant(Protocol):
    """An open session as the coordinator sees it
    (:class:`~lightning_iocatch.capture.session.CaptureSession`)."""

    early_exit: bool

    @property
    def root(self) -> nn.Module:
        """The model of the session's catcher, under any wrapper."""
        ...

    @property
    def done(self) -> bool:
        """Whether the current forward gave every capture the session asked for."""
        ...

    def begin_forward(self) -> None:
        """A forward through :meth:`ForwardCoordinator.call` starts."""
        ...


@dataclass(eq=False)
class _Frame:
    """One forward in progress through :meth:`ForwardCoordinator.call`."""

    involved: list[Participant]
    stop_sent: bool = field(default=False)


class StopForward(BaseException):
    """The early-exit signal, caught only by the call that started its forward.

    A ``BaseException`` so that ``except Exception`` in model code cannot eat it.
    """

    def __init__(self, frame: _Frame) -> None:
        super().__init__("early exit: every involved session has its captures")
        self.frame = frame


class ForwardCoordinator:
    """The open sessions, and the one place that stops forwards early (:data:`COORDINATOR`)."""

    def __init__(self) -> None:
        self.sessions: list[Participant] = []
        self._frames: list[_Frame] = []
        self._aside: frozenset[int] = frozenset()  # ids of sessions set aside (`apart`)
        self._trees: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def in_forward(self) -> bool:
        """True while a forward runs through :meth:`call` (early exit can be absorbed)."""
        return bool(self._frames)

    @contextmanager
    def apart(self, model: nn.Module) -> Iterator[None]:
        """While open, the sessions open now on ``model`` (on it, a module inside it, or a
        module it is inside) are set aside: their hooks neither capture nor edit, and no
        forward involves them; sessions on other models, and sessions opened inside, act
        as usual. For forwards run on the side, such as
        :class:`~lightning_iocatch.capture.variants.Variants`'."""
        before, running = self._aside, self.tree(model)
        related = [
            s for s in self.sessions if id(s.root) in running or id(model) in self.tree(s.root)
        ]
        self._aside = before | {id(session) for session in related}
        try:
            yield
        finally:
            self._aside = before

    def acts(self, session: object) -> bool:
        """Whether ``session``'s hooks act now (it is not set aside by :meth:`apart`)."""
        return id(session) not in self._aside

    def open(self, session: Participant) -> None:
        self._trees.clear()  # modules may have been added since: recompute on demand
        self.sessions.append(session)

    def close(self, session: Participant) -> None:
        if session in self.sessions:
            self.sessions.remove(session)

    def tree(self, model: nn.Module) -> frozenset[int]:
        """The ids of ``model`` and every module inside it (cached until a session opens)."""
        if model not in self._trees:
            self._trees[model] = frozenset(id(module) for module in model.modules())
        return self._trees[model]

    def _involved(self, model: nn.Module) -> list[Participant]:
        running = self.tree(model)
        return [
            s
            for s in self.sessions
            if self.acts(s) and (id(s.root) in running or id(model) in self.tree(s.root))
        ]

    def maybe_stop(self, session: Participant) -> None:
        """Stop the forward if every session it involves is done (called by the hooks)."""
        if not self._frames:
            return
        frame = self._frames[-1]
        if session in frame.involved and all(s.early_exit and s.done for s in frame.involved):
            frame.stop_sent = True
            raise StopForward(frame)

    def call(
        self, model: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Any, bool]:
        """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when early exit cut it short.

        ``model`` is the module ``fn`` runs: it decides which open sessions are involved.
        """
        frame = _Frame(self._involved(model))
        for session in frame.involved:
            session.begin_forward()
        self._frames.append(frame)
        try:
            result = fn(*args, **kwargs)
        except StopForward as stop:
            if stop.frame is not frame:
                raise
            return None, True
        finally:
            self._frames.remove(frame)
        if frame.stop_sent:
            warnings.warn(
                "the model swallowed the early-exit signal (a bare `except:` or `except "
                "BaseException:` in its forward), so the whole forward ran",
                RuntimeWarning,
                stacklevel=3,
            )
        return result, False


COORDINATOR = ForwardCoordinator()
"""The process's coordinator: every catcher and callback goes through it."""
