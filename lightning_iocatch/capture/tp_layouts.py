"""Where tensor parallelism put a module's values: the layouts its parallel style declared.

``torch.distributed.tensor.parallel.parallelize_module`` applies a style
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``,
``PrepareModuleOutput``, ``PrepareModuleInputOutput``) by registering a forward pre-hook
that turns the module's inputs into DTensors and a forward hook that turns its outputs
into the layouts the style asks for (local tensors with ``use_local_output=True``). The
style's layouts live only in those hooks: this module reads them back, so that a value
seen on either side of them has a known placement on the tensor-parallel mesh.

Two views of a module's value, as a hook sees it:

- ``"raw"``: before the style's hooks (a session's edits and gradient sites, registered
  first): the inputs as the caller gave them, the output as the module computed it.
- ``"prepared"``: after them (a session's captures): the inputs as the module gets them,
  the output as its caller gets it.

A placement is known where the style says it (a local tensor of a declared layout); a
DTensor carries its own. :func:`style_layouts` returns ``None`` for a module without
such hooks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

__all__ = ["StyleLayouts", "View", "style_layouts", "tensor_parallel_mesh"]

View = Literal["raw", "prepared"]
# A value's place: ("args", i) or ("kwargs", name) of inputs, ("output", i) of outputs
# (i = 0 for a module that returns one tensor).
Place = tuple[str, Any]


@dataclass
class StyleLayouts:
    """The placements a module's parallel style declared, by view and place (see the module
    docstring), on ``mesh``. A place missing from a view is not a local shard of a
    declared layout (a DTensor there carries its own placement)."""

    mesh: Any  # DeviceMesh
    raw: dict[Place, Any] = field(default_factory=dict)
    prepared: dict[Place, Any] = field(default_factory=dict)

    def placement(self, view: View, place: Place) -> Any:
        """The declared placement of ``place`` in ``view``, or ``None``."""
        return (self.raw if view == "raw" else self.prepared).get(place)


def _tensor_parallel_hook(hook: Any) -> dict[str, Any] | None:
    """The closure of a hook that a parallel style registered, or ``None`` for any other."""
    qualname = getattr(hook, "__qualname__", "")
    module = getattr(hook, "__module__", "") or ""
    if not module.startswith("torch.distributed.tensor") or "<lambda>" not in qualname:
        return None
    try:
        found = dict(inspect.getclosurevars(hook).nonlocals)
    except (TypeError, ValueError):
        return None
    return found if "device_mesh" in found else None


def _arguments(fn: Any) -> dict[str, Any]:
    """A ``functools.partial``'s bound arguments by parameter name."""
    if not isinstance(fn, functools.partial):
        return {}
    names = list(inspect.signature(fn.func).parameters)
    return {**dict(zip(names, fn.args, strict=False)), **fn.keywords}


def _first(layouts: Any) -> Any:
    return layouts[0] if isinstance(layouts, tuple) and layouts else layouts


def _hugging_face_style(module: nn.Module) -> tuple[Any, Any] | None:
    """``(style, mesh)`` of a module that Hugging Face's tensor-parallel plan sharded: it
    replaces the module's ``forward`` with a ``tp_forward`` closure over its style (every
    hook sees the values outside it: the inputs as given, the output as handed on)."""
    forward: Any = module.__dict__.get("forward")
    if getattr(forward, "__name__", None) != "tp_forward" or not forward.__closure__:
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=False))
    try:
        style, mesh = cells["self"].cell_contents, cells["mesh"].cell_contents
    except (KeyError, ValueError):
        return None
    return style, mesh


def _read_hugging_face(style: Any, mesh: Any) -> StyleLayouts:
    layouts = StyleLayouts(mesh)
    given = _first(getattr(style, "input_layouts", None))
    if given is not None:
        layouts.raw["args", 0] = layouts.prepared["args", 0] = given
    handed = _first(getattr(style, "output_layouts", None))
    if handed is not None and getattr(style, "use_local_output", False):
        layouts.raw["output", 0] = layouts.prepared["output", 0] = handed
    return layouts


def style_layouts(module: nn.Module) -> StyleLayouts | None:
    """The layouts of ``module``'s parallel style, read from its hooks (or from the
    ``forward`` Hugging Face's plan put in its place); ``None`` if no parallel style
    sharded it."""
    hugging_face = _hugging_face_style(module)
    if hugging_face is not None:
        return _read_hugging_face(*hugging_face)
    pre = [_tensor_parallel_hook(h) for h in module._forward_pre_hooks.values()]
    post = [_tensor_parallel_hook(h) for h in module._forward_hooks.values()]
    found = [c for c in [*pre, *post] if c is not None]
    if not found:
        return None
    layouts = StyleLayouts(found[0]["device_mesh"])
    sequence = None
    for closure in (c for c in pre if c is not None):
        sequence = _read_inputs(layouts, closure) or sequence
    for closure in (c for c in post if c is not None):
        _read_outputs(layouts, closure, sequence)
    return layouts


def _read_inputs(layouts: StyleLayouts, closure: dict[str, Any]) -> Any:
    """Record the input placements of a pre-hook's style; return a SequenceParallel's
    sequence sharding (its output keeps it)."""
    style = closure.get("self")
    if style is not None:  # PrepareModuleInput (also inside PrepareModuleInputOutput)
        given, desired = style.input_layouts or (), style.desired_input_layouts or ()
        local = style.use_local_output
        for i, (placement, wanted) in enumerate(zip(given, desired, strict=False)):
            if placement is not None:
                layouts.raw["args", i] = placement
                if local:
                    layouts.prepared["args", i] = wanted or placement
        for name, placement in style.input_kwarg_layouts.items():
            layouts.raw["kwargs", name] = placement
            if local:
                wanted = style.desired_input_kwarg_layouts.get(name)
                layouts.prepared["kwargs", name] = wanted or placement
        return None
    arguments = _arguments(closure.get("input_fn"))
    if "sequence_sharding" in arguments:  # SequenceParallel: a plain input is a shard
        layouts.raw["args", 0] = _first(arguments["sequence_sharding"])
        return _first(arguments["sequence_sharding"])
    if "input_layouts" in arguments:  # Colwise/RowwiseParallel: args[0] annotated
        layouts.raw["args", 0] = _first(arguments["input_layouts"])
    return None


def _read_outputs(layouts: StyleLayouts, closure: dict[str, Any], sequence: Any) -> None:
    style = closure.get("self")
    if style is not None:  # PrepareModuleOutput
        pairs = zip(style.output_layouts, style.desired_output_layouts, strict=False)
        for i, (placement, wanted) in enumerate(pairs):
            if placement is not None:
                layouts.raw["output", i] = placement
                if style.use_local_output:
                    layouts.prepared["output", i] = wanted or placement
        return
    arguments = _arguments(closure.get("output_fn"))
    if not arguments.get("use_local_output"):
        return  # the caller gets the module's DTensor, which carries its placement
    if "output_layouts" in arguments:  # Colwise/RowwiseParallel
        layouts.prepared["output", 0] = _first(arguments["output_layouts"])
    elif sequence is not None:  # SequenceParallel: the output keeps the input's sharding
        layouts.prepared["output", 0] = sequence


def tensor_parallel_mesh(modules: Iterable[nn.Module]) -> Any:
    """The device mesh of the first parallel style found among ``modules`` (a model's
    ``modules()``; ``None``: none). Cheap where no module has hooks or a replaced
    ``forward``: the cost of a plain model's session."""
    for module in modules:
        if "forward" in module.__dict__:
            hugging_face = _hugging_face_style(module)
            if hugging_face is not None:
                return hugging_face[1]
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook in hooks.values() if hooks else ():
                closure = _tensor_parallel_hook(hook)
                if closure is not None:
                    return closure["device_mesh"]
    return None
