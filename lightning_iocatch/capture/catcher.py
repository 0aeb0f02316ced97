"""ModelIOCatcher: capture the inputs and outputs of named submodules, with early exit.

Hooks are global state on the model. This module is the only one that registers them,
and it registers them only on the modules a session asks for, only while that session
is open: a forward outside a session runs exactly as if the catcher did not exist.

Several sessions may be open on one model at once (one per catcher, e.g. two
``IOCaptureCallback``s); they share the model's
:class:`~lightning_iocatch.capture.coordinator.ForwardCoordinator`, which decides when a forward
may stop early.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.capture.buffer import CaptureBuffer, Kind, Pending
from lightning_iocatch.capture.compiled import prepare_for_hooks
from lightning_iocatch.capture.coordinator import COORDINATOR, ForwardCoordinator
from lightning_iocatch.capture.spec import (
    WRAPPER_COMPONENTS,
    CaptureSpec,
    canonical_name,
    resolve_names,
)
from lightning_iocatch.capture.transfer import CaptureTransfer
from lightning_iocatch.checks import check_bool, check_int, parse_device, parse_dtype
from lightning_iocatch.errors import CaptureError
from lightning_iocatch.store.tokens import TokenSelection

__all__ = ["CaptureBuffer", "CaptureSession", "ForwardCoordinator", "ModelIOCatcher"]


def module_index(model: nn.Module) -> dict[str, nn.Module]:
    """Submodules by name, without the components that wrappers insert.

    The components are :data:`~.spec.WRAPPER_COMPONENTS` (``torch.compile``, FSDP,
    activation checkpointing). Where a wrapper and the module it wraps share a
    name, the wrapped (inner) module wins: hooks go on the user's own layer.

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
        self._pending: set[tuple[str, Kind]] = set(self._targets)
        self._handles: list[RemovableHandle] = []

    @property
    def root(self) -> nn.Module:
        """The model of this session's catcher, under any wrapper."""
        return self.catcher.root

    @property
    def is_open(self) -> bool:
        """True while this session's hooks are registered."""
        return self.catcher._session is self

    @property
    def done(self) -> bool:
        """True once the current forward has given every capture this session asked for."""
        return not self._pending

    def open(self) -> CaptureBuffer:
        """Register the hooks and return the buffer that fills while the session is open."""
        if self.catcher._session is not None:
            raise CaptureError(
                "a capture session is already open on this catcher; close it before opening "
                "another (one `with catcher(...)` at a time, or use a second ModelIOCatcher)"
            )
        prepare_for_hooks(self.catcher.model, self.modules)
        self.catcher._session = self
        self.catcher.coordinator.open(self)
        self._pending = set(self._targets)
        try:
            for name in self.inputs:
                hook = _input_hook(self, name)
                self._handles.append(
                    self.modules[name].register_forward_pre_hook(hook, with_kwargs=True)
                )
            for name in self.outputs:
                hook = _output_hook(self, name)
                self._handles.append(self.modules[name].register_forward_hook(hook))
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
        self.catcher.coordinator.close(self)
        self.buffer.settle()

    def take(self) -> CaptureBuffer:
        """Return what was captured so far, settled, and continue into a fresh, empty buffer.

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
        self.buffer = CaptureBuffer.empty(taken._data)
        taken.settle()
        return taken

    def __enter__(self) -> CaptureBuffer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _begin_forward(self) -> None:
        self._pending = set(self._targets)

    def _wants_call(self) -> bool:
        """Whether a hook of this session captures the call now (before anything is copied)."""
        if not self.early_exit:
            return True
        if not self.catcher.coordinator.in_forward:
            raise CaptureError(
                "this session has early_exit=True, so forwards must go through "
                "`catcher.run(*args, **kwargs)` (or `catcher.call(fn, ...)`), which absorbs the "
                "early-exit signal; the model was called directly"
            )
        # done: later calls in this forward are as if it had stopped, whoever goes on
        return not self.done

    def _record(self, name: str, kind: Kind, value: Any, events: Sequence[Pending]) -> None:
        self.buffer.add(name, kind, value, events)
        if self.early_exit:
            self._pending.discard((name, kind))
            if not self._pending:
                self.catcher.coordinator.maybe_stop(self)


def _names(argument: str, names: Any) -> list[str]:
    """``names`` as a list of strings, or one clear error naming ``argument``."""
    if isinstance(names, str):
        raise TypeError(
            f"`{argument}` takes a list of names; for a spec string use `catcher.from_spec(spec)`"
        )
    if not isinstance(names, Iterable):
        raise TypeError(f"`{argument}` must be a list of module names, got {names!r}")
    names = list(names)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"`{argument}` must be a list of module names, got {names!r}")
    return names


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module under every wrapper (compiled, FSDP, checkpoint)."""
    for component in WRAPPER_COMPONENTS:
        inner = getattr(model, component, None)
        if isinstance(inner, nn.Module):
            return _unwrapped(inner)
    return model


def _in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing then re-runs the
    forward of checkpointed layers, which is not a forward to capture."""
    return bool(torch._C._current_graph_task_id() != -1)


def _input_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    transfer = session.catcher.transfer

    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _in_backward() or not session._wants_call():
            return
        entry, events = transfer({"args": args, "kwargs": kwargs})
        session._record(name, "inputs", entry, events)

    return hook


def _output_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    transfer = session.catcher.transfer

    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _in_backward() or not session._wants_call():
            return
        value, events = transfer(output)
        session._record(name, "outputs", value, events)

    return hook


class ModelIOCatcher:
    """Capture inputs and/or outputs of named submodules during forward passes.

    ``model`` is the module to watch; valid names are those of ``model.named_modules()``
    (the components wrappers insert, such as ``_orig_mod.`` of ``torch.compile`` or
    ``_fsdp_wrapped_module.``, may be left out), and names may
    use globs (see :mod:`lightning_iocatch.capture.spec`). ``device`` is where captured tensors
    are copied (``None``: where they are); ``dtype`` casts floating tensors. From a CUDA
    model to the CPU, copies run asynchronously on a side stream into at most
    ``pinned_memory_bytes`` of pinned memory (``0``: synchronous copies); the buffer
    waits for them whenever it is read, so no value is ever seen half-copied.

    A session, ``with catcher(inputs=[...], outputs=[...], early_exit=False) as buf:``
    (or ``with catcher.from_spec("inputs[a]|outputs[b]") as buf:``), registers hooks on
    the requested modules only, and removes them when the block ends, also on
    exceptions. ``buf[name]["inputs"]`` holds one ``{"args", "kwargs"}`` entry per call
    and ``buf[name]["outputs"]`` one return value per call; captured values are detached
    private copies (objects the library does not know, such as a cache object, become
    :class:`~lightning_iocatch.NotCaptured` placeholders), and ``buf`` stays readable
    after the block.

    With ``early_exit=True`` each forward stops as soon as every requested capture has
    happened, in execution order: drive forwards through :meth:`run` (or :meth:`call`),
    which returns ``None`` for a forward cut short. A requested module that never runs
    lets the forward complete. A module called several times in one forward (a shared
    module) counts as captured at its first call, so under early exit later calls are
    not captured; without early exit every call adds an entry.

    Global state: when a session opens on a model with ``torch.compile``d parts, Dynamo's
    process-wide ``skip_nnmodule_hook_guards`` is turned off (so compiled code notices the
    hooks) and code compiled before is dropped once, for every model of the process.

    Sessions of several catchers may be open on one model at once; each captures exactly
    what it would capture alone, and a forward stops early only once every open session
    has early exit and is done (see :class:`ForwardCoordinator`).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> catcher = ModelIOCatcher(net, "cpu")
        >>> with catcher(inputs=["2"], outputs=["0"]) as buf:
        ...     _ = net(torch.randn(3, 4))
        >>> buf["0"]["outputs"][0].shape, buf["2"]["inputs"][0]["args"][0].shape
        (torch.Size([3, 8]), torch.Size([3, 8]))
        >>> with catcher.from_spec("outputs[0]", early_exit=True) as buf:
        ...     catcher.run(torch.randn(3, 4)) is None  # layers 1 and 2 never ran
        True
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str | None,
        *,
        dtype: torch.dtype | str | None = None,
        pinned_memory_bytes: int = 256 << 20,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.device = parse_device("device", device)
        self.dtype = parse_dtype("dtype", dtype)
        pinned = check_int("pinned_memory_bytes", pinned_memory_bytes, minimum=0)
        self.transfer = CaptureTransfer(self.device, self.dtype, pinned_bytes=pinned)
        self._session: CaptureSession | None = None
        self._requested: CaptureSession | None = None
        self.coordinator: ForwardCoordinator = COORDINATOR
        self.root = _unwrapped(model)  # the module whose forwards `run` drives

    @property
    def module_names(self) -> list[str]:
        """Every name a session may use (without wrapper components), in ``named_modules`` order."""
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
        inputs, outputs = _names("inputs", inputs), _names("outputs", outputs)
        early_exit = check_bool("early_exit", early_exit)
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

    def from_spec(self, spec: str | CaptureSpec, early_exit: bool = False) -> CaptureSession:
        """Request a session from a spec string such as ``"outputs[model.layers.5]"``.

        Same as ``catcher(inputs=..., outputs=..., early_exit=...)`` with the names of the
        spec. Malformed specs raise ``SpecError``; a spec that selects nothing raises
        ``ValueError``; unknown names raise ``KeyError`` (``UnknownModuleError``).
        """
        parsed = spec if isinstance(spec, CaptureSpec) else CaptureSpec.parse(spec)
        if parsed.is_empty:
            raise ValueError(f"capture spec {parsed.to_string() or spec!r} selects no module")
        return self(inputs=parsed.inputs, outputs=parsed.outputs, early_exit=early_exit)

    def for_product(self, spec: str | CaptureSpec, early_exit: bool = True) -> CaptureSession:
        """Deprecated name of :meth:`from_spec`, which defaults to ``early_exit=False``.

        Kept with its old default (``early_exit=True``) so that existing code keeps its
        behaviour; it warns once per call site.
        """
        warnings.warn(
            "`ModelIOCatcher.for_product(spec)` is renamed `from_spec(spec, early_exit=...)`; "
            "note that `from_spec` defaults to early_exit=False like `catcher(...)`",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.from_spec(spec, early_exit=early_exit)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run one forward of the model under the open session.

        Returns the model's output, or ``None`` when early exit cut the forward short.
        Without an open session it is a plain model call.
        """
        return self.call(self.model, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`run`, for any callable that runs the model (e.g. a ``predict_step``)."""
        if not self.coordinator.sessions:
            return fn(*args, **kwargs)
        return self.coordinator.call(self.root, fn, *args, **kwargs)[0]

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

    def select_tokens(self, selection: TokenSelection | None) -> None:
        """Capture only ``selection``'s tokens of sequence tensors from now on (``None``: all).

        Set it for each batch, before its forward; see :mod:`lightning_iocatch.store.tokens`.
        """
        if selection is not None and not isinstance(selection, TokenSelection):
            raise TypeError(
                "`selection` must be a TokenSelection (from TokenRows(...).select(batch)) or "
                f"None, got {type(selection).__name__}"
            )
        self.transfer.tokens = selection

    @property
    def session(self) -> CaptureSession | None:
        """The open session, if any."""
        return self._session

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, device={self.device})"
