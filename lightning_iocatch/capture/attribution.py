"""Attribution patching (AtP): a first-order estimate of every component's patching effect.

Patching a component ``a`` (a module's output or input) of one run with its value in the
other run changes a metric ``M`` by about ``(a_patched - a) . dM/da``, the gradient taken
on the run that is patched. One forward of each run and one backward give the estimate
for every component and position at once, where exact patching needs a forward each.
Two conventions are in use; they differ in which run is patched, not by a sign:

- ``"denoising"`` (TransformerLens' ``attribution_patch``): the corrupted run takes the
  clean value, ``(a_clean - a_corrupted) . dM/da`` on the corrupted run. It asks *which
  components are enough to restore the behaviour*.
- ``"noising"`` (Kramar et al. 2024, AtP*): the clean run takes the corrupted value,
  ``(a_corrupted - a_clean) . dM/da`` on the clean run. It asks *which components the
  behaviour needs*.

The product is summed over the value's last dimension only: a ``[batch, seq, d]`` value
gives a score per sample and position, a ``[batch, seq, heads, d_head]`` one (such as
TransformerLens' ``hook_z``) a score per head as well; ``heads={name: n}`` splits the last
dimension of a module's value into ``n`` heads first (a Hugging Face attention's output
projection, whose input is the heads side by side). A component is the value an
:class:`~lightning_iocatch.capture.edits.Edit` of the module would edit (an output's
first tensor; an input's first positional argument, or first tensor keyword), so that
:func:`exact_patching` patches exactly what was estimated.

``run(batch)`` runs the model's forward on ``batch`` and returns the metric per sample
(shape ``[batch]``); the backward is taken of its sum, so that each sample's scores are
those of its own metric whatever the batch size. The forwards run apart from the other
sessions open on the model (they neither capture nor edit them); nothing changes a
parameter's ``.grad`` or ``requires_grad``, and only the gradients of the batch in flight
are held.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> clean, corrupted = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    >>> run = lambda x: net(x).sum(dim=(1, 2))  # one metric per sample
    >>> found = attribution_patching(net, "outputs[0]", run, clean, corrupted)
    >>> found.scores["denoising"]["0/outputs"].shape  # [batch, positions]
    torch.Size([2, 5])
    >>> exact = exact_patching(net, "0/outputs", run, clean, corrupted)
    >>> bool(torch.allclose(exact, run(clean) - run(corrupted)))  # all of `0`: all of it
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Patch
from lightning_iocatch.capture.gradients import recording_gradients
from lightning_iocatch.capture.snapshots import _keep, _map
from lightning_iocatch.capture.spec import CaptureSpec, resolve_names
from lightning_iocatch.capture.transform import Kind

__all__ = [
    "CONVENTIONS",
    "RUNS",
    "Attribution",
    "Component",
    "attribution_patching",
    "components",
    "exact_patching",
    "patched_metric",
]

CONVENTIONS = ("denoising", "noising")
"""The two conventions of attribution patching: which run is patched."""

Metric = Callable[[Any], torch.Tensor]
RUNS = {"denoising": ("corrupted", "clean"), "noising": ("clean", "corrupted")}
"""Each convention's ``(base, source)``: the run patched, and the run its values come from."""


@dataclass(frozen=True)
class Component:
    """A place to patch: a module's ``"outputs"`` or ``"inputs"``, its last dimension
    split into ``heads`` (``None``: not split)."""

    module: str
    kind: Kind
    heads: int | None = None

    @property
    def key(self) -> str:
        """``"{module}/{kind}"``, the name its scores go by."""
        return f"{self.module}/{self.kind}"

    def value(self, captured: Any) -> torch.Tensor:
        """The tensor an :class:`~lightning_iocatch.capture.edits.Edit` of it would edit."""
        if self.kind == "outputs":
            found = captured if isinstance(captured, torch.Tensor) else _first(captured)
        else:
            args, kwargs = captured["args"], captured["kwargs"]
            tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            found = args[0] if args else (tensors[0] if tensors else None)
        if not isinstance(found, torch.Tensor) or not found.is_floating_point():
            what = "first tensor output" if self.kind == "outputs" else "first input"
            here = (
                f"a {str(found.dtype).removeprefix('torch.')} tensor (token ids?)"
                if isinstance(found, torch.Tensor)
                else type(found).__name__
            )
            raise ValueError(  # not a TypeError: nothing is wrong with how the model is called
                f"{self.key}: the value patched is the module's {what}, which here is "
                f"{here}, not a floating tensor: it has no gradient to score; name a module "
                f"whose {self.kind} is a floating tensor (for an embedding: its outputs)"
            )
        return found

    def product(self, source: torch.Tensor, base: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``(source - base) . grad`` over the last dimension (of each head), computed in
        float32 at least (the difference too: two bf16 values' is not a bf16 value)."""
        wide = torch.promote_types(base.dtype, torch.float32)
        delta, grad = source.to(wide) - base.to(wide), grad.to(wide)
        if self.heads is not None:
            if delta.shape[-1] % self.heads:
                raise ValueError(
                    f"{self.key} has a last dimension of {delta.shape[-1]}, which "
                    f"heads={self.heads} does not divide"
                )
            shape = (*delta.shape[:-1], self.heads, delta.shape[-1] // self.heads)
            delta, grad = delta.reshape(shape), grad.reshape(shape)
        return (delta * grad).sum(-1)


def _first(captured: Any) -> Any:
    if isinstance(captured, (tuple, list)) and captured:
        return captured[0]
    return captured


def components(
    model: nn.Module, spec: str | CaptureSpec, heads: Mapping[str, int] | None = None
) -> list[Component]:
    """The components of a spec's ``outputs[...]`` and ``inputs[...]`` (names or globs of
    ``model``'s modules); ``heads`` maps names or globs to a number of heads.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 4))
        >>> [c.key for c in components(net, "outputs[*]|inputs[1]", heads={"1": 2})]
        ['0/outputs', '1/outputs', '1/inputs']
    """
    parsed = spec if isinstance(spec, CaptureSpec) else CaptureSpec.parse(spec)
    if parsed.has_gradients or not (parsed.inputs or parsed.outputs):
        raise ValueError(
            f"components {parsed.to_string()!r}: give the values to patch as "
            "'outputs[...]' and/or 'inputs[...]' (their gradients are taken for you)"
        )
    available = ModelIOCatcher(model, None).module_names
    split: dict[str, int] = {}
    for pattern, count in (heads or {}).items():
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"heads[{pattern!r}] must be a positive integer, got {count!r}")
        for name in resolve_names([pattern], available):
            split[name] = count
    places: list[tuple[Kind, tuple[str, ...]]] = [
        ("outputs", parsed.outputs),
        ("inputs", parsed.inputs),
    ]
    return [
        Component(name, kind, split.get(name))
        for kind, names in places
        for name in resolve_names(names, available)
    ]


@dataclass
class Attribution:
    """One batch's attribution: ``scores[convention][key]`` per sample (``[batch, ...]``,
    float32 or wider), the metric per sample of each run (``metric["clean"]``,
    ``metric["corrupted"]``) and each component's value in each run (``values[run][key]``,
    for :func:`patched_metric`)."""

    scores: dict[str, dict[str, torch.Tensor]]
    metric: dict[str, torch.Tensor]
    values: dict[str, dict[str, torch.Tensor]]


def attribution_patching(
    model: nn.Module,
    spec: str | CaptureSpec | Sequence[Component],
    run: Metric,
    clean: Any,
    corrupted: Any,
    conventions: str | Sequence[str] = "denoising",
    heads: Mapping[str, int] | None = None,
) -> Attribution:
    """The attribution patching estimate of every component of ``spec``, per sample and
    position, for each of ``conventions`` (see the module's docstring): one forward of
    each run, and one backward of each run whose gradient a convention needs."""
    wanted = _conventions(conventions)
    _check_pair(clean, corrupted)
    places = list(spec) if isinstance(spec, Sequence) and not isinstance(spec, str) else None
    found = places if places is not None else components(model, spec, heads)  # type: ignore[arg-type]
    needs = {"clean": "noising" in wanted, "corrupted": "denoising" in wanted}
    values: dict[str, dict[str, torch.Tensor]] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    metric: dict[str, torch.Tensor] = {}
    catcher = ModelIOCatcher(model, None)
    with catcher.coordinator.apart(catcher.root):
        for which, batch in (("clean", clean), ("corrupted", corrupted)):
            values[which], grads[which], metric[which] = _pass(
                catcher, found, run, batch, needs[which]
            )
    for component in found:
        _check_value_shapes(component.key, values["clean"], values["corrupted"])
    scores: dict[str, dict[str, torch.Tensor]] = {}
    for convention in wanted:
        base, source = RUNS[convention]
        scores[convention] = {}
        for component in found:
            key = component.key
            scores[convention][key] = component.product(
                values[source][key], values[base][key], grads[base][key]
            )
    return Attribution(scores, metric, values)


def exact_patching(
    model: nn.Module,
    component: str | Component,
    run: Metric,
    clean: Any,
    corrupted: Any,
    convention: str = "denoising",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The metric's change per sample when ``component`` (``"{module}/{kind}"``) is
    patched: denoising, ``M(corrupted, with its clean value) - M(corrupted)``; noising,
    ``M(clean, with its corrupted value) - M(clean)``. ``positions``: a boolean mask over
    the value's leading dimensions (``[batch, seq]``) restricting the patch."""
    (convention,) = _conventions(convention)
    _check_pair(clean, corrupted)
    place = component if isinstance(component, Component) else _component(component)
    base, source = (corrupted, clean) if convention == "denoising" else (clean, corrupted)
    catcher = ModelIOCatcher(model, None)
    with catcher.coordinator.apart(catcher.root), torch.no_grad():
        value = _pass(catcher, [place], run, source, False)[0][place.key]
        before = run(base)
        return patched_metric(catcher, place, run, base, value, positions) - before


def patched_metric(
    catcher: ModelIOCatcher,
    component: Component,
    run: Metric,
    batch: Any,
    value: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``run(batch)`` with ``component`` set to ``value`` (where ``positions`` says)."""
    edit = Patch(component.module, value, kind=component.kind, positions=positions)
    with catcher(edits=[edit]), torch.no_grad():
        return run(batch)


def _pass(
    catcher: ModelIOCatcher, found: Sequence[Component], run: Metric, batch: Any, grad: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """One forward of ``batch``: each component's value, its gradient (if ``grad``) and
    the metric per sample."""
    ask: dict[str, list[str]] = {"inputs": [], "outputs": []}
    for component in found:
        ask[component.kind].append(component.module)
    grad_ask = {f"grad_{kind}": names for kind, names in ask.items()} if grad else {}
    parts = {(c.module, c.kind): c.value for c in found}  # only what an edit would patch
    session = catcher(**ask, **grad_ask, parts=parts)  # type: ignore[arg-type]
    with session, recording_gradients():
        try:
            metric = run(batch)
            if grad:
                _check_metric(metric)
                torch.autograd.grad(metric.sum(), session.gradient_edges(), allow_unused=True)
        except BaseException:
            session.discard_gradients()  # the failure is said: not also its gradients
            raise
        captured = session.take()
    values = {c.key: _one_call(captured, c, c.kind) for c in found}
    grads = {}
    if grad:
        for c in found:
            grads[c.key] = _one_call(captured, c, f"grad_{c.kind}")
    return values, grads, metric.detach()


def _check_pair(clean: Any, corrupted: Any) -> None:
    """Refuse a clean and a corrupted batch whose tensors differ in shape (or in where
    they are): each component is compared position by position in the two runs, and a
    batch of one row would be broadcast against the other's rows without a word.

    Examples:
        >>> _check_pair({"ids": torch.zeros(2, 5)}, {"ids": torch.ones(2, 5)})
        >>> try:
        ...     _check_pair({"ids": torch.zeros(2, 5)}, {"ids": torch.ones(1, 5)})
        ... except ValueError as error:
        ...     print(str(error).split(". ")[0])
        the clean and corrupted batches differ in shape (ids: clean (2, 5), corrupted (1, 5))
    """
    shapes = {"clean": _shapes(clean), "corrupted": _shapes(corrupted)}
    if shapes["clean"] == shapes["corrupted"]:
        return
    paths = dict.fromkeys([*shapes["clean"], *shapes["corrupted"]])
    differ = [p for p in paths if shapes["clean"].get(p) != shapes["corrupted"].get(p)]
    said = "; ".join(
        f"{path.lstrip('/') or 'the batch'}: clean {_said(shapes['clean'].get(path))}, "
        f"corrupted {_said(shapes['corrupted'].get(path))}"
        for path in differ
    )
    raise ValueError(
        f"the clean and corrupted batches differ in shape ({said}). Attribution patching "
        "compares each component's values in the two runs sample by sample and position "
        "by position: give a corrupted batch of the clean batch's shape (as many samples, "
        "padded to as many tokens)"
    )


def _shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in ``batch``, by its path (``"/input_ids"``)."""
    found: dict[str, tuple[int, ...]] = {}

    def keep(tensor: torch.Tensor, path: str) -> torch.Tensor:
        found[path] = tuple(tensor.shape)
        return tensor

    _map(batch, keep, _keep, "")
    return found


def _said(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(shape)


def _check_value_shapes(
    key: str, clean: Mapping[str, torch.Tensor], corrupted: Mapping[str, torch.Tensor]
) -> None:
    """Refuse a component whose values in the two runs differ in shape (broadcast, else)."""
    ours, theirs = tuple(clean[key].shape), tuple(corrupted[key].shape)
    if ours != theirs:
        raise ValueError(
            f"{key} has values of other shapes in the two runs (clean {ours}, corrupted "
            f"{theirs}): attribution patching compares them position by position; make "
            "`run` give both runs values of one shape"
        )


def _one_call(captured: Any, component: Component, kind: str) -> torch.Tensor:
    calls = captured[component.module][kind]
    if len(calls) == 1:
        return calls[0]
    if not calls and kind.startswith("grad_"):
        raise ValueError(f"no gradient reached {component.key}: the metric does not depend on it")
    raise ValueError(
        f"{component.module!r} ran {len(calls)} times in the forward: a component is one "
        "call of a module; name a module that runs once (e.g. each layer, not a shared one)"
    )


def _check_metric(metric: Any) -> None:
    if not isinstance(metric, torch.Tensor) or metric.dim() != 1:
        shape = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
        raise ValueError(
            f"`run(batch)` must return the metric per sample, a tensor of shape [batch]; got "
            f"{shape}"
        )
    if not metric.requires_grad:
        raise ValueError(
            "`run(batch)` returned a metric that does not depend on the components' "
            "gradients (it has no grad_fn): compute it from the forward's output, without "
            "torch.no_grad or .detach()"
        )


def _conventions(conventions: str | Sequence[str]) -> list[str]:
    wanted = [conventions] if isinstance(conventions, str) else list(conventions)
    unknown = [c for c in wanted if c not in CONVENTIONS]
    if unknown or not wanted:
        raise ValueError(f"conventions must be among {CONVENTIONS}, got {conventions!r}")
    return list(dict.fromkeys(wanted))


def _component(key: str) -> Component:
    module, _, kind = key.rpartition("/")
    if kind not in ("inputs", "outputs"):
        raise ValueError(
            f"a component is named '{{module}}/outputs' or '{{module}}/inputs', got {key!r}"
        )
    return Component(module, kind)  # type: ignore[arg-type]
