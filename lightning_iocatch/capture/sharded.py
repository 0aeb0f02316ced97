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
- any other plain tensor of a tensor-parallel model: at its first call, checked to be the
  same on every rank of the mesh (a replicated value is whole). A value that differs is a
  shard whose layout cannot be known (a hand-written tensor-parallel layer): refused,
  naming the module and the ``shard_layouts`` entry to give. Never stored as a shard.

Edits (:meth:`ShardedValues.edit`) apply to the whole value, which is then cut back to the
form the forward continues with (the same DTensor placements, or the same local shard).

Gathers are collectives of the mesh: every rank of a tensor-parallel group makes the same
ones in the same order, as its forward does. A model without parallel styles and without
``shard_layouts`` gets no :class:`ShardedValues` (:meth:`ShardedValues.of` returns
``None``): nothing here runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_iocatch.capture.snapshots import _map
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


def is_elementwise(module: Any) -> bool:
    """Whether ``module``'s output is sharded exactly as its one input: torch's
    :data:`ELEMENTWISE` modules and Hugging Face's activations (``transformers.activations``)."""
    kind = type(module)
    hugging_face = kind.__module__ == "transformers.activations"
    return isinstance(module, ELEMENTWISE) or (
        hugging_face and kind.__name__ in _HUGGING_FACE_ELEMENTWISE
    )


Whole = Callable[[torch.Tensor], torch.Tensor]
Restore = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """How a local tensor lies on the tensor-parallel mesh: its ``placement``, and for a
    ``Shard`` the whole value's size along that dimension where it is known (a column-split
    ``Linear``'s ``out_features``): then each rank's part follows torch's chunking and one
    gather makes it whole; else the parts' sizes are gathered first."""

    placement: Any
    size: int | None = None

    @property
    def whole(self) -> bool:
        return bool(self.placement.is_replicate())


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (without importing it where it is not)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "placements")


class ShardedValues:
    """Whole values of one tensor-parallel model (see the module docstring).

    Args:
        model: the model, parallelized (its styles are read from its hooks).
        modules: the session's modules by name (the sites it hooks).
        shard_layouts: placements the user gives for values no style declares, by
            ``"{inputs|outputs}[{name}]"`` (every tensor of that value).
    """

    def __init__(
        self, model: nn.Module, modules: Mapping[str, nn.Module], shard_layouts: Mapping[str, Any]
    ) -> None:
        self.mesh = tensor_parallel_mesh(model.modules())
        self.modules = dict(modules)
        self.given = dict(shard_layouts)
        self._styles = {name: style_layouts(module) for name, module in model.named_modules()}
        self._names = {id(module): name for name, module in model.named_modules()}
        self._model = model
        self._modules = dict(model.named_modules())
        self._produced: dict[int, tuple[weakref.ref[torch.Tensor], Layout]] = {}
        self._elementwise_input: dict[str, Layout | None] = {}  # name -> its input's layout
        self._replicated: set[tuple[str, str, str]] = set()  # sites checked to be whole

    @classmethod
    def of(
        cls,
        model: nn.Module,
        modules: Mapping[str, nn.Module],
        shard_layouts: Mapping[str, Any] | None = None,
        every: Iterable[nn.Module] | None = None,
    ) -> ShardedValues | None:
        """A :class:`ShardedValues` for ``model`` if it is tensor-parallel (or layouts are
        given), else ``None``. ``every``: the model's modules, where the caller has them."""
        if tensor_parallel_mesh(model.modules() if every is None else every) is None:
            if shard_layouts:
                raise CaptureError(
                    f"`shard_layouts` {dict(shard_layouts)} given, but the model has no "
                    "tensor-parallel style (parallelize_module): its values are whole; "
                    "leave `shard_layouts` out"
                )
            return None
        return cls(model, modules, shard_layouts or {})

    # Hooks that follow local shards through a forward

    def register_tracking(self) -> list[RemovableHandle]:
        """Hooks after every parallel style's (the local tensors it hands on, with their
        placements) and on elementwise modules (their outputs keep their input's). Call
        before a session registers its captures; remove the handles when it closes."""
        handles: list[RemovableHandle] = []
        for module in self._model.modules():
            name = self._names[id(module)]
            if self._styles.get(name) is not None:
                handles.append(module.register_forward_pre_hook(self._track_inputs(name)))
                handles.append(module.register_forward_hook(self._track_outputs(name)))
            elif is_elementwise(module):
                handles.append(module.register_forward_pre_hook(self._elementwise_in(name)))
                handles.append(module.register_forward_hook(self._elementwise_out(name)))
        return handles

    def _remember(self, tensor: Any, layout: Layout | None) -> None:
        if isinstance(tensor, torch.Tensor) and not is_dtensor(tensor) and layout is not None:
            self._produced[id(tensor)] = (weakref.ref(tensor), layout)
        self._produced = {k: v for k, v in self._produced.items() if v[0]() is not None}

    def _declared(self, name: str, view: View, place: Place) -> Layout | None:
        """The layout ``name``'s parallel style declared for ``place`` in ``view``."""
        styles: StyleLayouts | None = self._styles.get(name)
        placement = styles.placement(view, place) if styles is not None else None
        if placement is None:
            return None
        return Layout(placement, _declared_size(self._modules[name], place, placement))

    def produced(self, tensor: torch.Tensor) -> Layout | None:
        """The layout of a local tensor a style (or an elementwise module after one)
        handed on in this forward, or ``None``."""
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

    def whole(self, name: str, kind: str, value: Any, view: View) -> Any:
        """``value`` (of ``name``'s ``kind``, as a hook of ``view`` sees it) with every
        sharded tensor made whole; inputs as ``{"args", "kwargs"}`` or ``(args, kwargs)``."""
        return _map(value, lambda t, path: self._whole(name, kind, view, t, path), _keep, "")

    def gatherer(self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str) -> Whole:
        """How to make ``tensor`` (at ``path`` of ``name``'s ``kind``) whole: a function of
        it, or of a tensor of the same layout (its gradient)."""
        if is_dtensor(tensor):
            return _full
        layout = self._layout(name, kind, view, tensor, path)
        if layout is None or layout.whole:
            return _same
        return lambda local: _gather(local, self.mesh, layout)

    def edit(self, name: str, kind: str, value: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn`` applied to the whole ``value`` (a raw view: before the style's hooks), each
        edited tensor cut back to the form of the one it replaces."""
        restore: dict[str, Restore] = {}

        def whole_one(tensor: torch.Tensor, path: str) -> torch.Tensor:
            if is_dtensor(tensor):
                restore[path] = _as_dtensor_like(tensor)
                return _full(tensor)
            layout = self._layout(name, kind, "raw", tensor, path)
            if layout is None or layout.whole:
                return tensor
            restore[path] = _local_like(tensor, self.mesh, layout)
            return _gather(tensor, self.mesh, layout)

        whole = _map(value, whole_one, _keep, "")
        edited = fn(whole)
        if edited is whole:
            return value
        return _map(edited, lambda t, path: restore.get(path, _same)(t), _keep, "")

    def _whole(self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str) -> Any:
        return self.gatherer(name, kind, view, tensor, path)(tensor)

    def _layout(
        self, name: str, kind: str, view: View, tensor: torch.Tensor, path: str
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
        if base == "outputs" and is_elementwise(self.modules.get(name)):
            inherited = self._elementwise_input.get(name)
            if inherited is not None:
                return inherited
        produced = self.produced(tensor)
        if produced is not None:
            return produced
        self._check_replicated(name, kind, path, tensor)
        return None

    def _check_replicated(self, name: str, kind: str, path: str, tensor: torch.Tensor) -> None:
        """At a site's first call: every rank of the mesh must hold the same value."""
        site = (name, kind, path)
        if site in self._replicated or tensor.is_complex():
            return
        group = self.mesh.get_group()
        mine = _fingerprint(tensor)
        every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(every, mine, group=group)
        if not all(torch.equal(mine, other) for other in every):
            key = f"{kind.removeprefix('grad_')}[{name}]"
            raise CaptureError(
                f"{kind}{path} of {name!r} differs between the ranks of the tensor-parallel "
                "mesh: it is a local shard whose layout no parallel style declares (a "
                "hand-written tensor-parallel layer?), and would be stored as a fragment; "
                "give its placement, e.g. shard_layouts={"
                f"{key!r}: Shard(-1)}} (torch.distributed.tensor.Shard/Replicate/Partial), "
                "or capture a module whose parallel style declares it"
            )
        self._replicated.add(site)


def _keep(obj: Any) -> Any:
    return obj


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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor()  # type: ignore[attr-defined]
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor
    return wait() if callable(wait) else full


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A value's shape and sums in float64, equal on two ranks that hold the same value."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 97 + 1
    shape = torch.zeros(9, dtype=torch.float64, device=flat.device)
    shape[0] = tensor.dim()
    shape[1 : 1 + min(tensor.dim(), 8)] = torch.tensor(tensor.shape[:8], dtype=torch.float64)
    sums = torch.stack([flat.nansum(), (flat * weights).nansum(), flat.isnan().sum()])
    return torch.cat([shape, sums])


def _declared_size(module: nn.Module, place: Place, placement: Any) -> int | None:
    """The whole size along a style's ``Shard(-1)`` where the module tells it: a
    ``Linear``'s ``out_features`` (output) or ``in_features`` (input), an ``Embedding``'s
    ``embedding_dim`` (output)."""
    if not placement.is_shard() or placement.dim != -1:
        return None
    if isinstance(module, nn.Linear):
        return module.out_features if place == ("output", 0) else module.in_features
    if isinstance(module, nn.Embedding) and place == ("output", 0):
        return module.embedding_dim
    return None


def _sizes(local: torch.Tensor, dim: int, mesh: Any, layout: Layout) -> list[int]:
    """Each rank's size along ``dim``: by torch's chunking of the whole size where it is
    known (as the module's weight was split), else gathered."""
    ranks = mesh.size()
    if layout.size is not None:
        chunk = -(-layout.size // ranks)
        return [max(0, min(chunk, layout.size - r * chunk)) for r in range(ranks)]
    size = torch.tensor([local.shape[dim]], device=local.device)
    every = [torch.empty_like(size) for _ in range(ranks)]
    torch.distributed.all_gather(every, size, group=mesh.get_group())
    return [int(s) for s in every]


def _gather(local: torch.Tensor, mesh: Any, layout: Layout) -> torch.Tensor:
    """The whole value of a local tensor of ``layout`` on the 1-D ``mesh``, through
    DTensor's collectives (autograd follows them: an edit's gradient reaches the shards)."""
    from torch.distributed.tensor import DTensor

    placement = layout.placement
    if placement.is_partial():
        return _full(DTensor.from_local(local, mesh, [placement], run_check=False))
    dim = placement.dim % local.dim()
    sizes = _sizes(local, dim, mesh, layout)  # shards may be uneven (a sequence split)
    if sizes[mesh.get_local_rank()] != local.shape[dim]:
        raise CaptureError(
            f"a local shard of {local.shape[dim]} along dimension {dim} where its layout "
            f"({placement}, whole size {layout.size}) gives this rank {sizes}: the parallel "
            "style and the module disagree"
        )
    largest = max(sizes)
    padded = local
    if local.shape[dim] < largest:
        pad = list(local.shape)
        pad[dim] = largest - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=dim)
    shard = type(placement)(dim)
    every = _full(DTensor.from_local(padded.contiguous(), mesh, [shard], run_check=False))
    parts = every.split(largest, dim=dim)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes, strict=True)], dim)


def _local_like(local: torch.Tensor, mesh: Any, layout: Layout) -> Restore:
    """Cut a whole value back to this rank's part, as ``local`` is of its whole."""
    placement = layout.placement
    if placement.is_partial():  # a sum's part: this rank's share is the whole on rank 0
        first = mesh.get_local_rank() == 0
        return lambda whole: whole if first else torch.zeros_like(whole)
    dim = placement.dim % local.dim()
    sizes = _sizes(local, dim, mesh, layout)
    start = sum(sizes[: mesh.get_local_rank()])
    return lambda whole: whole.narrow(dim, start, sizes[mesh.get_local_rank()]).contiguous()


def _as_dtensor_like(tensor: Any) -> Restore:
    """Cut a whole value back to a DTensor of ``tensor``'s mesh and placements (a
    ``Partial`` one becomes ``Replicate``: the same value, held whole), in a way autograd
    follows (a replicated DTensor redistributed: each rank keeps its part)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = tensor.device_mesh
    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
    replicated = [Replicate()] * len(placements)

    def restore(whole: torch.Tensor) -> torch.Tensor:
        held = DTensor.from_local(whole, mesh, replicated, run_check=False)
        return held.redistribute(mesh, placements)

    return restore


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
