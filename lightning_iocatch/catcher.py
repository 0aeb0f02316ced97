"""ModelIOCatcher: capture the inputs and outputs of named submodules, with early exit.

Hooks are global state on the model. This module is the only one that registers them,
and it registers them only on the modules a session asks for, only while that session
is open: a forward outside a session runs exactly as if the catcher did not exist.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.compiled import prepare_for_hooks
from lightning_iocatch.errors import CaptureError, UnknownModuleError
from lightning_iocatch.spec import CaptureSpec, canonical_name, resolve_names, unknown_name_message
from lightning_iocatch.transfer import CaptureTransfer

__all__ = ["CaptureBuffer", "CaptureSession", "ModelIOCatcher"]

Kind = Literal["inputs", "outputs"]


class _StopForward(BaseException):
    """Private early-exit signal. A ``BaseException`` so ``except Exception`` cannot eat it."""

    def __init__(self, session: CaptureSession) -> None:
        super().__init__("early exit: every requested capture is done")
        self.session = session


class CaptureBuffer(dict[str, dict[str, list[Any]]]):
    """Captured values: ``buf[name]["inputs"]`` and ``buf[name]["outputs"]``, one entry a call.

    An input entry is ``{"args": tuple, "kwargs": dict}``; an output entry is whatever the
    module returned. Names are those of ``model.named_modules()`` without the
    ``_orig_mod.`` that ``torch.compile`` inserts; a name with it is accepted too. Every
    read waits for the asynchronous GPU-to-CPU copies still in flight into the buffer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[torch.cuda.Event] = []

    def settle(self) -> None:
        """Wait until every asynchronous copy into this buffer has completed."""
        while self._pending:
            self._pending.pop().synchronize()

    def add_pending(self, events: list[torch.cuda.Event]) -> None:
        """Copies into this buffer that reads must wait for (see ``CaptureTransfer``)."""
        self._pending.extend(events)

    def __getitem__(self, name: str) -> dict[str, list[Any]]:
        self.settle()
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self.settle()
        return super().get(name, default)

    def items(self) -> Any:
        self.settle()
        return super().items()

    def values(self) -> Any:
        self.settle()
        return super().values()

    def __missing__(self, name: str) -> dict[str, list[Any]]:
        if isinstance(name, str) and canonical_name(name) in self:
            return self[canonical_name(name)]
        raise UnknownModuleError(
            f"nothing was captured for {name!r}: " + unknown_name_message(name, list(self))
        )

    @classmethod
    def empty(cls, names: Iterable[str]) -> CaptureBuffer:
        return cls({name: {"inputs": [], "outputs": []} for name in names})


def module_index(model: nn.Module) -> dict[str, nn.Module]:
    """Submodules by name, without the ``_orig_mod.`` components ``torch.compile`` adds.

    Where a compiled wrapper and its original share a name, the original (inner) wins.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> list(module_index(net))
        ['', '0']
    """
    index: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        index[canonical_name(name)] = module
    return index


class CaptureSession:
    """One capture request on a :class:`ModelIOCatcher`; hooks exist only while it is open.

    Use it as a context manager (``with catcher(outputs=[...]) as buf:``), or call
    :meth:`open` and :meth:`close` in a ``try/finally`` yourself.
    """

    def __init__(
        self,
        catcher: ModelIOCatcher,
        modules: dict[str, nn.Module],
        inputs: list[str],
        outputs: list[str],
        early_exit: bool,
    ) -> None:
        self.catcher = catcher
        self.modules = modules
        self.inputs = inputs
        self.outputs = outputs
        self.early_exit = early_exit
        self.buffer = CaptureBuffer.empty(dict.fromkeys([*inputs, *outputs]))
        targets: list[tuple[str, Kind]] = [(n, "inputs") for n in inputs]
        targets += [(n, "outputs") for n in outputs]
        self._targets = frozenset(targets)
        self._pending: set[tuple[str, Kind]] = set()
        self._stopped = False
        self._handles: list[RemovableHandle] = []

    @property
    def is_open(self) -> bool:
        """True while this session's hooks are registered."""
        return self.catcher._session is self

    def open(self) -> CaptureBuffer:
        """Register the hooks and return the buffer that fills while the session is open."""
        if self.catcher._session is not None:
            raise CaptureError(
                "a capture session is already open on this catcher; close it before opening "
                "another (one `with catcher(...)` at a time, or use a second ModelIOCatcher)"
            )
        modules = self.modules
        prepare_for_hooks(self.catcher.model)
        self.catcher._session = self
        try:
            for name in self.inputs:
                hook = _input_hook(self, name)
                self._handles.append(
                    modules[name].register_forward_pre_hook(hook, with_kwargs=True)
                )
            for name in self.outputs:
                hook = _output_hook(self, name)
                self._handles.append(modules[name].register_forward_hook(hook))
        except BaseException:
            self.close()
            raise
        return self.buffer

    def close(self) -> None:
        """Remove every hook this session registered and wait for pending copies.

        Safe to call more than once.
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self.catcher._session is self:
            self.catcher._session = None
        self._pending = set()
        self.buffer.settle()

    def take(self) -> CaptureBuffer:
        """Return what was captured so far and continue into a fresh, empty buffer.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> session = ModelIOCatcher(net, "cpu")(outputs=["0"])
            >>> with session:
            ...     _ = net(torch.ones(1, 2))
            ...     first = session.take()
            ...     _ = net(torch.ones(1, 2))
            >>> len(first["0"]["outputs"]), len(session.buffer["0"]["outputs"])
            (1, 1)
        """
        taken = self.buffer
        self.buffer = CaptureBuffer.empty(taken)
        return taken

    def __enter__(self) -> CaptureBuffer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _begin_forward(self) -> None:
        self._pending = set(self._targets)
        self._stopped = False

    def _record(self, name: str, kind: Kind, value: Any, events: list[torch.cuda.Event]) -> None:
        if self.early_exit and self.catcher._run_depth == 0:
            raise CaptureError(
                "this session has early_exit=True, so forwards must go through "
                "`catcher.run(*args, **kwargs)` (or `catcher.call(fn, ...)`), which absorbs the "
                "early-exit signal; the model was called directly"
            )
        self.buffer.add_pending(events)
        dict.__getitem__(self.buffer, name)[kind].append(value)  # no wait: still in the forward
        if self.early_exit:
            self._pending.discard((name, kind))
            if not self._pending:
                self._stopped = True
                raise _StopForward(self)


def _input_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    transfer = session.catcher.transfer

    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        entry, events = transfer({"args": args, "kwargs": kwargs})
        session._record(name, "inputs", entry, events)

    return hook


def _output_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    transfer = session.catcher.transfer

    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        value, events = transfer(output)
        session._record(name, "outputs", value, events)

    return hook


class ModelIOCatcher:
    """Capture inputs and/or outputs of named submodules during forward passes.

    ``model`` is the module to watch; valid names are those of ``model.named_modules()``
    (the ``_orig_mod.`` inserted by ``torch.compile`` may be left out), and names may
    use globs (see :mod:`lightning_iocatch.spec`). ``device`` is where captured tensors
    are copied (``None``: where they are); ``dtype`` casts floating tensors. From a CUDA
    model to the CPU, copies run asynchronously on a side stream into at most
    ``pinned_memory_bytes`` of pinned memory (``0``: synchronous copies); the buffer
    waits for them whenever it is read, so no value is ever seen half-copied.

    A session, ``with catcher(inputs=[...], outputs=[...], early_exit=False) as buf:``,
    registers hooks on the requested modules only, and removes them when the block
    ends, also on exceptions. ``buf[name]["inputs"]`` holds one ``{"args", "kwargs"}``
    entry per call and ``buf[name]["outputs"]`` one return value per call; captured
    values are detached private copies, and ``buf`` stays readable after the block.

    With ``early_exit=True`` each forward stops as soon as every requested capture has
    happened, in execution order: drive forwards through :meth:`run` (or :meth:`call`),
    which returns ``None`` for a forward cut short. A requested module that never runs
    lets the forward complete. A module called several times in one forward (a shared
    module) counts as captured at its first call, so under early exit later calls are
    not captured; without early exit every call adds an entry.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> catcher = ModelIOCatcher(net, "cpu")
        >>> with catcher(inputs=["2"], outputs=["0"]) as buf:
        ...     _ = net(torch.randn(3, 4))
        >>> buf["0"]["outputs"][0].shape, buf["2"]["inputs"][0]["args"][0].shape
        (torch.Size([3, 8]), torch.Size([3, 8]))
        >>> with catcher.for_product("outputs[0]", early_exit=True) as buf:
        ...     catcher.run(torch.randn(3, 4)) is None  # layers 1 and 2 never ran
        True
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str | None,
        *,
        dtype: torch.dtype | None = None,
        pinned_memory_bytes: int = 256 << 20,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating-point dtype or None, got {dtype}")
        self.model = model
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.transfer = CaptureTransfer(self.device, dtype, pinned_bytes=pinned_memory_bytes)
        self._session: CaptureSession | None = None
        self._requested: CaptureSession | None = None
        self._run_depth = 0

    @property
    def module_names(self) -> list[str]:
        """Every name a session may use (without ``_orig_mod.``), in ``named_modules`` order."""
        return list(self._modules())

    def _modules(self) -> dict[str, nn.Module]:
        return module_index(self.model)

    def resolve(self, names: Iterable[str]) -> list[str]:
        """Expand names and globs to module names; unknown ones raise ``UnknownModuleError``."""
        return resolve_names(names, self.module_names)

    def __call__(
        self, inputs: Iterable[str] = (), outputs: Iterable[str] = (), early_exit: bool = False
    ) -> CaptureSession:
        """Request a session capturing ``inputs`` and ``outputs`` (names or globs).

        Use as ``with catcher(inputs=[...], outputs=[...]) as buf:``. Unknown names raise
        ``KeyError`` (``UnknownModuleError``) with close matches; a request that selects
        nothing raises ``ValueError``.
        """
        if isinstance(inputs, str) or isinstance(outputs, str):
            raise TypeError(
                "`inputs` and `outputs` take lists of names; for a spec string use "
                "`catcher.for_product(spec)`"
            )
        if self._session is not None:
            raise CaptureError(
                "a capture session is already open on this catcher; nested sessions would "
                "clobber each other. Close the open one first or use a second ModelIOCatcher"
            )
        index = self._modules()
        resolved_in = resolve_names(inputs, list(index))
        resolved_out = resolve_names(outputs, list(index))
        if not resolved_in and not resolved_out:
            raise ValueError("the capture request selects no module: give `inputs` or `outputs`")
        modules = {name: index[name] for name in (*resolved_in, *resolved_out)}
        self._requested = CaptureSession(self, modules, resolved_in, resolved_out, early_exit)
        return self._requested

    def for_product(self, spec: str | CaptureSpec, early_exit: bool = True) -> CaptureSession:
        """Request a session from a spec string such as ``"outputs[model.layers.5]"``.

        Malformed specs raise ``SpecError``; a spec that selects nothing raises
        ``ValueError``; unknown names raise ``KeyError`` (``UnknownModuleError``).
        """
        parsed = spec if isinstance(spec, CaptureSpec) else CaptureSpec.parse(spec)
        if parsed.is_empty:
            raise ValueError(f"capture spec {parsed.to_string() or spec!r} selects no module")
        return self(inputs=parsed.inputs, outputs=parsed.outputs, early_exit=early_exit)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run one forward of the model under the open session.

        Returns the model's output, or ``None`` when early exit cut the forward short.
        Without an open session it is a plain model call.
        """
        return self.call(self.model, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`run`, for any callable that runs the model (e.g. a ``predict_step``)."""
        session = self._session
        if session is None:
            return fn(*args, **kwargs)
        session._begin_forward()
        self._run_depth += 1
        try:
            result = fn(*args, **kwargs)
        except _StopForward as stop:
            if stop.session is not session:
                raise
            return None
        finally:
            self._run_depth -= 1
        if session._stopped:
            warnings.warn(
                "the model swallowed the early-exit signal (a bare `except:` or `except "
                "BaseException:` in its forward), so the whole forward ran",
                RuntimeWarning,
                stacklevel=2,
            )
        return result

    def attach_hooks(self) -> CaptureBuffer:
        """Open the most recently requested session without a ``with`` block.

        Pair it with :meth:`detach_hooks` in a ``finally``.
        """
        if self._requested is None:
            raise CaptureError("nothing to attach: request a session first with `catcher(...)`")
        return self._requested.open()

    def detach_hooks(self) -> None:
        """Close the open session, removing its hooks. Does nothing when none is open."""
        if self._session is not None:
            self._session.close()

    @property
    def session(self) -> CaptureSession | None:
        """The open session, if any."""
        return self._session

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, device={self.device})"
