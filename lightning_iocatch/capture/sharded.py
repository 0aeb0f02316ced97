"""Whole values from sharded ones: the one place a tensor-parallel value is made whole.

Under tensor parallelism a hook may see a module's value as a DTensor (of any placement:
``Shard``, ``Replicate``, ``Partial``) or as this rank's local shard of it (a style with
``use_local_output=True``). Every consumer of a capture (memory, the writer, probes,
gradients, edits) must see the whole value of the rank's samples, as the unsharded model
computes it. :class:`ShardedValues` turns what a hook sees into that whole value, on the
value's device, before anything else reads it:

- a DTensor: its ``full_tensor()`` (a gather, or a sum of ``Partial`` values);
- a local tensor whose placement is known: gathered on the tensor-parallel mesh. A
  placement is known where a parallel style declared it (:mod:`.tp_layouts`), where the
  tensor came out of such a style's hooks in the same forward, where an elementwise
  module (``ReLU``, ``GELU``, ``SiLU``, ``Dropout``, ...) passes such a tensor on (its
  output is sharded as its input), or where the user gave it (``shard_layouts``);
- any other plain tensor of a tensor-parallel model: at the first batch, for each call,
  checked to be the same on every rank of the mesh (a replicated value is whole). A value
  that differs is a shard whose layout cannot be known (a hand-written tensor-parallel
  layer): refused, naming the module and the ``shard_layouts`` entry to give. Never
  stored as a shard.

Edits (:meth:`ShardedValues.edit`) apply to the whole value, which is then cut back to the
form the forward continues with (the same DTensor placements, or the same local shard,
whose layout what follows keeps). The collectives are in :mod:`.shard_gather`; a DTensor
captured from a model without parallel styles is made whole by the copy itself
(:mod:`.snapshots`).

Gathers are collectives of the mesh: every rank of a tensor-parallel group makes the same
ones in the same order, as its forward does. A model without parallel styles and without
``shard_layouts`` gets no :class:`ShardedValues` (:meth:`ShardedValues.of` returns
``None``): nothing here runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.capture.shard_gather import (
    Layout,
    Restore,
    as_dtensor_like,
    check_sizes,
    chunk_sizes,
    declared_size,
    fingerprint,
    full_value,
    gather,
    gather_sizes,
    is_dtensor,
    local_like,
)
from lightning_iocatch.capture.snapshots import _keep, _map
from lightning_iocatch.capture.tp_layouts import (
    Place,
    StyleLayouts,
    View,
    style_layouts,
    tensor_parallel_mesh,
)
from lightning_iocatch.errors import CaptureError

__all__ = [
    "ELEMENTWISE",
    "Layout",
    "ShardedValues",
    "Whole",
    "checked_shard_layouts",
    "is_dtensor",
    "is_elementwise",
]

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.CELU, nn.SELU, nn.Mish, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Dropout, nn.Identity,
)  # fmt: skip
"""Modules whose output is sharded exactly as their input (elementwise on one tensor)."""

_HUGGING_FACE_ELEMENTWISE = frozenset(
    {
        "SiLUActivation", "GELUActivation", "NewGELUActivation", "GELUTanh", "FastGELUActivation",
        "QuickGELUActivation", "PytorchGELUTanh", "AccurateGELUActivation", "MishActivation",
        "ReLUSquaredActivation", "LaplaceActivation", "LinearActivation", "ClippedGELUActivation",
    }
)  # fmt: skip


Whole = Callable[[torch.Tensor], torch.Tensor]
"""Makes a tensor (or a gradient of one) whole."""


def is_elementwise(module: Any) -> bool:
    """Whether ``module``'s output is sharded exactly as its one input: torch's
    :data:`ELEMENTWISE` modules (exactly these classes: a subclass may compute otherwise)
    and Hugging Face's activations (``transformers.activations``)."""
    kind = type(module)
    hugging_face = kind.__module__ == "transformers.activations"
    return kind in ELEMENTWISE or (hugging_face and kind.__name__ in _HUGGING_FACE_ELEMENTWISE)


class ShardedValues:
    """Whole values of one tensor-parallel model (see the module docstring).

    Args:
        model: the model, parallelized (its styles are read from its hooks).
        mesh: its tensor-parallel mesh (:func:`~.tp_layouts.tensor_parallel_mesh`).
        shard_layouts: placements the user gives for values no style declares, by
            ``"{inputs|outputs}[{name}]"`` (every tensor of that value).
    """

    def __init__(self, model: nn.Module, mesh: Any, shard_layouts: Mapping[str, Any]) -> None:
        self.mesh = mesh
        self.given = dict(shard_layouts)
        self._by_name = dict(model.named_modules())
        self._styles = {name: style_layouts(module) for name, module in self._by_name.items()}
        self._produced: dict[int, tuple[weakref.ref[torch.Tensor], Layout]] = {}
        self._elementwise_input: dict[str, Layout | None] = {}  # name -> its input's layout
        self._replicated: set[tuple[str, str, str, int]] = set()  # calls checked whole
        self._sizes_checked: set[tuple[str, str, str, str]] = set()  # declared sizes checked

    @classmethod
    def of(
        cls,
        model: nn.Module,
        shard_layouts: Mapping[str, Any] | None = None,
        every: Iterable[nn.Module] | None = None,
    ) -> ShardedValues | None:
        """A :class:`ShardedValues` for ``model`` if it is tensor-parallel, else ``None``.
        ``every``: the model's modules, where the caller has them.

        Raises:
            CaptureError: ``shard_layouts`` given for a model with no parallel style.
        """
        mesh = tensor_parallel_mesh(model.modules() if every is None else every)
        if mesh is None:
            if shard_layouts:
                raise CaptureError(
                    f"`shard_layouts` {dict(shard_layouts)} given, but the model has no "
                    "tensor-parallel style (parallelize_module, or Hugging Face's plan): "
                    "its values are whole as each process holds them; leave it out"
                )
            return None
        return cls(model, mesh, shard_layouts or {})

    # Hooks that follow local shards through a forward

    def register_tracking(self) -> list[RemovableHandle]:
        """Hooks after every parallel style's (the local tensors it hands on, with their
        layouts) and on elementwise modules (their outputs keep their input's). Call
        before a session registers its captures; remove the handles when it closes."""
        handles: list[RemovableHandle] = []
        for name, module in self._by_name.items():
            if self._styles.get(name) is not None:
                handles.append(module.register_forward_pre_hook(self._track_inputs(name)))
                handles.append(module.register_forward_hook(self._track_outputs(name)))
            elif is_elementwise(module):
                handles.append(module.register_forward_pre_hook(self._elementwise_in(name)))
                handles.append(module.register_forward_hook(self._elementwise_out(name)))
        return handles

    def _remember(self, tensor: Any, layout: Layout | None) -> None:
        """Note ``tensor``'s layout while it lives (its entry goes with it: an id is reused
        only after the tensor's weak references are called back)."""
        if isinstance(tensor, torch.Tensor) and not is_dtensor(tensor) and layout is not None:
            key, produced = id(tensor), self._produced
            produced[key] = (weakref.ref(tensor, lambda _: produced.pop(key, None)), layout)

    def follow(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` (handed on in ``old``'s place: a gradient site's copy) lies as ``old``."""
        self._remember(new, self.produced(old))

    def _declared(self, name: str, view: View, place: Place) -> Layout | None:
        """The layout ``name``'s parallel style declared for ``place`` in ``view``."""
        styles: StyleLayouts | None = self._styles.get(name)
        placement = styles.placement(view, place) if styles is not None else None
        if placement is None:
            return None
        return Layout(placement, declared_size(self._by_name[name], place, placement))

    def produced(self, tensor: torch.Tensor) -> Layout | None:
        """The layout of a local tensor a style (or an elementwise module after one, or an
        edit) handed on in this forward, or ``None``."""
        found = self._produced.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def _track_inputs(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            for i, arg in enumerate(args):
                self._remember(arg, self._declared(name, "prepared", ("args", i)))

        return hook

    def _track_outputs(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            outputs = output if isinstance(output, tuple) else (output,)
            for i, value in enumerate(outputs):
                self._remember(value, self._declared(name, "prepared", ("output", i)))

        return hook

    def _elementwise_in(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            first = args[0] if args else None
            layout = self.produced(first) if isinstance(first, torch.Tensor) else None
            self._elementwise_input[name] = layout

        return hook

    def _elementwise_out(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self._remember(output, self._elementwise_input.get(name))

        return hook

    # Whole values

    def whole(self, name: str, kind: str, value: Any, view: View, call: int) -> Any:
        """``value`` (of ``name``'s ``kind`` at its ``call``, as a hook of ``view`` sees it)
        with every sharded tensor made whole; inputs as ``{"args", "kwargs"}`` or
        ``(args, kwargs)``."""

        def one(tensor: torch.Tensor, path: str) -> torch.Tensor:
            return self.gatherer(name, kind, view, tensor, path, call)(tensor)

        return _map(value, one, _keep, "")

    def gatherer(
        self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str, call: int
    ) -> Whole:
        """How to make ``tensor`` (at ``path`` of ``name``'s ``kind``) whole: a function of
        it, or of a tensor of the same layout (its gradient: a ``Partial`` value's part has
        the whole value's gradient)."""
        if is_dtensor(tensor):
            return full_value  # a gradient's DTensor carries its own placement
        found = self._parts(name, kind, view, tensor, path, call)
        if found is None or (found[0].placement.is_partial() and kind.startswith("grad_")):
            return _same
        layout, sizes = found
        return lambda local: gather(local, self.mesh, layout, sizes)

    def _parts(
        self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str, call: int
    ) -> tuple[Layout, list[int]] | None:
        """The layout of a local ``tensor`` and its parts' sizes along the sharded dimension
        (none for a ``Partial``), or ``None`` for a whole one (see :meth:`_layout`)."""
        layout = self._layout(name, kind, view, tensor, path, call)
        if layout is None or layout.whole:
            return None
        if layout.placement.is_partial():
            return layout, []
        dim = layout.placement.dim % tensor.dim()
        return layout, self._sizes(name, kind, view, path, tensor, dim, layout)

    def edit(self, name: str, kind: str, value: Any, fn: Callable[[Any], Any], call: int) -> Any:
        """``fn`` applied to the whole ``value`` (a raw view: before the style's hooks), each
        edited tensor cut back to the form of the one it replaces (and a local part keeps
        its layout for what follows)."""
        restore: dict[str, tuple[Restore, Layout | None]] = {}

        def whole_one(tensor: torch.Tensor, path: str) -> torch.Tensor:
            if is_dtensor(tensor):
                restore[path] = (as_dtensor_like(tensor), None)
                return full_value(tensor)
            found = self._parts(name, kind, "raw", tensor, path, call)
            if found is None:
                return tensor
            layout, sizes = found
            if layout.placement.is_partial():
                raise CaptureError(
                    f"an edit of {kind}{path} of {name!r}: a local part of a sum "
                    f"({layout.placement}) has no part of an edited value to hand on; edit "
                    "the module after the sum, or keep the value a DTensor "
                    "(use_local_output=False)"
                )
            restore[path] = (local_like(tensor, self.mesh, layout, sizes), layout)
            return gather(tensor, self.mesh, layout, sizes)

        whole = _map(value, whole_one, _keep, "")
        edited = fn(whole)
        if edited is whole:
            return value

        def back(tensor: torch.Tensor, path: str) -> torch.Tensor:
            cut, layout = restore.get(path, (_same, None))
            part = cut(tensor)
            self._remember(part, layout)
            return part

        return _map(edited, back, _keep, "")

    def _layout(
        self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str, call: int
    ) -> Layout | None:
        """The layout of a local ``tensor``, or ``None`` for a whole one; refuses a value
        that differs between the ranks of the mesh with no known placement."""
        base = kind.removeprefix("grad_")
        given = self.given.get(f"{base}[{name}]")
        if given is not None:
            return Layout(given)
        place = _place(base, path)
        declared = None if place is None else self._declared(name, view, place)
        if declared is not None:
            return declared
        if base == "outputs" and is_elementwise(self._by_name.get(name)):
            inherited = self._elementwise_input.get(name)
            if inherited is not None:
                return inherited
        produced = self.produced(tensor)
        if produced is not None:
            return produced
        self._check_replicated(name, kind, path, call, tensor)
        return None

    def _sizes(
        self, name: str, kind: str, view: View, path: str, local: torch.Tensor, dim: int,
        layout: Layout,
    ) -> list[int]:  # fmt: skip
        """The parts' sizes along ``dim``: gathered, except where the module declares the
        whole size (then checked against torch's chunking once per place, on every rank
        alike, and taken from that rule after)."""
        if layout.size is None:
            return gather_sizes(local, dim, self.mesh)
        place = (name, kind, view, path)
        if place not in self._sizes_checked:
            check_sizes(gather_sizes(local, dim, self.mesh), layout, f"{kind}{path} of {name!r}")
            self._sizes_checked.add(place)
        return chunk_sizes(layout.size, self.mesh.size())

    def _check_replicated(
        self, name: str, kind: str, path: str, call: int, tensor: torch.Tensor
    ) -> None:
        """At the first batch, for each call: every rank of the mesh holds the same value."""
        site = (name, kind, path, call)
        if site in self._replicated:
            return
        group = self.mesh.get_group()
        mine = fingerprint(tensor)
        every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(every, mine, group=group)
        if not all(torch.equal(mine, other) for other in every):
            key = f"{kind.removeprefix('grad_')}[{name}]"
            raise CaptureError(
                f"{kind}{path} of {name!r} (call {call}) differs between the ranks of the "
                "tensor-parallel mesh: it is a local shard whose layout no parallel style "
                "declares (a hand-written tensor-parallel layer?), and would be stored as a "
                "fragment; give its placement, e.g. shard_layouts={"
                f"{key!r}: Shard(-1)}} (torch.distributed.tensor.Shard/Replicate/Partial), "
                "or capture a module whose parallel style declares it"
            )
        self._replicated.add(site)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _place(base: str, path: str) -> Place | None:
    """A tensor's path in a captured value as a style's place (``None``: deeper)."""
    parts = path.split("/")[1:]
    if base == "outputs":
        if not parts:
            return ("output", 0)
        return ("output", int(parts[0])) if len(parts) == 1 and parts[0].isdigit() else None
    if len(parts) != 2:
        return None
    group, key = parts
    if group in ("args", "0") and key.isdigit():
        return ("args", int(key))
    return ("kwargs", key) if group in ("kwargs", "1") else None


def checked_shard_layouts(layouts: Mapping[str, Any] | None) -> dict[str, Any]:
    """``shard_layouts`` as given, or a clear error: keys ``"inputs[name]"`` or
    ``"outputs[name]"``, values DTensor placements (``Shard(-1)``, ``Replicate()``, ...)."""
    if layouts is None:
        return {}
    if not isinstance(layouts, Mapping):
        raise TypeError(f"`shard_layouts` must be a mapping, got {type(layouts).__name__}")
    for key, placement in layouts.items():
        kind, _, rest = str(key).partition("[")
        if kind not in ("inputs", "outputs") or not rest.endswith("]") or len(rest) < 2:
            raise ValueError(
                f"`shard_layouts` key {key!r} must name a value as the spec does: "
                "'outputs[model.layers.0.mlp.act]' or 'inputs[...]' (one module's exact name)"
            )
        if not all(hasattr(placement, a) for a in ("is_shard", "is_replicate", "is_partial")):
            raise TypeError(
                f"`shard_layouts[{key!r}]` must be a DTensor placement "
                "(torch.distributed.tensor.Shard(dim), Replicate() or Partial()), "
                f"got {placement!r}"
            )
    return dict(layouts)
