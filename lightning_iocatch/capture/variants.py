"""Variants: one batch's clean forward and its forward under each set of edits, sharing the
computation that comes before the first edit.

:class:`Variants` runs a forward once clean, recording every module call of the model, then
once per variant in a session with that variant's edits. A variant's edits first take effect
at one module call (its *edit point*: the start of the call for an edit of inputs, its end
for an edit of outputs). Every module call that ended before that point is *replayed*: the
module's forward is swapped, for the variant's forward only, for one that returns the clean
run's output of that call, so the variant computes only what follows the edit point (and
the code between modules, such as adding embeddings, which is cheap). For an edit of block
6 of a 12-block model, a variant costs the last blocks and the head.

Replaying is exact when:

1. every module is in eval mode (a module in training mode may draw random numbers, such
   as dropout: then every variant runs its whole forward, said once in a warning);
2. what a module computes depends only on its inputs and its parameters, not on state
   carried between forwards;
3. the modules before the edit point affect the rest only through what they return, not
   by side effects read later (a key/value cache written in a forward that starts without
   one is such a side effect that nothing reads: attention reads the keys of its own layer).

Each replayed call is checked before it is replayed: its tensor arguments must be equal
(``torch.equal``, or the very tensor not modified since) to the clean call's, its other
arguments equal, or, for objects that do not compare by value (a cache object), of the same
type. A call that differs runs for real (once said in a warning), so a variant never sees
a clean output its own inputs did not produce. With ``share=False`` every variant runs its
whole forward.

Other sessions open on the model (or a module of it) are set aside while the forwards run
(:meth:`~lightning_iocatch.capture.coordinator.ForwardCoordinator.apart`): their hooks
neither capture these forwards nor edit them. The forwards run under ``torch.no_grad()``
outside inference mode, so that a replayed
output modified in place by the code after it is detected (its version counter changes)
and not replayed again.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher, Zero
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).eval()
    >>> variants = Variants(ModelIOCatcher(net, "cpu"), {"zero": [Zero("1")]})
    >>> x = torch.ones(4, 2)
    >>> out = variants(lambda: net(x))
    >>> torch.equal(out["clean"], net(x)), torch.equal(out["zero"], net[2].bias.expand(4, 1))
    (True, True)
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Edit

__all__ = ["CLEAN", "Variants"]

CLEAN = "clean"
_SIMPLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


@dataclass(eq=False)
class _Call:
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
    children: list[_Call] = field(default_factory=list)
    counted_inside: bool = False  # a module edited at one call (`call=`) ran inside it
    opaque: str | None = None  # the type of an argument compared by type only


class _Recorder:
    """Hooks on every module of a model that record its calls during one clean forward,
    and the edit point of each variant."""

    def __init__(self, model: nn.Module, points: dict[str, list[tuple[nn.Module, Edit]]]):
        self.points = points
        self.edit_at: dict[str, float] = dict.fromkeys(points, math.inf)
        self.top: list[_Call] = []
        self._stack: list[tuple[int, _Call | None]] = []  # (the module's call number, call)
        self._counts: dict[int, int] = {}
        self._counted = {  # modules whose calls an edit counts (`call=`): never inside a replay
            id(module)
            for found in points.values()
            for module, edit in found
            if edit.call is not None
        }
        self._events = 0
        self._handles = []
        for name, module in model.named_modules():
            if name:
                self._handles.append(
                    module.register_forward_pre_hook(self._started, with_kwargs=True)
                )
                # first among the forward hooks: the output as forward returned it (other
                # hooks run on a replayed output again), and also when forward raises
                hook = module.register_forward_hook(self._ended, prepend=True, always_call=True)
                self._handles.append(hook)

    def remove(self) -> None:
        for handle in self._handles:
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
        if all(at < math.inf for at in self.edit_at.values()):
            self._stack.append((number, None))  # after every edit point: nothing to replay
            return
        given_args, given_kwargs = _copied((args, kwargs))  # as given, not as appended to
        versions = _versions((given_args, given_kwargs))
        call = _Call(module, number, now, given_args, given_kwargs, versions=versions)
        call.opaque = _opaque((args, kwargs))
        parent = self._stack[-1][1] if self._stack else None
        (parent.children if parent is not None else self.top).append(call)
        self._stack.append((number, call))

    def _ended(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        number, call = self._stack.pop() if self._stack else (0, None)
        now = self._tick()
        if call is not None:
            call.end, call.output = now, _copied(output)
            call.versions += _versions(output)
            if output is None:
                call.end = math.inf  # it raised (or returned nothing): never replayed
            inside = any(call.start < at <= now for at in self.edit_at.values())
            if not inside and not call.counted_inside:
                call.children = []  # replayed whole wherever it is replayed
        self._mark(module, number, "outputs", now)

    def _mark(self, module: nn.Module, number: int, kind: str, now: int) -> None:
        for variant, points in self.points.items():
            for target, edit in points:
                if target is module and edit.kind == kind and edit.call in (None, number):
                    self.edit_at[variant] = min(self.edit_at[variant], now)

    def replayable(self, variant: str, fell_back: Callable[[str], None]) -> list[_Call]:
        """The outermost calls that ended before ``variant``'s edit point, unchanged since."""
        edit_at, found = self.edit_at[variant], []
        pending = list(self.top)
        while pending:
            call = pending.pop(0)
            if call.end <= edit_at and _unchanged(call.versions) and not call.counted_inside:
                found.append(call)
                continue
            if call.end <= edit_at:
                fell_back(
                    f"the inputs or output of a call of {type(call.module).__name__} before "
                    "the edit point were modified in place later in the clean forward: "
                    "such calls run for real"
                )
            if call.start < edit_at:
                pending[:0] = call.children
        return found


class Variants:
    """Runs a forward clean and under each variant's edits; see the module's docstring.

    Args:
        catcher: the catcher of the model the edits name modules of (its sessions apply
            them; another session must not be open on it).
        variants: name -> the edits of that variant (``"clean"`` is reserved).
        share: replay the clean forward's calls before each variant's edit point.

    Calling it with a function that runs the forward (``lambda: model(batch)``) returns
    ``{"clean": output, name: output, ...}``. :attr:`fallbacks` says why a forward or a
    call ran whole where it could have been replayed, :attr:`notes` what a variant's output
    lacks (each also said once in a warning).
    """

    def __init__(
        self,
        catcher: ModelIOCatcher,
        variants: Mapping[str, Sequence[Edit]],
        share: bool = True,
    ) -> None:
        if not variants:
            raise ValueError("`variants` is empty: give at least one name -> edits")
        if CLEAN in variants:
            raise ValueError(f"{CLEAN!r} names the unedited forward: call a variant otherwise")
        for name, edits in variants.items():
            if not isinstance(name, str) or not edits:
                raise ValueError(f"variant {name!r} must be named by a string and have edits")
            catcher(edits=edits)  # checks the edits and their names, opens nothing
        catcher._requested = None
        self.catcher = catcher
        self.variants = {name: list(edits) for name, edits in variants.items()}
        self.share = share
        self.fallbacks: list[str] = []
        self.notes: list[str] = []
        index = catcher._modules()
        self._points = {
            name: [(index[edit.module], edit) for edit in edits]
            for name, edits in self.variants.items()
        }

    def __call__(
        self, forward: Callable[[], Any], indices: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """``{"clean": forward(), name: forward() under the variant's edits, ...}``;
        ``indices``: the batch's dataset indices, for edits that need them
        (:meth:`~lightning_iocatch.capture.edits.Edit.for_batch`)."""
        coordinator = self.catcher.coordinator
        with torch.inference_mode(False), torch.no_grad(), coordinator.apart(self.catcher.root):
            reason = self._why_not_shared() if self.share else None
            if reason is not None:
                self._fell_back(reason)
            if not self.share or reason is not None:
                outputs = {CLEAN: forward()}
                for name in self.variants:
                    outputs[name] = self._variant(name, forward, indices, [])
                return outputs
            recorder = _Recorder(self.catcher.model, self._points)
            try:
                outputs = {CLEAN: forward()}
            finally:
                recorder.remove()
            for name in self.variants:
                replayed = recorder.replayable(name, self._fell_back)
                outputs[name] = self._variant(name, forward, indices, replayed)
            return outputs

    def _variant(
        self,
        name: str,
        forward: Callable[[], Any],
        indices: Sequence[int] | None,
        replayed: list[_Call],
    ) -> Any:
        session = self.catcher(edits=self.variants[name])
        with _Replaying(replayed, self._fell_back, self._noted), session:
            session.set_batch_indices(indices)
            return forward()

    def _why_not_shared(self) -> str | None:
        training = [name for name, m in self.catcher.model.named_modules() if m.training]
        if training:
            return (
                f"module {training[0] or 'the model'!r} is in training mode (it may draw "
                "random numbers): every variant runs its whole forward; call model.eval()"
            )
        if any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in self._all()):
            return "the model has torch.compile'd parts: every variant runs its whole forward"
        return None

    def _all(self) -> list[nn.Module]:
        return [self.catcher.root, *self.catcher.model.modules()]

    def _fell_back(self, reason: str) -> None:
        if reason not in self.fallbacks:
            self.fallbacks.append(reason)
            warnings.warn(f"Variants: {reason}", stacklevel=3)

    def _noted(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)
            warnings.warn(f"Variants: {note}", stacklevel=3)


class _Replaying:
    """While open, each module with calls to replay returns their clean outputs instead of
    computing them, call by call, where the call's arguments are the clean call's."""

    def __init__(
        self, calls: list[_Call], fell_back: Callable[[str], None], noted: Callable[[str], None]
    ) -> None:
        self._by_module: dict[int, dict[int, _Call]] = {}
        self._modules: dict[int, nn.Module] = {}
        for call in calls:
            self._by_module.setdefault(id(call.module), {})[call.number] = call
            self._modules[id(call.module)] = call.module
        self._fell_back, self._noted = fell_back, noted
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> None:
        for key, module in self._modules.items():
            self._saved[key] = module.__dict__.get("forward")  # an instance's own forward
            module.forward = self._replay(module, self._by_module[key])

    def __exit__(self, *exc_info: object) -> None:
        for key, module in self._modules.items():
            saved = self._saved.pop(key, None)
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved

    def _replay(self, module: nn.Module, calls: dict[int, _Call]) -> Callable[..., Any]:
        own = self._saved[id(module)] or type(module).forward.__get__(module)
        count = [0]

        def forward(*args: Any, **kwargs: Any) -> Any:
            number, count[0] = count[0], count[0] + 1
            call = calls.get(number)
            if call is not None:
                if _same((args, kwargs), (call.args, call.kwargs)) and _unchanged(call.versions):
                    if call.opaque is not None:
                        self._noted(
                            f"a call of {type(module).__name__} before the edit point was "
                            f"given a {call.opaque}: what it would write into it is not "
                            "written in a variant (a key/value cache a variant returns lacks "
                            "the layers before its edit point: do not decode from it; "
                            "use_cache=False avoids it)"
                        )
                    return _copied(call.output)  # containers anew: code after may append
                self._fell_back(
                    f"a call of {type(module).__name__} before the edit point had other "
                    "arguments than in the clean forward (or its output was modified in "
                    "place): such calls run for real"
                )
            return own(*args, **kwargs)

        return forward


def _copied(value: Any) -> Any:
    """``value``'s containers (tuples, lists, dicts, model outputs) copied, down to the
    tensors and other objects, which are the same."""
    if isinstance(value, list):
        return [_copied(item) for item in value]
    if isinstance(value, tuple):
        items = [_copied(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if type(value) is dict:
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, dict):  # a dict subclass, such as Hugging Face's ModelOutput
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _copied(item)
        return copied
    return value


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
    found: list[tuple[torch.Tensor, int | None]] = []
    _walk(value, lambda t: found.append((t, None if t.is_inference() else t._version)))
    return found


def _unchanged(versions: list[tuple[torch.Tensor, int | None]]) -> bool:
    return all(v is None or t._version == v for t, v in versions)


def _walk(value: Any, visit: Callable[[torch.Tensor], None]) -> None:
    if isinstance(value, torch.Tensor):
        visit(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _walk(item, visit)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, visit)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` (a variant's argument) is the clean call's ``b``; see the module."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a is b:
            return True
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, _SIMPLE) or a is b:
        return bool(a == b) or a is b
    try:
        equal = a == b
    except Exception:  # an object that cannot compare: judged by its type
        return True
    return equal if isinstance(equal, bool) and type(a).__eq__ is not object.__eq__ else True
