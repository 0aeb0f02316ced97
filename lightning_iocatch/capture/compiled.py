"""torch.compile support: make compiled code see the catcher's hooks, or refuse clearly.

The catcher calls :func:`prepare_for_hooks` each time a session opens, before it registers
its hooks. Those hooks run eagerly (``torch.compiler.disable``): inside code compiled
without ``fullgraph`` that is a graph break, and captures equal eager; inside code
compiled with ``fullgraph=True`` a graph break is an error, so the session refuses to open
with a :class:`~lightning_iocatch.errors.CaptureError` that says what to do instead of
letting Dynamo fail in the middle of a forward.

Three ways of compiling are recognised, wherever they sit in the model:

- ``torch.compile(module)``: an ``OptimizedModule`` whose ``forward`` is compiled;
- ``module.compile()``: compiled in place (``nn.Module.compile``), no wrapper;
- a compiled function stored on a module, as Lightning does for a compiled
  ``LightningModule`` (its ``forward`` and ``*_step`` methods).

This module is the only one that reads Dynamo's private records (which context compiled
a function and with which options); ``tests/test_compile.py`` fails loudly when torch
changes them. Not protected: a function compiled with ``fullgraph=True`` that a forward
calls (``block = torch.compile(fn, fullgraph=True)``), and a compiled wrapper that the
catcher's model does not contain (a catcher on ``net`` while the code calls
``torch.compile(net, fullgraph=True)``): neither is visible from the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FunctionType
from typing import Any

from torch import nn

from lightning_iocatch.capture.spec import canonical_name
from lightning_iocatch.errors import CaptureError

__all__ = ["prepare_for_hooks"]

# Frames that run a module's own hooks; Dynamo skips them, so those hooks stay eager.
_CALL_METHODS = ("__call__", "_wrapped_call_impl", "_call_impl")


@dataclass(frozen=True)
class _CompiledPart:
    """One compiled callable stored on a module of the model."""

    name: str  # the module's name in ``named_modules()``, wrapper components included
    module: nn.Module
    attribute: str  # "forward" (torch.compile, Lightning), "_compiled_call_impl", "training_step"
    fullgraph: bool
    hooks_outside: tuple[nn.Module, ...]  # modules whose own hooks run before the compiled frame


def _dynamo_context(value: Any) -> Any | None:
    """The ``OptimizeContext`` that ``torch.compile`` made ``value`` with, or ``None``.

    A compiled function is Dynamo's ``compile_wrapper`` closure, which keeps the context
    (and with it the ``fullgraph`` option) in a closure cell.
    """
    if not isinstance(value, FunctionType) or not hasattr(value, "_torchdynamo_orig_callable"):
        return None  # the common case, first: it runs for every attribute of every module
    from torch._dynamo.eval_frame import OptimizeContext

    for cell in value.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, OptimizeContext):
            return contents
    return None


def _called_module(compiled: Callable[..., Any]) -> nn.Module | None:
    """The module whose ``__call__``/``_call_impl`` was compiled, if that is what it is.

    ``torch.compile(module)`` compiles ``module.__call__`` (for a ``forward`` of one's own)
    and ``module.compile()`` compiles ``module._call_impl``; Dynamo skips those frames, so
    that module's own hooks run eagerly. (For a ``forward`` that torch itself defines, such
    as ``nn.Sequential``'s, ``torch.compile`` traces the call, hooks included.)
    """
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    owner = getattr(original, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(original, "__name__", "") in _CALL_METHODS:
        return owner
    return None


def _compiled_parts(model: nn.Module) -> list[_CompiledPart]:
    parts = []
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if not isinstance(value, FunctionType):  # the parameters, buffers, submodules...
                continue
            context = _dynamo_context(value)
            if context is None:
                continue
            outside = [module] if attribute in ("forward", "_compiled_call_impl") else []
            called = _called_module(value)
            if called is not None:
                outside.append(called)
            fullgraph = bool(getattr(context, "fullgraph", False))
            parts.append(_CompiledPart(name, module, attribute, fullgraph, tuple(outside)))
    return parts


def _fullgraph_interiors(parts: Iterable[_CompiledPart]) -> dict[int, _CompiledPart]:
    """``id(module) -> part`` for every module whose hooks would run inside fullgraph code."""
    inside: dict[int, _CompiledPart] = {}
    for part in parts:
        if part.fullgraph:
            outside = {id(m) for m in part.hooks_outside}
            for module in part.module.modules():
                if id(module) not in outside:
                    inside.setdefault(id(module), part)
    return inside


def _fullgraph_message(name: str | None, part: _CompiledPart) -> str:
    """Which capture is refused (``None``: any), where the fullgraph code is, and the fix."""
    from torch._dynamo.eval_frame import OptimizedModule

    region = canonical_name(part.name)
    where = f"`{region}`" if region else "the model"
    if name is None:
        problem = f"cannot capture in this model: {where} holds code compiled with `fullgraph=True`"
    else:
        what = f"`{name}`" if name else "the model"
        problem = f"cannot capture {what}: it runs inside code compiled with `fullgraph=True`"
    problem += ", where the catcher's hooks would be a graph break, which fullgraph forbids."
    where = where[0].upper() + where[1:]
    if isinstance(part.module, OptimizedModule):
        fix = (
            f"{where} is `torch.compile(module, fullgraph=True)`. Compile it without "
            "`fullgraph=True` (captures then equal eager), or capture on the uncompiled "
            "module: give the catcher `compiled._orig_mod` and call that."
        )
    elif part.attribute == "_compiled_call_impl":
        fix = (
            f"{where} was compiled in place with `.compile(fullgraph=True)`. Call `.compile()` "
            "on it again without `fullgraph=True` (captures then equal eager)."
        )
    elif getattr(part.module, "_compiler_ctx", None) is not None:
        fix = (
            f"Lightning compiled `{part.attribute}` of {where.lower()[:1] + where[1:]} from "
            "`torch.compile(model, fullgraph=True)`. Compile the model without "
            "`fullgraph=True`, or undo it with "
            "`lightning.pytorch.utilities.compile.to_uncompiled(model)`."
        )
    else:
        fix = (
            f"`{part.attribute}` of {where.lower()[:1] + where[1:]} is compiled with "
            "`fullgraph=True`. Compile it without `fullgraph=True` (captures then equal eager)."
        )
    return f"{problem} {fix}"


def _make_dynamo_guard_on_hooks() -> None:
    """Let compiled code notice hooks added or removed after compilation.

    By default Dynamo does not guard on module hooks, so hooks registered after the first
    compiled call are silently ignored (pytorch#117758). Turning the guards on is
    process-wide; code compiled before is dropped once so that it is recompiled with them.
    """
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset_code_caches()


def prepare_for_hooks(model: nn.Module, modules: dict[str, nn.Module] | None = None) -> None:
    """Make ``model``'s compiled parts run hooks registered on ``modules``, or refuse.

    Called before hooks are registered. ``modules`` maps the (canonical) names of the
    modules about to be hooked to those modules; ``None`` means any module of ``model``,
    which refuses whenever some part of it is compiled with ``fullgraph=True``.

    Raises:
        CaptureError: a module in ``modules`` would run its hooks inside code compiled
            with ``fullgraph=True``; the message names it and says what to do.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> net.compile(fullgraph=True)
        >>> prepare_for_hooks(net, {"0": net[0]})
        Traceback (most recent call last):
        ...
        lightning_iocatch.errors.CaptureError: cannot capture `0`: it runs inside code ...
    """
    parts = _compiled_parts(model)
    if not parts:
        return
    inside = _fullgraph_interiors(parts)
    if modules is None:
        if inside:
            raise CaptureError(_fullgraph_message(None, next(iter(inside.values()))))
    else:
        for name, module in modules.items():
            part = inside.get(id(module))
            if part is not None:
                raise CaptureError(_fullgraph_message(canonical_name(name), part))
    _make_dynamo_guard_on_hooks()
