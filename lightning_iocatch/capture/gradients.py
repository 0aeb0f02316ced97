"""Gradients as a capture kind: ``grad_outputs[m]`` and ``grad_inputs[m]`` of a spec.

A session that asks for the gradient of ``m``'s outputs (or inputs) hooks ``m`` as it asks
for its outputs (or inputs); in the forward the hook hands the module (inputs) or its
caller (outputs) a copy of each floating tensor of the value, in the autograd graph
(from a leaf of its own where the tensor is not in the graph yet: at the first site of a
forward that began without gradients, so no parameter needs ``requires_grad``), and hooks
it. The gradient is so that of the value the module receives or hands on, through the
module or downstream of it only, as PyTorch's ``register_full_backward_hook`` gives it
and as an :class:`~lightning_iocatch.capture.edits.Edit` of the value would change it
(another use of the same tensor elsewhere, such as a residual connection outside the
module, is not counted). A backward that reaches the copies (``loss.backward()``, or
``torch.autograd.grad(loss, session.gradient_edges())``, which touches no parameter's
``.grad`` and gives each copy's gradient even where an in-place operation changed it
after) hands the hooks their gradients. When the batch's captures
are taken (:meth:`~lightning_iocatch.capture.session.CaptureSession.take`, or the session
closes), each call's gradient is captured like a value: the structure of the value
(tuple, mapping, ``{"args", "kwargs"}``) with each floating tensor replaced by its
gradient (zeros where the loss does not depend on it; leaves that are not floating
tensors are left out), through the batch's transform and the catcher's copy, under the
flat keys ``m/grad_outputs/...`` (:mod:`~lightning_iocatch.capture.keys`).

The gradient of a value is of the value the forward continues with: after the session's
edits of ``m``, before any later hook changes it. A gradient hook needs a forward that
records gradients; inside Lightning's evaluation loops (inference mode) run it under
:func:`recording_gradients`, which leaves inference mode and turns gradients on only
from the first gradient site of the forward on (nothing before it is recorded).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    >>> catcher = ModelIOCatcher(net, "cpu")
    >>> x = torch.randn(4, 2)
    >>> with catcher.from_spec("grad_outputs[0]") as buf:
    ...     with recording_gradients():
    ...         loss = net(x).sum()
    ...         _ = torch.autograd.grad(loss, catcher.session.gradient_edges())
    >>> hidden = net[0](x).detach().requires_grad_()
    >>> expected, = torch.autograd.grad(net[2](net[1](hidden)).sum(), hidden)
    >>> torch.allclose(buf["0"]["grad_outputs"][0], expected)
    True
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_iocatch.capture.sharded import Whole
from lightning_iocatch.capture.snapshots import _keep, _map, map_tensors
from lightning_iocatch.capture.transform import CaptureTransform, Kind, Site
from lightning_iocatch.errors import CaptureError

__all__ = ["GradientSites", "recording_gradients"]

Part = Callable[[Any], torch.Tensor]
"""Picks one tensor of a value as captures hold it (inputs: ``{"args", "kwargs"}``)."""

_state = threading.local()  # .recording: False, "armed" (inside `recording_gradients`), "on"
_TAKEN = torch.empty(0)  # a part's place once found: later places of its tensor stay


@contextmanager
def recording_gradients() -> Iterator[None]:
    """Run forwards (and their backward) whose gradients a session captures.

    Inference mode is left (tensors made here can be saved for backward) and gradients
    are off until a gradient hook of an open session turns them on, at the first gradient
    site of each forward: what runs before it records no graph. Both are restored as the
    block ends. A tensor made under inference mode (a batch moved to the GPU by
    Lightning's evaluation loop) cannot be saved for backward: clone it inside the block.

    Examples:
        >>> with torch.inference_mode():
        ...     with recording_gradients():
        ...         torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        (False, False)
    """
    before = getattr(_state, "recording", False)
    with torch.inference_mode(False), torch.no_grad():
        _state.recording = "armed"
        try:
            yield
        finally:
            _state.recording = before


@dataclass
class _Site:
    """One call's value at a gradient site: its tensors in the graph and their gradients."""

    name: str
    kind: Kind  # grad_inputs or grad_outputs
    value: Any  # the structure, with the tensors that were hooked
    single: bool = False  # one tensor picked of the value (a part): its gradient alone
    tensors: list[torch.Tensor] = field(default_factory=list)  # the copies handed on
    edges: list[GradientEdge] = field(default_factory=list)  # their places in the graph
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by place in `tensors`
    handles: list[Any] = field(default_factory=list)  # the tensor hooks, removed at the end
    versions: list[int] = field(default_factory=list)  # of the copies, as handed on
    transform: CaptureTransform | None = None  # the batch's, applied as a gradient arrives
    at: Site | None = None  # this call's site, for the transform
    changed: dict[int, bool] = field(default_factory=dict)  # by place: the transform's
    repeated: bool = False  # a place reached twice under a transform (not summable)
    wholes: dict[int, Whole] = field(default_factory=dict)  # by place: a shard made whole

    def release(self) -> None:
        """Remove the tensor hooks."""
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()

    def receive(self, place: int, grad: torch.Tensor) -> None:
        """Keep the gradient arriving at ``place``: through the batch's transform now, in
        the state of its own backward (a GradScaler's scale of that backward), so that the
        raw gradient is not held to the end of the batch. Without a transform, the
        gradients of several backwards reaching one place are summed."""
        whole = self.wholes.get(place)
        grad = (grad if whole is None else whole(grad)).detach()
        held = self.grads.get(place)
        if self.transform is None or self.at is None:
            self.grads[place] = grad if held is None else held + grad
        elif held is not None:  # a transform of the sum is not the sum of the transforms
            self.repeated = True
        else:
            self.grads[place], self.changed[place] = self._through(grad)

    def _through(self, grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
        assert self.transform is not None and self.at is not None  # callers check
        with torch.no_grad():
            replaced = self.transform.capture(grad, self.at)
        return (grad, False) if replaced is None else (replaced, True)

    def gradient(self) -> tuple[Any, list[bool] | None]:
        """The value's structure with each hooked tensor's gradient (zeros if none came;
        a part's gradient is one tensor), and, under a transform, whether it changed each
        of them, in the order of :func:`map_tensors`."""
        flags: list[bool] = []

        def of(place: int, like: torch.Tensor) -> torch.Tensor:
            grad = self.grads.get(place)
            if grad is not None:
                flags.append(self.changed.get(place, False))
                return grad
            zeros = torch.zeros_like(like, requires_grad=False).detach()
            whole = self.wholes.get(place)
            zeros = zeros if whole is None else whole(zeros)
            if self.transform is None or self.at is None:
                flags.append(False)
                return zeros
            zeros, changed = self._through(zeros)
            flags.append(changed)
            return zeros

        transformed = self.transform is not None and self.at is not None
        if self.single:
            return of(0, self.tensors[0]), flags if transformed else None
        places = {id(tensor): place for place, tensor in enumerate(self.tensors)}

        def swap(tensor: torch.Tensor) -> torch.Tensor | None:
            place = places.get(id(tensor))
            if place is None:
                return None  # not a floating tensor: it has no gradient
            return of(place, tensor)

        found = map_tensors(self.value, swap, _nothing)  # type: ignore[arg-type]
        return found, flags if transformed else None


class GradientSites:
    """A session's gradient sites of the current batch, in the order their calls ran."""

    def __init__(self) -> None:
        self.sites: list[_Site] = []

    def attach(
        self,
        name: str,
        kind: Kind,
        value: Any,
        part: Part | None = None,
        transform: CaptureTransform | None = None,
        calls: int = 0,
        whole: Callable[[torch.Tensor, str], Whole] | None = None,
        follow: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> Any:
        """``value`` with each of its floating tensors (only the one ``part`` picks of
        ``{"args", "kwargs"}`` or the output, if given) replaced by a copy in the graph,
        hooked, for the forward to go on with. ``transform`` (the batch's) is applied to
        each gradient as it arrives, at the site of this call (``calls``: the values of
        ``name``'s ``kind`` the buffer already holds). ``whole(tensor, path)``: how to
        make the gradient of a sharded tensor whole, applied first, and ``follow(tensor,
        copy)`` tells that the copy stands in the tensor's place (tensor parallelism:
        :mod:`~lightning_iocatch.capture.sharded`)."""
        try:
            _check_recording(name, kind)
        except CaptureError:
            self.clear()  # the error is the news: not also "no backward reached"
            raise
        target = None if part is None else part(_structured(kind, value))
        site = _Site(name, kind, value, single=part is not None, transform=transform)
        if transform is not None:
            calls += sum(1 for held in self.sites if (held.name, held.kind) == (name, kind))
            site.at = Site(name, kind, calls)

        def hooked(tensor: torch.Tensor, path: str) -> torch.Tensor:
            nonlocal target
            if part is not None:  # the part's place: its first place, as an edit finds it
                if tensor is not target:
                    return tensor
                target = _TAKEN
            if not tensor.is_floating_point() and not tensor.is_complex():
                return tensor
            if tensor.requires_grad:  # a copy for each place: each use its own gradient
                handed = tensor.clone()
            else:  # outside the graph: from a leaf of its own (a copy: no inference tensor)
                leaf = tensor.clone() if tensor.is_inference() else tensor.detach()
                handed = leaf.requires_grad_(True).clone()  # not a leaf: in-place ops work
            site.versions.append(handed._version)
            place = len(site.tensors)
            if whole is not None:
                site.wholes[place] = whole(tensor, path)
            if follow is not None:
                follow(tensor, handed)
            site.tensors.append(handed)
            site.edges.append(get_gradient_edge(handed))
            site.handles.append(handed.register_hook(_receiver(weakref.ref(site), place)))
            return handed

        attached = _map(value, hooked, _keep, "")
        if not site.tensors:
            self.clear()  # the error is the news: not also "no backward reached"
            raise _nothing_floating(name, kind, value)
        site.value = attached
        self.sites.append(site)
        return attached

    def check_unchanged(self, name: str) -> None:
        """After a call of ``name`` whose inputs' gradients are asked for: refuse a module
        that wrote into the copies it was given (a cache filled in place), whose caller
        would not see the writes."""
        site = next(
            (s for s in reversed(self.sites) if (s.name, s.kind) == (name, "grad_inputs")), None
        )
        if site is None:
            return
        for tensor, version in zip(site.tensors, site.versions, strict=True):
            if tensor._version != version:
                self.clear()  # the error is the news: not also "no backward reached"
                raise CaptureError(
                    f"{name!r} writes into an input in place (a cache filled in place?): "
                    "its inputs' gradients are taken at copies handed to it, so its writes "
                    "would not reach the caller; ask for the gradient of the outputs of the "
                    "module that computes that input instead"
                )

    def clear(self) -> None:
        """Forget the batch's sites without capturing them (its backward failed)."""
        sites, self.sites = self.sites, []
        for site in sites:
            site.release()

    def edges(self) -> list[GradientEdge]:
        """Where every hooked copy of the batch so far is in the graph, for
        ``torch.autograd.grad(loss, edges)``: the gradient of each as it was handed on,
        whatever in-place operation changed it after."""
        return [edge for site in self.sites for edge in site.edges]

    def collect(self) -> list[tuple[str, Kind, Any, list[bool] | None]]:
        """Each call's ``(name, kind, gradient, changed)``, in call order (``changed``:
        under a transform, which of the gradient's tensors it changed, in the order of
        :func:`map_tensors`), and forget the sites.

        Sites no backward reached are left out, with a warning: the loss' backward never
        ran while the session was open (a site off the loss' path is reached as zeros
        when another site of the forward is reached). Under a transform, a call that
        several backwards reached is left out with a warning: the transform of each
        gradient was taken as it arrived, and those cannot be summed."""
        sites, self.sites = self.sites, []
        for site in sites:
            site.release()
        if not sites:
            return []
        if not any(site.grads for site in sites):
            names = sorted({f"{site.name}/{site.kind}" for site in sites})
            warnings.warn(
                f"no backward reached the gradients asked for ({', '.join(names)}): nothing "
                "is captured for them; call `loss.backward()` or `torch.autograd.grad(loss, "
                "session.gradient_edges())` before the batch's captures are taken",
                stacklevel=3,
            )
            return []
        repeated = sorted({f"{site.name}/{site.kind}" for site in sites if site.repeated})
        if repeated:
            warnings.warn(
                f"the gradients of {', '.join(repeated)} were reached by several backwards of "
                "one forward (retain_graph=True) under a capture transform, which is applied "
                "to each gradient as it arrives and cannot be summed: nothing is captured "
                "for them; take the batch's captures between the backwards",
                stacklevel=3,
            )
        found = []
        for site in sites:
            if site.repeated:
                continue
            gradient, changed = site.gradient()
            if site.kind == "grad_inputs" and not site.single:  # as inputs: {"args", "kwargs"}
                gradient = {"args": gradient[0], "kwargs": gradient[1]}
            found.append((site.name, site.kind, gradient, changed))
        return found


def _receiver(site: weakref.ref[_Site], place: int) -> Callable[[torch.Tensor], None]:
    """The tensor hook of ``site``'s tensor at ``place``. It holds the site weakly: the
    site holds the tensor, and a tensor's hook that held it back would make a cycle through
    autograd that Python's collector cannot see (every forward's graph kept for good)."""

    def receive(grad: torch.Tensor) -> None:
        found = site()
        if found is not None:
            found.receive(place, grad)

    return receive


def _structured(kind: Kind, value: Any) -> Any:
    """A hook's value as captures hold it: inputs as ``{"args", "kwargs"}``."""
    if kind == "grad_inputs":
        return {"args": value[0], "kwargs": value[1]}
    return value


def _nothing_floating(name: str, kind: Kind, value: Any) -> CaptureError:
    """The refusal of a site whose value holds no floating tensor (an embedding's token
    ids): it has no gradient, and would be captured as nothing (or ``None``)."""
    dtypes: list[str] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        return tensor

    map_tensors(value, note)
    held = f"{', '.join(dict.fromkeys(dtypes))} tensors only" if dtypes else "no tensor"
    if kind == "grad_inputs":
        said = f"its input holds {held} (token ids?)"
        instead = f"ask for 'grad_outputs[{name}]' (the gradient of what it makes of them)"
        return CaptureError(
            f"{name!r} has no floating input, so its inputs have no gradient: {said}; "
            f"{instead}, or leave {name!r} out of grad_inputs[...]"
        )
    return CaptureError(
        f"{name!r} has no floating output, so its outputs have no gradient: its output "
        f"holds {held}; ask for the gradient of a module whose output is floating, or "
        f"leave {name!r} out of grad_outputs[...]"
    )


def _nothing(obj: Any) -> None:
    """What a gradient holds in place of an object that is not a tensor: nothing."""
    return None


def _check_recording(name: str, kind: Kind) -> None:
    """Turn gradients on at the first site under :func:`recording_gradients`; else a
    forward that cannot record the graph is refused, naming the fix."""
    if torch.is_inference_mode_enabled():
        raise CaptureError(
            f"the {kind} of {name!r} are asked for in a forward under inference mode, which "
            "records no gradient: run the forward and its backward inside "
            "`with recording_gradients():` (lightning_iocatch.capture), or with "
            "torch.inference_mode(False) and torch.enable_grad()"
        )
    if not torch.is_grad_enabled():
        recording = getattr(_state, "recording", False)
        if recording == "on":
            raise CaptureError(
                f"the {kind} of {name!r} are asked for where the model turned gradients off "
                "again after an earlier gradient site (a torch.no_grad region in the model, "
                "or reentrant activation checkpointing: checkpoint with use_reentrant=False): "
                "its gradient would be cut off from the loss"
            )
        if not recording:
            raise CaptureError(
                f"the {kind} of {name!r} are asked for in a forward run without gradients "
                "(torch.no_grad, or inside reentrant activation checkpointing, which runs "
                "its forward without them: checkpoint with use_reentrant=False): run it "
                "under torch.enable_grad(), or inside `with recording_gradients():`, which "
                "turns them on from the first gradient site"
            )
        torch.set_grad_enabled(True)  # restored as `recording_gradients` ends
        _state.recording = "on"
