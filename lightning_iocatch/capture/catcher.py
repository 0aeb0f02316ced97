"""ModelIOCatcher: capture the inputs and outputs of named submodules, with early exit.

A catcher resolves names and globs against its model and opens one
:class:`~lightning_iocatch.capture.session.CaptureSession` at a time, whose hooks exist
only while it is open: a forward outside a session runs exactly as if the catcher did not
exist.

Several sessions may be open on one model at once (one per catcher, e.g. two
``IOCaptureCallback``s); they share the model's
:class:`~lightning_iocatch.capture.coordinator.ForwardCoordinator`, which decides when a forward
may stop early.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.coordinator import COORDINATOR, ForwardCoordinator
from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.gradients import Part
from lightning_iocatch.capture.session import CaptureSession
from lightning_iocatch.capture.sharded import ShardedValues, checked_shard_layouts
from lightning_iocatch.capture.snapshots import CaptureTransfer
from lightning_iocatch.capture.spec import (
    WRAPPER_COMPONENTS,
    CaptureSpec,
    canonical_name,
    resolve_names,
)
from lightning_iocatch.capture.transform import CaptureTransform, Kind
from lightning_iocatch.checks import (
    check_bool,
    check_int,
    parse_capture_dtype,
    parse_device,
)
from lightning_iocatch.errors import CaptureError

__all__ = [
    "CaptureBuffer",
    "CaptureSession",
    "ForwardCoordinator",
    "ModelIOCatcher",
    "module_index",
]


def module_index(model: nn.Module) -> dict[str, nn.Module]:
    """Submodules by name, without the components that wrappers insert.

    The components are :data:`~.spec.WRAPPER_COMPONENTS` (``torch.compile``, FSDP,
    activation checkpointing). Where a wrapper and the module it wraps share a
    name, the wrapped (inner) module wins: hooks go on the user's own layer.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> list(module_index(net))
        ['', '0']
    """
    index: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        index[canonical_name(name)] = module
    return index


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


class ModelIOCatcher:
    """Capture inputs and/or outputs of named submodules during forward passes.

    ``model`` is the module to watch; valid names are those of ``model.named_modules()``
    (the components wrappers insert, such as ``_orig_mod.`` of ``torch.compile`` or
    ``_fsdp_wrapped_module.``, may be left out), and names may
    use globs (see :mod:`lightning_iocatch.capture.spec`). ``device`` is where captured tensors
    are copied (``None``: where they are); ``dtype`` casts floating tensors (not to 8-bit
    floats, which a cast without a scale would clip or zero: a ``FeatureWriter`` stores
    them scaled per row). From a CUDA
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

    On a tensor-parallel model (``parallelize_module``, or Hugging Face's plan) every
    session's values are whole (see :mod:`~lightning_iocatch.capture.sharded`);
    ``shard_layouts`` gives the placement of a value no parallel style declares, by
    ``"{inputs|outputs}[name]"`` (e.g. ``{"outputs[blocks.0.split]": Shard(-1)}``).

    Global state: when a session opens on a model with ``torch.compile``d parts, Dynamo's
    process-wide ``skip_nnmodule_hook_guards`` is turned off (so compiled code notices the
    hooks) and code compiled before is dropped once, for every model of the process.

    Sessions of several catchers may be open on one model at once; without edits each
    captures exactly what it would capture alone (a session's edits change the forward,
    and so what every session captures after them: see
    :mod:`~lightning_iocatch.capture.edits`), and a forward stops early only once every open
    session has early exit and is done (see :class:`ForwardCoordinator`).

    Examples:
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
        shard_layouts: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.device = parse_device("device", device)
        self.dtype = parse_capture_dtype("dtype", dtype)
        pinned = check_int("pinned_memory_bytes", pinned_memory_bytes, minimum=0)
        self.transfer = CaptureTransfer(self.device, self.dtype, pinned_bytes=pinned)
        self._session: CaptureSession | None = None
        self._requested: CaptureSession | None = None
        self.coordinator: ForwardCoordinator = COORDINATOR
        self.root = _unwrapped(model)  # the module whose forwards `run` drives
        self.shard_layouts = checked_shard_layouts(shard_layouts)

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
        self,
        inputs: Iterable[str] = (),
        outputs: Iterable[str] = (),
        early_exit: bool = False,
        transform: CaptureTransform | None = None,
        edits: Iterable[Edit] = (),
        grad_inputs: Iterable[str] = (),
        grad_outputs: Iterable[str] = (),
        parts: Mapping[tuple[str, Kind], Part] | None = None,
    ) -> CaptureSession:
        """Request a session capturing ``inputs`` and ``outputs`` (names or globs), the
        gradients of ``grad_inputs`` and ``grad_outputs`` (see
        :mod:`~lightning_iocatch.capture.gradients`), and applying ``edits`` (see
        :mod:`~lightning_iocatch.capture.edits`) while it is open. ``parts`` maps a
        resolved ``(name, "inputs" | "outputs")`` to a function that picks the one tensor of
        the value (inputs: ``{"args", "kwargs"}``) to capture, and of which to take the
        gradient, instead of the whole value (attribution patching takes only what an edit
        would patch).

        Use as ``with catcher(inputs=[...], outputs=[...]) as buf:``. Unknown names raise
        ``KeyError`` (``UnknownModuleError``) with close matches; a request that selects
        nothing raises ``ValueError``. ``transform`` changes what is copied of each
        captured tensor (see :mod:`~lightning_iocatch.capture.transform`), such as a
        batch's token selection.
        """
        inputs, outputs = _names("inputs", inputs), _names("outputs", outputs)
        grad_in, grad_out = _names("grad_inputs", grad_inputs), _names("grad_outputs", grad_outputs)
        early_exit = check_bool("early_exit", early_exit)
        if early_exit and (grad_in or grad_out):
            raise ValueError(
                "gradients are asked for with early_exit=True: a backward needs the whole "
                "forward, up to the loss; give early_exit=False"
            )
        if self._session is not None:
            raise CaptureError(
                "a capture session is already open on this catcher; nested sessions would "
                "clobber each other. Close the open one first or use a second ModelIOCatcher"
            )
        index = self._modules()
        resolved_in = resolve_names(inputs, list(index))
        resolved_out = resolve_names(outputs, list(index))
        resolved_grad_in = resolve_names(grad_in, list(index))
        resolved_grad_out = resolve_names(grad_out, list(index))
        edits = list(edits)
        for edit in edits:
            if not isinstance(edit, Edit):
                raise TypeError(f"`edits` takes Edit objects (Zero, Steer, ...), got {edit!r}")
            if resolve_names([edit.module], list(index)) != [edit.module]:
                raise ValueError(f"an edit names {edit.module!r}: give one module's exact name")
        if not (resolved_in or resolved_out or resolved_grad_in or resolved_grad_out or edits):
            raise ValueError(
                "the capture request selects no module: give `inputs`, `outputs`, "
                "`grad_inputs`, `grad_outputs` or `edits`"
            )
        if transform is not None and not callable(getattr(transform, "capture", None)):
            raise TypeError(
                "`transform` must have a `capture(tensor, site)` method (a CaptureTransform, "
                f"such as TokenRows(...).select(batch)), got {type(transform).__name__}"
            )
        names = (
            *resolved_in,
            *resolved_out,
            *resolved_grad_in,
            *resolved_grad_out,
            *(edit.module for edit in edits),
        )
        modules = {name: index[name] for name in names}
        for site in self.shard_layouts:  # `{inputs|outputs}[name]`: a name of the model
            resolve_names([site.split("[", 1)[1][:-1]], list(index))
        self._requested = CaptureSession(
            self,
            modules,
            resolved_in,
            resolved_out,
            early_exit,
            transform,
            edits,
            grad_inputs=resolved_grad_in,
            grad_outputs=resolved_grad_out,
            parts=parts,
            sharded=ShardedValues.of(self.model, self.shard_layouts, index.values()),
        )
        return self._requested

    def from_spec(
        self,
        spec: str | CaptureSpec,
        early_exit: bool = False,
        transform: CaptureTransform | None = None,
        edits: Iterable[Edit] = (),
    ) -> CaptureSession:
        """Request a session from a spec string such as ``"outputs[model.layers.5]"``.

        Same as ``catcher(inputs=..., outputs=..., early_exit=..., transform=..., edits=...)``
        with the names of the spec. Malformed specs raise ``SpecError``; a spec that selects nothing
        raises ``ValueError``; unknown names raise ``KeyError`` (``UnknownModuleError``).
        """
        parsed = spec if isinstance(spec, CaptureSpec) else CaptureSpec.parse(spec)
        if parsed.is_empty:
            raise ValueError(f"capture spec {parsed.to_string() or spec!r} selects no module")
        return self(
            parsed.inputs,
            parsed.outputs,
            early_exit,
            transform,
            edits,
            grad_inputs=parsed.grad_inputs,
            grad_outputs=parsed.grad_outputs,
        )

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

    @property
    def session(self) -> CaptureSession | None:
        """The open session, if any."""
        return self._session

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, device={self.device})"
