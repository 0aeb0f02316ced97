"""CaptureSession: one capture request's hooks, registered only while it is open.

Hooks are global state on the model. This module is the only one that registers them,
and it registers them only on the modules a session asks for, only while that session is
open: a forward outside a session runs exactly as if no catcher existed. Each hook copies
its value through the batch's transform (:mod:`~lightning_iocatch.capture.transform`) into
the session's buffer, and tells the coordinator
(:class:`~lightning_iocatch.capture.coordinator.ForwardCoordinator`) when the session has all
it asked for (early exit).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.compiled import prepare_for_hooks
from lightning_iocatch.capture.coordinator import ForwardCoordinator
from lightning_iocatch.capture.edits import Edit, RunningMean, apply_edits
from lightning_iocatch.capture.gradients import GradientSites, Part
from lightning_iocatch.capture.sharded import ShardedValues, Whole
from lightning_iocatch.capture.snapshots import CaptureTransfer
from lightning_iocatch.capture.transform import CaptureTransform, Kind, Site
from lightning_iocatch.errors import CaptureError

__all__ = ["CaptureSession", "Owner"]


class Owner(Protocol):
    """What a session needs of its catcher
    (:class:`~lightning_iocatch.capture.catcher.ModelIOCatcher`)."""

    model: nn.Module  # where the hooks go, under any wrapper
    root: nn.Module  # the module whose forwards the coordinator runs
    transfer: CaptureTransfer
    coordinator: ForwardCoordinator
    _session: CaptureSession | None  # the catcher's open session: one at a time


class CaptureSession:
    """One capture request on a :class:`~lightning_iocatch.capture.catcher.ModelIOCatcher`;
    hooks exist only while it is open.

    Use it as a context manager (``with catcher(outputs=[...]) as buf:``), or call
    :meth:`open` and :meth:`close` in a ``try/finally`` yourself. ``transform`` changes
    what the first batch's captures copy (see :mod:`~lightning_iocatch.capture.transform`);
    :meth:`take` gives each next batch its own. :meth:`set_batch_indices` gives the edits
    the batch's dataset indices (an edit that patches each sample with its stored row needs
    them).
    """

    def __init__(
        self,
        catcher: Owner,
        modules: dict[str, nn.Module],
        inputs: list[str],
        outputs: list[str],
        early_exit: bool,
        transform: CaptureTransform | None = None,
        edits: Sequence[Edit] = (),
        grad_inputs: Sequence[str] = (),
        grad_outputs: Sequence[str] = (),
        parts: Mapping[tuple[str, Kind], Part] | None = None,
        sharded: ShardedValues | None = None,
    ) -> None:
        self.catcher = catcher
        self.sharded = sharded  # a tensor-parallel model's values made whole (or None)
        self.modules = modules
        self.inputs = inputs
        self.outputs = outputs
        self.grad_inputs, self.grad_outputs = list(grad_inputs), list(grad_outputs)
        self.parts = dict(parts or {})  # (name, "inputs"|"outputs") -> the one tensor kept
        self.early_exit = early_exit
        self.edits = list(edits)
        self._batch_edits = self.edits  # the edits of the current batch (set_batch_indices)
        self._calls: dict[tuple[str, Kind], int] = {}  # calls in this forward, for edits
        self._applied = self._forwards = 0  # calls an edit changed; forwards of the model
        kinds: dict[str, list[Kind]] = {n: ["inputs", "outputs"] for n in [*inputs, *outputs]}
        for kind, names in (("grad_inputs", grad_inputs), ("grad_outputs", grad_outputs)):
            for name in names:  # every name has inputs and outputs, and the gradients asked
                kinds.setdefault(name, ["inputs", "outputs"]).append(kind)  # type: ignore[arg-type]
        self.buffer = CaptureBuffer.empty(kinds, transform)
        self._gradients = GradientSites()
        targets: list[tuple[str, Kind]] = [(n, "inputs") for n in inputs]
        targets += [(n, "outputs") for n in outputs]
        self._targets = frozenset(targets)
        self._pending: set[tuple[str, Kind]] = set(self._targets)
        self._handles: list[RemovableHandle] = []
        self._hooks: dict[tuple[str, str], Callable[..., Any]] = {}  # made once, reopened

    def _made(self, kind: str, name: str, make: Callable[..., Callable[..., Any]]) -> Any:
        """The hook ``make(self, name)`` of ``name``'s ``kind``, made on the first open only
        (a session opened on every watched step registers the same functions again)."""
        hook = self._hooks.get((kind, name))
        if hook is None:
            hook = self._hooks[(kind, name)] = make(self, name)
        return hook

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
        self._calls, self._applied, self._forwards = {}, 0, 0
        self._batch_edits = self.edits
        try:
            if self.sharded is not None:  # after the styles' hooks, before every capture
                self._handles.extend(self.sharded.register_tracking())
            if self.edits:  # a forward of the model starts: edits count calls from 0
                self._handles.append(self.root.register_forward_pre_hook(self._new_forward))
            # the gradient sites before every hook there already (a model's own output
            # recording reads the copy), and the edits before them: the copy is of the
            # edited value
            for name in self.grad_inputs:
                hook = self._made("grad_inputs", name, _grad_input_hook)
                module = self.modules[name]
                self._handles.append(
                    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
                )
                unchanged = self._made("unchanged", name, _unchanged_hook)
                self._handles.append(module.register_forward_hook(unchanged))
            for name in self.grad_outputs:
                hook = self._made("grad_outputs", name, _grad_output_hook)
                self._handles.append(self.modules[name].register_forward_hook(hook, prepend=True))
            for name, kind in dict.fromkeys((edit.module, edit.kind) for edit in self.edits):
                self._handles.append(_edit_hook(self, name, kind))  # before every capture
            for name in self.inputs:
                hook = self._made("inputs", name, _input_hook)
                self._handles.append(
                    self.modules[name].register_forward_pre_hook(hook, with_kwargs=True)
                )
            for name in self.outputs:
                hook = self._made("outputs", name, _output_hook)
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
        if handles and self.edits and self._forwards and not self._applied:
            warnings.warn(
                f"the edits of this session ({self.edits}) were never applied in its "
                f"{self._forwards} forward(s): no forward called an edited module (at the "
                "call asked for)",
                stacklevel=2,
            )
        self._capture_gradients()
        self.buffer.settle()

    def take(self, transform: CaptureTransform | None = None) -> CaptureBuffer:
        """Return what was captured so far, settled, and continue into a fresh, empty buffer
        whose captures go through ``transform`` (the next batch's; ``None``: none).

        Examples:
            >>> from lightning_iocatch.capture.catcher import ModelIOCatcher
            >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> session = ModelIOCatcher(net, "cpu")(outputs=["0"])
            >>> with session:
            ...     _ = net(torch.ones(1, 2))
            ...     first = session.take()
            ...     _ = net(torch.ones(1, 2))
            >>> len(first["0"]["outputs"]), len(session.buffer["0"]["outputs"])
            (1, 1)
        """
        self._capture_gradients()  # the batch's backward has run: its gradients are its own
        taken = self.buffer
        self.buffer = CaptureBuffer.empty(taken._data, transform)
        self._calls = {}  # a batch's forward starts: edits count calls from 0
        self._batch_edits = self.edits  # until the next batch's set_batch_indices
        taken.settle()
        return taken

    def gradient_edges(self) -> list[GradientEdge]:
        """Where the current batch's gradient sites are in the autograd graph: a backward
        that reaches them gives the gradients asked for, e.g. ``torch.autograd.grad(loss,
        session.gradient_edges())``, which changes no parameter's ``.grad`` (see
        :mod:`~lightning_iocatch.capture.gradients`)."""
        return self._gradients.edges()

    def discard_gradients(self) -> None:
        """Forget the current batch's gradient sites without capturing them: the forward
        or its backward failed, and that failure is the news (nothing is said of them)."""
        self._gradients.clear()

    def _capture_gradients(self) -> None:
        for name, kind, gradient, changed in self._gradients.collect():
            if changed is None:
                self._capture(name, kind, gradient)  # a part's gradient is its one tensor
            else:  # through the batch's transform already, as each gradient arrived
                self._capture(name, kind, gradient, _Arrived(changed))

    def _attach(self, name: str, kind: Kind, value: Any, part: Any) -> Any:
        """Hook ``value``'s tensors for their gradients, under the batch's transform."""
        transform = self.buffer.transform
        calls = self.buffer.calls(name, kind) if transform is not None else 0
        sharded = self.sharded
        if sharded is None:
            return self._gradients.attach(name, kind, value, part, transform, calls)
        call = sum(1 for site in self._gradients.sites if (site.name, site.kind) == (name, kind))

        def whole(tensor: torch.Tensor, path: str) -> Whole:  # as each gradient arrives
            return sharded.gatherer(name, kind, "raw", tensor, path, call)

        return self._gradients.attach(
            name, kind, value, part, transform, calls, whole, follow=sharded.follow
        )

    def set_batch_indices(self, indices: Sequence[int] | None) -> None:
        """The next forwards are of a batch whose samples have the dataset ``indices`` (in
        batch order; ``None``: unknown): each edit applies as its ``edit.for_batch(indices)``
        (:meth:`~lightning_iocatch.capture.edits.Edit.for_batch`; a ``StorePatch`` reads
        the batch's rows now) until the next call, or :meth:`take`, which ends the batch.
        ``IOCaptureCallback`` calls it at every batch start.

        Raises:
            CaptureError: an edit's ``for_batch`` changed its module or kind.
        """
        batch = [edit.for_batch(indices) for edit in self.edits]
        for armed, edit in zip(self.edits, batch, strict=True):
            if (edit.module, edit.kind) != (armed.module, armed.kind):
                raise CaptureError(
                    f"{armed!r}.for_batch gave {edit!r}, an edit of another module or kind; "
                    "it must edit the same place"
                )
        self._batch_edits = batch

    def __enter__(self) -> CaptureBuffer:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def begin_forward(self) -> None:
        """A forward through the coordinator starts: every capture is pending again."""
        self._pending = set(self._targets)
        self._calls = {}

    def _new_forward(self, *_: Any) -> None:
        if not self._acts():
            return
        self._calls = {}
        self._forwards += 1

    def _edit(self, name: str, kind: Kind, value: Any) -> Any:
        """``value`` with this session's edits of ``name``'s ``kind`` for this call applied
        (``value`` itself when none applies). Activation checkpointing recomputes a forward
        during backward: the same edits apply there, so that gradients are those of the
        edited forward (an edit of one call cannot tell its call there, and a running mean
        would count the values again: refused)."""
        mine = [edit for edit in self._batch_edits if edit.module == name and edit.kind == kind]
        if _in_backward():
            if any(edit.call is not None for edit in mine):
                raise CaptureError(
                    f"{name!r} is recomputed by activation checkpointing during backward, "
                    "where its call cannot be told: an edit with `call=` cannot apply there; "
                    "edit every call, or do not checkpoint that module"
                )
            if any(isinstance(edit, RunningMean) for edit in mine):
                raise CaptureError(
                    f"{name!r} is recomputed by activation checkpointing during backward, "
                    "where a RunningMean would add its values to the estimate a second "
                    "time; give Mean a fixed mean, or do not checkpoint that module"
                )
            return self._apply_edits(name, kind, mine, value, 0)
        call = self._calls.get((name, kind), 0)
        self._calls[(name, kind)] = call + 1
        self._applied += any(edit.call in (None, call) for edit in mine)
        return self._apply_edits(name, kind, mine, value, call)

    def _apply_edits(self, name: str, kind: Kind, mine: list[Edit], value: Any, call: int) -> Any:
        """``mine`` applied to ``value`` at ``call``; on a tensor-parallel model, to the
        whole value, cut back to the form the forward continues with."""
        if self.sharded is None or not any(edit.call in (None, call) for edit in mine):
            return apply_edits(mine, kind, value, call)
        return self.sharded.edit(
            name, kind, value, lambda v: apply_edits(mine, kind, v, call), call
        )

    def _acts(self) -> bool:
        """Whether this session's hooks act now (it is not set aside while forwards run on
        the side: :meth:`ForwardCoordinator.apart`)."""
        return self.catcher.coordinator.acts(self)

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

    def _capture(
        self, name: str, kind: Kind, value: Any, transform: CaptureTransform | None = None
    ) -> None:
        """Copy ``value`` (its part, if one is asked for) through the batch's transform (or
        ``transform``) into the buffer; stop if done."""
        if self.sharded is not None and kind in ("inputs", "outputs"):
            value = self.sharded.whole(name, kind, value, "prepared", self.buffer.calls(name, kind))
        part = self.parts.get((name, kind))
        if part is not None:
            value = part(value)
        buffer = self.buffer
        transform = transform or buffer.transform
        site = None if transform is None else Site(name, kind, buffer.calls(name, kind))
        copied, events, changed = self.catcher.transfer(value, transform, site)
        buffer.add(name, kind, copied, events, changed)
        if self.early_exit:
            self._pending.discard((name, kind))
            if not self._pending:
                self.catcher.coordinator.maybe_stop(self)


class _Arrived:
    """The transform of gradients the batch's transform changed as they arrived: each
    tensor, in the order the copy visits them, is kept as it is and marked changed or not."""

    def __init__(self, changed: list[bool]) -> None:
        self._changed = iter(changed)

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor | None:
        return tensor if next(self._changed) else None


def _in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing then re-runs the
    forward of checkpointed layers, which is not a forward to capture."""
    return bool(torch._C._current_graph_task_id() != -1)


def _grad_input_hook(session: CaptureSession, name: str) -> Callable[..., Any]:
    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _in_backward() or not session._acts():
            return None  # a recomputation (activation checkpointing) is not a new call
        part = session.parts.get((name, "inputs"))
        return session._attach(name, "grad_inputs", (args, kwargs), part)

    return hook


def _unchanged_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    @torch.compiler.disable
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not _in_backward() and session._acts():
            session._gradients.check_unchanged(name)

    return hook


def _grad_output_hook(session: CaptureSession, name: str) -> Callable[..., Any]:
    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if _in_backward() or not session._acts():
            return None
        part = session.parts.get((name, "outputs"))
        return session._attach(name, "grad_outputs", output, part)

    return hook


def _edit_hook(session: CaptureSession, name: str, kind: Kind) -> RemovableHandle:
    """The hook that applies ``session``'s edits of ``name``'s ``kind``, registered first
    among the module's hooks: every capture, of any session, reads the edited value."""
    module = session.modules[name]

    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def edit_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = (args, kwargs)
        if not session._acts():
            return None
        edited = session._edit(name, "inputs", value)
        return None if edited is value else edited

    @torch.compiler.disable
    def edit_outputs(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not session._acts():
            return None
        edited = session._edit(name, "outputs", output)
        return None if edited is output else edited

    if kind == "inputs":
        return module.register_forward_pre_hook(edit_inputs, with_kwargs=True, prepend=True)
    return module.register_forward_hook(edit_outputs, prepend=True)


def _input_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _in_backward() or not session._acts() or not session._wants_call():
            return  # the forward continues with its own inputs (None: unchanged)
        session._capture(name, "inputs", {"args": args, "kwargs": kwargs})

    return hook


def _output_hook(session: CaptureSession, name: str) -> Callable[..., None]:
    @torch.compiler.disable  # eager inside compiled code: exact values, real exceptions
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _in_backward() or not session._acts() or not session._wants_call():
            return  # the forward continues with the module's own output (None: unchanged)
        session._capture(name, "outputs", output)

    return hook
