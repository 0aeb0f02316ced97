"""Replaying a clean forward's module calls in a later forward of the same batch.

The machinery of :class:`~lightning_iocatch.capture.variants.Variants` (see there for when
replaying is exact): a :class:`Recorder` records the module calls of one clean forward
that may be replayed alone (those of the model, of an edited module and of a module that
holds one) and the point where each variant's edits first take effect; :class:`Replaying`
swaps, for one forward, the forwards of the calls that ended before that point for ones that
return the clean outputs, each call checked first (:func:`same`: its arguments are the clean
call's; version counters: nothing was modified in place since).

Under ``torch.inference_mode`` (as in Lightning's validation loop) the tensors a forward
makes are inference tensors, which have no version counter: a call that may be replayed
(one made by the forward itself, or by a module that holds an edited module) keeps private
copies of the inference tensors it was given and returned, taken when it started and ended,
its arguments are compared by value, and each replay returns fresh copies (the last forward
to replay them, a batch's last variant, gets the private copies themselves); an output that
aliases an input tensor (``nn.Identity``, dropout in eval mode), or a call whose copies were
not kept, is never replayed. A call that ends after every variant's edit point keeps no
copy of its output (no variant replays it), unless outermost in a forward to be reused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.keys import flatten_value
from lightning_iocatch.capture.snapshots import map_tensors

__all__ = ["Call", "Recorder", "Replaying", "same", "unchanged"]

_SIMPLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_NUMPY = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool}  # fmt: skip


@dataclass(eq=False)
class Call:
    """One module call of the clean forward: when it started and ended (event numbers),
    what it was given and what it returned."""

    module: nn.Module
    number: int  # the module's calls before this one in the forward
    start: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    end: float = math.inf
    output: Any = None
    versions: list[tuple[torch.Tensor, int | None]] = field(default_factory=list)
    children: list[Call] = field(default_factory=list)
    counted_inside: bool = False  # a module edited at one call (`call=`) ran inside it
    opaque: str | None = None  # the type of an argument compared by type only
    never: bool = False  # it raised, returned nothing, or holds inference tensors not kept
    copied: bool = False  # its inference tensors are private copies (return fresh ones)
    given: set[int] = field(default_factory=set)  # where its inference arguments lie
    context: Any = None  # an outermost call's context, for a forward recorded to be reused


class Recorder:
    """Hooks that record the module calls of one clean forward (those that may be replayed
    alone: see :func:`_recorded`), and the edit point of each variant."""

    def __init__(
        self,
        model: nn.Module,
        points: dict[str, list[tuple[nn.Module, Edit]]],
        context: Callable[[], Any] | None = None,
    ):
        self.points = points
        self._context = context  # taken at each outermost call's start (Call.context)
        edited = {id(m) for found in points.values() for m, _ in found}
        self._holders = _holders(model, edited)
        self.edit_at: dict[str, float] = dict.fromkeys(points, math.inf)
        self._clean = math.inf  # the edit point of no edits: the clean forward replayed
        self.top: list[Call] = []
        self._stack: list[tuple[int, Call | None]] = []  # (the module's call number, call)
        self._counts: dict[int, int] = {}
        self._counted = {  # modules whose calls an edit counts (`call=`): never inside a replay
            id(module)
            for found in points.values()
            for module, edit in found
            if edit.call is not None
        }
        self._events = 0
        self._handles: list[RemovableHandle] = []
        try:
            for module in _recorded(model, self._holders | edited):
                if module is not model:
                    self._handles.append(
                        module.register_forward_pre_hook(self._started, with_kwargs=True)
                    )
                    # first among the forward hooks: the output as forward returned it (other
                    # hooks run on a replayed output again), and also when forward raises
                    hook = module.register_forward_hook(self._ended, prepend=True, always_call=True)
                    self._handles.append(hook)
        except BaseException:  # a module that takes no hooks: none is left behind
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook registered (also those of a registration that failed)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _tick(self) -> int:
        self._events += 1
        return self._events

    def _started(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        number = self._counts.get(id(module), 0)
        self._counts[id(module)] = number + 1
        now = self._tick()
        self._mark(module, number, "inputs", now)
        if id(module) in self._counted:
            for _, outer in self._stack:
                if outer is not None:
                    outer.counted_inside = True
        reused = self._context is not None  # its outermost calls may be the clean forward
        if (self._stack or not reused) and all(at < math.inf for at in self.edit_at.values()):
            self._stack.append((number, None))  # after every edit point: nothing to replay
            return
        context = None
        if not self._stack and self._context is not None:  # (for mypy: `reused`)
            own = len(self._handles)  # the context without this recorder's hooks
            taken = self._context()
            context = (*taken[:2], taken[2] - own, *taken[3:])
        parent = self._stack[-1][1] if self._stack else None
        kept = parent is None or id(parent.module) in self._holders  # may be replayed alone
        given_args, given_kwargs = _copied((args, kwargs), kept)  # as given, not appended to
        versions = _versions((given_args, given_kwargs))
        call = Call(module, number, now, given_args, given_kwargs, versions=versions)
        call.context = context
        call.opaque = _opaque((args, kwargs))
        call.copied = kept
        call.given = _storages((args, kwargs))
        call.never = not kept and bool(call.given)  # cannot be compared later
        (parent.children if parent is not None else self.top).append(call)
        self._stack.append((number, call))

    def _ended(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        number, call = self._stack.pop() if self._stack else (0, None)
        now = self._tick()
        if call is not None and self._late(now, top=not self._stack):
            call.end, call.never = now, True  # no variant replays it: its output not kept
        elif call is not None:
            call.end, call.output = now, _copied(output, call.copied)
            call.versions += _versions(output)
            returned = _storages(output)
            if output is None or (returned and not call.copied) or returned & call.given:
                # it raised, or returned nothing, or inference tensors not kept (whose
                # changes in place cannot be seen), or one of its inputs (a copy would not)
                call.never = True
            inside = any(call.start < at <= now for at in self.edit_at.values())
            if not inside and not call.counted_inside:
                call.children = []  # replayed whole wherever it is replayed
        self._mark(module, number, "outputs", now)

    def _late(self, now: int, top: bool) -> bool:
        """Whether a call ending at ``now`` ends after every variant's edit point: no variant
        replays it, only the clean one reused replays an outermost call such as this."""
        if (top and self._context is not None) or not self.edit_at:
            return False
        return all(at < now for at in self.edit_at.values())

    def _mark(self, module: nn.Module, number: int, kind: str, now: int) -> None:
        for variant, points in self.points.items():
            for target, edit in points:
                if target is module and edit.kind == kind and edit.call in (None, number):
                    self.edit_at[variant] = min(self.edit_at[variant], now)

    def replayable(self, variant: str, fell_back: Callable[[str], None]) -> list[Call]:
        """The outermost calls that ended before ``variant``'s edit point, unchanged since."""
        edit_at, found = self.edit_at.get(variant, self._clean), []
        pending = list(self.top)
        while pending:
            call = pending.pop(0)
            whole = call.end <= edit_at and not call.never and not call.counted_inside
            if whole and unchanged(call.versions):
                found.append(call)
                continue
            if whole:
                fell_back(
                    f"the inputs or output of a call of {type(call.module).__name__} before "
                    "the edit point were modified in place later in the clean forward: "
                    "such calls run for real"
                )
            if call.start < edit_at:
                pending[:0] = call.children
        return found


class Replaying:
    """While open, each module with calls to replay returns their clean outputs instead of
    computing them, call by call, where the call's arguments are the clean call's.

    With ``context`` (a forward recorded elsewhere, reused as the clean one): each call of
    ``outer`` (the recorded outermost calls, replayed or not) must find ``context()`` as it
    was recorded when it is called, and an argument compared by type only must be the very
    object the recorded call was given; else it runs for real (:attr:`differed`).

    ``last``: no later forward replays ``calls`` (or those of these ids): a private copy is
    returned itself (no one sees what this forward writes into it: arguments are compared
    with copies of their own); else each replay returns a copy of it."""

    def __init__(
        self,
        calls: list[Call],
        fell_back: Callable[[str], None],
        noted: Callable[[str], None],
        context: Callable[[], Any] | None = None,
        outer: list[Call] | None = None,
        last: bool | set[int] = False,
    ) -> None:
        self._last = last  # no forward replays these calls after this one: no fresh copies
        self._by_module: dict[int, dict[int, Call]] = {}
        self._outer: dict[int, dict[int, Call]] = {}
        self._modules: dict[int, nn.Module] = {}
        for found, where in ((calls, self._by_module), (outer or [], self._outer)):
            for call in found:
                where.setdefault(id(call.module), {})[call.number] = call
                self._modules[id(call.module)] = call.module
        self._fell_back, self._noted, self._context = fell_back, noted, context
        self._saved: dict[int, Any] = {}
        self.replayed = self.differed = 0  # calls replayed, calls that ran for real instead

    def __enter__(self) -> None:
        for key, module in self._modules.items():
            self._saved[key] = module.__dict__.get("forward")  # an instance's own forward
            module.forward = self._replay(module, self._by_module.get(key, {}))

    def __exit__(self, *exc_info: object) -> None:
        for key, module in self._modules.items():
            saved = self._saved.pop(key, None)
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved

    def _replay(self, module: nn.Module, calls: dict[int, Call]) -> Callable[..., Any]:
        own = self._saved[id(module)] or type(module).forward.__get__(module)
        count, outer, strict = [0], self._outer.get(id(module), {}), self._context is not None
        name = type(module).__name__

        def forward(*args: Any, **kwargs: Any) -> Any:
            number, count[0] = count[0], count[0] + 1
            first = outer.get(number)
            context = self._context
            if first is not None and context is not None and context() != first.context:
                self.differed += 1
                self._fell_back(
                    f"{name} was called in another context than in the recorded forward "
                    "(autocast, grad or inference mode, default dtype, TF32 or attention "
                    "backend flags, module modes, hooks or an open session's edits)"
                )
                return own(*args, **kwargs)
            call = calls.get(number)
            if call is not None:
                given = (call.args, call.kwargs)
                if same((args, kwargs), given, strict) and unchanged(call.versions):
                    if call.opaque is not None:
                        self._noted(
                            f"a call of {type(module).__name__} before the edit point was "
                            f"given a {call.opaque}: what it would write into it is not "
                            "written in a variant (a key/value cache a variant returns lacks "
                            "the layers before its edit point: do not decode from it; "
                            "use_cache=False avoids it)"
                        )
                    self.replayed += 1
                    last = self._last is True or id(call) in (self._last or ())
                    return _copied(call.output, call.copied and not last)  # containers anew
                self.differed += 1
                self._fell_back(
                    f"{name} was called with other arguments than in the recorded forward "
                    "(one that does not compare by value must be the very object it was "
                    "given), or what it returned there was modified in place since"
                    if strict
                    else f"a call of {name} before the edit point had other arguments than in "
                    "the clean forward (or its output was modified in place): such calls run "
                    "for real"
                )
            return own(*args, **kwargs)

        return forward


def _copied(value: Any, inference: bool = False) -> Any:
    """``value``'s containers copied (:func:`~lightning_iocatch.capture.snapshots.map_tensors`
    with the tensors themselves): what code after a call appends to is a copy; with
    ``inference``, its inference tensors copied too (they have no version counter)."""
    return map_tensors(value, _private if inference else _itself)


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _private(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_inference():
        return tensor
    with torch.inference_mode():  # a copy no one else holds, an inference tensor as given
        return tensor.clone()


def _storages(value: Any) -> set[int]:
    """Where the inference tensors of ``value`` lie (their storages' addresses)."""
    found = (
        t.untyped_storage().data_ptr() for _, t in flatten_value(value, "") if t.is_inference()
    )
    return {address for address in found if address}


def _holders(model: nn.Module, edited: set[int]) -> set[int]:
    """The ids of the modules of ``model`` that hold an edited module (strictly)."""
    index = dict(model.named_modules())  # each module by its first name, parents first
    found = {id(model)}
    for name, module in index.items():
        if name and id(module) in edited:
            parts = name.split(".")
            found.update(id(index[".".join(parts[:k])]) for k in range(1, len(parts)))
    return found


def _recorded(model: nn.Module, inside: set[int]) -> list[nn.Module]:
    """The modules whose calls a recording hooks: those of ``model`` itself, of the modules
    in ``inside`` (the edited modules and those that hold one) and of their children. A
    call inside any other module is replayed or run with it, never alone: a call there
    would be dropped when it ends (see :meth:`Recorder._ended`)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        if module is model or id(module) in inside:
            for child in module.children():
                found.setdefault(id(child), child)
    return list(found.values())


def _opaque(value: Any) -> str | None:
    """The type of the first object in ``value`` that is compared by type only."""
    if isinstance(value, (tuple, list)):
        return next((found for item in value if (found := _opaque(item))), None)
    if isinstance(value, dict):
        return next((found for item in value.values() if (found := _opaque(item))), None)
    if isinstance(value, (torch.Tensor, *_SIMPLE)) or type(value).__eq__ is not object.__eq__:
        return None
    return type(value).__name__


def _versions(value: Any) -> list[tuple[torch.Tensor, int | None]]:
    """Each tensor inside ``value`` with its version counter (``None``: an inference tensor,
    which has none)."""
    return [(t, None if t.is_inference() else t._version) for _, t in flatten_value(value, "")]


def unchanged(versions: list[tuple[torch.Tensor, int | None]]) -> bool:
    return all(v is None or t._version == v for t, v in versions)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two tensors of one shape, dtype and device; on the CPU through
    NumPy where it holds the dtype (the same elementwise ``==``: a NaN is unequal, -0.0 equals
    0.0), several times faster than ``torch.equal``'s loop."""
    plain = type(a) is torch.Tensor and type(b) is torch.Tensor and a.device.type == "cpu"
    plain = plain and a.dtype in _NUMPY and a.layout == b.layout == torch.strided
    if plain and not (a.is_neg() or b.is_neg() or a.is_nested or b.is_nested):
        return bool(np.array_equal(a.detach().numpy(), b.detach().numpy()))
    return bool(torch.equal(a, b))


def same(a: Any, b: Any, strict: bool = False) -> bool:
    """Whether ``a`` (a variant's argument) is the clean call's ``b``; see the module.
    ``strict``: an object that does not compare by value must be ``b`` itself, not one of
    its type (``a`` is given to a forward other than ``b``'s, which may differ)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a is b:
            return True
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and _equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y, strict) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], strict) for k in a)
    if isinstance(a, _SIMPLE) or a is b:
        return bool(a == b) or a is b
    try:
        equal = a == b
    except Exception:  # an object that cannot compare (it holds tensors): run for real
        return False
    by_value = isinstance(equal, bool) and type(a).__eq__ is not object.__eq__
    return equal if by_value else not strict  # else compared by type only
