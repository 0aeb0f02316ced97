"""Gradients as a capture kind: ``grad_outputs[m]`` and ``grad_inputs[m]`` of a spec.

A session that asks for the gradient of ``m``'s outputs (or inputs) hooks ``m`` as it asks
for its outputs (or inputs); in the forward the hook attaches each floating tensor of the
value to the autograd graph (one that is not in it yet, such as the first site of a
forward that began without gradients, becomes a leaf of its own, so no parameter needs
``requires_grad``) and registers a tensor hook on it. A backward that reaches the tensor
(``loss.backward()``, or ``torch.autograd.grad(loss, session.gradient_tensors())``, which
touches no parameter's ``.grad``) hands the hook its gradient. When the batch's captures
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
    ...         _ = torch.autograd.grad(loss, catcher.session.gradient_tensors())
    >>> hidden = net[0](x).detach().requires_grad_()
    >>> expected, = torch.autograd.grad(net[2](net[1](hidden)).sum(), hidden)
    >>> torch.allclose(buf["0"]["grad_outputs"][0], expected)
    True
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_iocatch.capture.snapshots import map_tensors
from lightning_iocatch.capture.transform import Kind
from lightning_iocatch.errors import CaptureError

__all__ = ["GRADIENT_KINDS", "GradientSites", "recording_gradients"]

GRADIENT_KINDS: tuple[Kind, Kind] = ("grad_inputs", "grad_outputs")
"""The kinds of a spec that capture gradients; ``grad_X`` is the gradient of kind ``X``."""

_state = threading.local()  # .recording: inside `recording_gradients` in this thread


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
        _state.recording = True
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
    tensors: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by place in `tensors`

    def receive(self, place: int, grad: torch.Tensor) -> None:
        held = self.grads.get(place)
        self.grads[place] = grad.detach() if held is None else held + grad.detach()

    def gradient(self) -> Any:
        """The value's structure with each hooked tensor's gradient (zeros if none came)."""
        places = {id(tensor): place for place, tensor in enumerate(self.tensors)}

        def swap(tensor: torch.Tensor) -> torch.Tensor | None:
            place = places.get(id(tensor))
            if place is None:
                return None  # not a floating tensor: it has no gradient
            grad = self.grads.get(place)
            return torch.zeros_like(tensor, requires_grad=False) if grad is None else grad

        return map_tensors(self.value, swap, _nothing)  # type: ignore[arg-type]


class GradientSites:
    """A session's gradient sites of the current batch, in the order their calls ran."""

    def __init__(self) -> None:
        self.sites: list[_Site] = []

    def attach(self, name: str, kind: Kind, value: Any) -> Any:
        """``value`` with every floating tensor in the graph and hooked; ``None`` when the
        forward may go on with ``value`` itself (every such tensor was in the graph)."""
        _check_recording(name, kind)
        site = _Site(name, kind, value)
        changed = False

        def hooked(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal changed
            if not tensor.is_floating_point() and not tensor.is_complex():
                return tensor
            if not tensor.requires_grad:  # outside the graph: a leaf of its own
                tensor, changed = tensor.detach().requires_grad_(True), True
            place = len(site.tensors)
            site.tensors.append(tensor)
            tensor.register_hook(lambda grad: site.receive(place, grad))
            return tensor

        attached = map_tensors(value, hooked)
        site.value = attached
        self.sites.append(site)
        return attached if changed else None

    def tensors(self) -> list[torch.Tensor]:
        """Every hooked tensor of the batch so far, for ``torch.autograd.grad``."""
        return [tensor for site in self.sites for tensor in site.tensors]

    def collect(self) -> list[tuple[str, Kind, Any]]:
        """Each call's ``(name, kind, gradient)``, in call order, and forget the sites.

        Sites no backward reached are left out, with a warning: the loss' backward never
        ran while the session was open (a site off the loss' path is reached as zeros
        when another site of the forward is reached)."""
        sites, self.sites = self.sites, []
        if not sites:
            return []
        if not any(site.grads for site in sites):
            names = sorted({f"{site.name}/{site.kind}" for site in sites})
            warnings.warn(
                f"no backward reached the gradients asked for ({', '.join(names)}): nothing "
                "is captured for them; call `loss.backward()` or `torch.autograd.grad(loss, "
                "session.gradient_tensors())` before the batch's captures are taken",
                stacklevel=3,
            )
            return []
        found = []
        for site in sites:
            gradient = site.gradient()
            if site.kind == "grad_inputs":  # as inputs are captured: {"args", "kwargs"}
                gradient = {"args": gradient[0], "kwargs": gradient[1]}
            found.append((site.name, site.kind, gradient))
        return found


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
        if not getattr(_state, "recording", False):
            raise CaptureError(
                f"the {kind} of {name!r} are asked for in a forward run without gradients "
                "(torch.no_grad): run it under torch.enable_grad(), or inside "
                "`with recording_gradients():`, which turns them on from the first "
                "gradient site"
            )
        torch.set_grad_enabled(True)  # restored as `recording_gradients` ends
