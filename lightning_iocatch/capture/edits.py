"""Edits: change a named module's output (or input) inside a capture session's forward.

An :class:`Edit` says where (a module, its ``"outputs"`` or ``"inputs"``, which value of a
tuple output or which argument, which call, which token positions) and how: zero or mean
ablation (a given mean, or a running estimate), adding a steering vector, patching in other
activations (given, another sample of the same batch, or each sample's row of a store:
:mod:`~lightning_iocatch.capture.store_patch`), or replacing the value by a function of it
(a sparse autoencoder's reconstruction, optionally keeping its error term). A session
applies its edits in its hooks, which return the edited value: the forward continues with
it, exactly as a hand-written forward hook (or pre-hook) returning that value would. Edits
exist only while the session is open (its hooks are removed on close, on exceptions too).

**What a capture sees**: a session's edit hooks run before every other hook of the module,
so every capture of it, by any session, reads the value after the edits: the value the
forward continues with (capture the module's inputs for what it computed from). Edits of
two sessions on one module compose, the later-opened session's first. Activation
checkpointing recomputes a forward during backward: the same edits apply there, so that
gradients are those of the edited forward. A session whose edits were never applied in
the forwards of its model (the module never ran, or not at the call asked for) warns as it
closes. Not detected: a model compiled outside the catcher's model before the session
opened, whose compiled code does not see hooks added later (nor the model's own forward).

**Rounding**: ``Steer`` adds in float32 (or the value's dtype, if wider) and rounds once to
the value's dtype, as ``(h.float() + alpha * v.float()).to(h.dtype)`` does; ``Mean``,
``RunningMean``, ``Patch`` and ``Replace`` give values of the value's dtype and shape.

**Per batch**: an edit that depends on the batch's samples (patching each sample with its
row of a store: :class:`~lightning_iocatch.capture.store_patch.StorePatch`) becomes a
concrete edit for each batch through :meth:`Edit.for_batch`, given the batch's dataset
indices; every other edit is its own concrete edit.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch.capture import ModelIOCatcher
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> catcher = ModelIOCatcher(net, "cpu")
    >>> with catcher(outputs=["0"], edits=[Zero("0")]) as buf:
    ...     out = net(torch.ones(4, 2))
    >>> bool((buf["0"]["outputs"][0] == 0).all()), torch.allclose(out, net[2].bias.expand(4, 1))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_iocatch.capture.transform import Kind
from lightning_iocatch.fingerprint import describe_function, describe_tensor

__all__ = [
    "Edit",
    "Mean",
    "Patch",
    "PatchWithin",
    "Replace",
    "RunningMean",
    "Steer",
    "Zero",
    "apply_edits",
]


class Edit:
    """Where an edit applies; subclasses say how (:meth:`edit`).

    Args:
        module: the module's name (exact, as ``ModelIOCatcher`` resolves names).
        kind: ``"outputs"`` (a forward hook's value) or ``"inputs"`` (a pre-hook's).
        call: which call of the module (0 first) since the catcher's model (for
            ``IOCaptureCallback``: the LightningModule, ``self(...)``) last started a forward,
            or a batch started, whichever came last; ``None``: every call.
        argument: outputs: the place of the tensor in a tuple output (default 0; a tensor
            output is itself); inputs: a positional index or a keyword's name (default: the
            first positional argument, or else the first tensor keyword argument).
        positions: a boolean mask over the value's leading dimensions (``[batch, seq]``
            for a language model's ``[batch, seq, d]``): only those places are edited.
    """

    def __init__(
        self,
        module: str,
        *,
        kind: Kind = "outputs",
        call: int | None = None,
        argument: int | str | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        if kind not in ("inputs", "outputs"):
            raise ValueError(f"`kind` must be 'inputs' or 'outputs', got {kind!r}")
        if positions is not None and positions.dtype != torch.bool:
            raise TypeError(f"`positions` must be a boolean mask, got {positions.dtype}")
        self.module, self.kind, self.call = module, kind, call
        self.argument, self.positions = argument, positions

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r}, kind={self.kind!r}, call={self.call})"

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        """The edited value (everywhere; :meth:`apply` keeps ``positions``)."""
        raise NotImplementedError

    def for_batch(self, indices: Sequence[int] | None) -> Edit:
        """The edit to apply to a batch whose samples have the dataset ``indices`` (in
        batch order; ``None``: unknown): this edit itself, unless it depends on the samples
        (see :class:`~lightning_iocatch.capture.store_patch.StorePatch`). A session asks it
        through :meth:`CaptureSession.set_batch_indices
        <lightning_iocatch.capture.session.CaptureSession.set_batch_indices>`;
        ``IOCaptureCallback`` does so at every batch start."""
        return self

    def describe(self) -> dict[str, Any]:
        """What this edit is, as JSON (a store records the edits its rows were captured
        under): its kind and place, each tensor by shape, dtype and a digest of its bytes,
        each function or module by what it computes
        (:func:`~lightning_iocatch.fingerprint.describe_function`: code, closure values,
        arguments, weights; or its own ``__fingerprint__``). Attributes named ``_...``
        (state that changes as the edit runs) are not part of it."""
        described: dict[str, Any] = {"edit": type(self).__name__}
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                value = describe_tensor(value)
            elif callable(value) or isinstance(value, torch.nn.Module):
                value = describe_function(value)
            described[name] = value
        return described

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` edited where ``positions`` says (everywhere without it)."""
        mask = self._mask(value)
        edited = self.edit(value)
        if mask is None:
            return edited
        mask = mask.reshape(*mask.shape, *([1] * (value.dim() - mask.dim())))
        return torch.where(mask, edited, value)

    def _fitting(self, name: str, given: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``given`` if it broadcasts to ``value``'s shape (and leaves it unchanged)."""
        shape = tuple(value.shape)
        try:
            fits = torch.broadcast_shapes(given.shape, value.shape) == value.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"{self!r}: its `{name}` of shape {tuple(given.shape)} does not fit "
                f"{self.module!r}'s {self.kind} of shape {shape}: give a `{name}` of shape "
                f"{shape[-1:]} (the value's last dimension), or one that broadcasts to {shape}"
            )
        return given

    def _mask(self, value: torch.Tensor) -> torch.Tensor | None:
        """``positions`` on ``value``'s device, once it fits its leading dimensions."""
        if self.positions is None:
            return None
        mask = self.positions.to(value.device)
        if tuple(mask.shape) != tuple(value.shape[: mask.dim()]):
            raise ValueError(
                f"`positions` of shape {tuple(mask.shape)} do not fit {self.module!r}'s "
                f"{self.kind} of shape {tuple(value.shape)}: give a mask over its leading "
                "dimensions"
            )
        return mask


class Zero(Edit):
    """Zero ablation: the value becomes zeros."""

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(value)


class Mean(Edit):
    """Mean ablation: the value becomes ``mean`` (broadcast over the leading dimensions)."""

    def __init__(self, module: str, mean: torch.Tensor, **where: Any) -> None:
        super().__init__(module, **where)
        self.mean = mean

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        mean = self._fitting("mean", self.mean, value)
        return mean.to(device=value.device, dtype=value.dtype).expand_as(value).clone()


class RunningMean(Edit):
    """Mean ablation with the mean estimated as it goes: the value becomes the mean of every
    value this edit has seen so far, the current one included.

    What it averages: the values as they reach this edit (before it changes them; after any
    edit listed before it on the same module), at the places it edits: with ``positions``
    (a mask over the leading ``k`` dimensions), the selected places, and the mean has the
    shape of the remaining dimensions ``value.shape[k:]`` (e.g. ``[d]`` for a
    ``[batch, seq, d]`` value with a ``[batch, seq]`` mask); without ``positions``, every
    sample (the first dimension), and the mean has the shape ``value.shape[1:]``. Values of
    calls it does not apply to (``call=``) are not seen. The sum and count are kept in
    float64 from the first operation, on the value's device; the edited value is
    ``(sum / count)`` rounded once to the value's dtype.

    So the first batch is replaced by its own mean, and batch ``n`` by the mean over
    batches ``1..n``. The estimate lasts as long as the edit object, across sessions and
    loops, until :meth:`reset`; it is per process (ranks do not share it). It cannot apply
    in the recompute of activation checkpointing (refused there): the recompute would see
    the values a second time.
    """

    def __init__(self, module: str, **where: Any) -> None:
        super().__init__(module, **where)
        self._total: torch.Tensor | None = None
        self._count = 0

    @property
    def mean(self) -> torch.Tensor | None:
        """The current estimate, float64 (``None`` before any value)."""
        return None if self._total is None or not self._count else self._total / self._count

    @property
    def count(self) -> int:
        """How many places (samples, or selected positions) the estimate is over."""
        return self._count

    def reset(self) -> None:
        """Forget every value seen."""
        self._total, self._count = None, 0

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        mask = self._mask(value)
        seen = value.detach() if mask is None else value.detach()[mask]
        total = seen.to(torch.float64).sum(0)  # cast the values, not the sum
        if self._total is not None and self._total.shape != total.shape:
            raise ValueError(
                f"RunningMean of {self.module!r}: a mean of shape {tuple(self._total.shape)} "
                f"so far, and now {self.kind} whose places have shape {tuple(total.shape)}; "
                "the places averaged must have one shape (give `positions` over the "
                "dimensions that vary, e.g. [batch, seq])"
            )
        self._total = total if self._total is None else self._total.to(total.device) + total
        self._count += len(seen)
        return super().apply(value)

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        mean = self.mean
        if mean is None:  # no place seen yet, so none to edit
            return value
        return mean.to(value.dtype).expand_as(value).clone()


class Steer(Edit):
    """Steering: ``alpha * vector`` added to the value."""

    def __init__(self, module: str, vector: torch.Tensor, alpha: float = 1.0, **where: Any):
        super().__init__(module, **where)
        self.vector = vector
        self.alpha = alpha

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(value.dtype, torch.float32)
        vector = self._fitting("vector", self.vector, value).to(device=value.device, dtype=wide)
        return (value.to(wide) + self.alpha * vector).to(value.dtype)


class Patch(Edit):
    """Activation patching: the value becomes ``source`` (e.g. a clean run's activations,
    read from a store for the batch's samples), of the value's shape."""

    def __init__(self, module: str, source: torch.Tensor, **where: Any) -> None:
        super().__init__(module, **where)
        self.source = source

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        source = self.source
        if tuple(source.shape) != tuple(value.shape):
            raise ValueError(
                f"a patch of shape {tuple(source.shape)} for {self.module!r}'s {self.kind} of "
                f"shape {tuple(value.shape)}: they must be equal"
            )
        patched = source.to(device=value.device, dtype=value.dtype)
        return patched.clone() if patched is source else patched  # never the user's own


class PatchWithin(Edit):
    """Patching from the same batch: sample ``i`` takes sample ``pairing[i]``'s value."""

    def __init__(self, module: str, pairing: Sequence[int] | torch.Tensor, **where: Any):
        super().__init__(module, **where)
        self.pairing = torch.as_tensor(pairing, dtype=torch.long)

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        pairing = self.pairing
        if len(pairing) != len(value):
            raise ValueError(
                f"`pairing` has {len(pairing)} entries for a batch of {len(value)} samples"
            )
        return value[pairing.to(value.device)]


class Replace(Edit):
    """The value replaced by ``function(value)``, e.g. a sparse autoencoder's reconstruction
    with some latents changed; with ``baseline`` (e.g. its unchanged reconstruction),
    ``function(value) + (value - baseline(value))``: the error term is kept, so only what
    ``function`` changes differs from the model's own value."""

    def __init__(
        self,
        module: str,
        function: Callable[[torch.Tensor], torch.Tensor],
        baseline: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **where: Any,
    ) -> None:
        super().__init__(module, **where)
        self.function = function
        self.baseline = baseline

    def edit(self, value: torch.Tensor) -> torch.Tensor:
        function = self.function
        baseline = self.baseline
        edited = function(value)
        if baseline is not None:
            edited = edited + (value - baseline(value))
        if tuple(edited.shape) != tuple(value.shape):
            raise ValueError(
                f"Replace's function gave {tuple(edited.shape)} for {self.module!r}'s "
                f"{self.kind} of shape {tuple(value.shape)}: they must be equal"
            )
        return edited.to(value.dtype)


def apply_edits(edits: Sequence[Edit], kind: Kind, value: Any, call: int) -> Any:
    """``value`` (a module's output, or ``(args, kwargs)`` of its call) with ``edits`` of
    ``kind`` for call ``call`` applied in order; ``value`` itself when none applies."""
    mine = [edit for edit in edits if edit.kind == kind and edit.call in (None, call)]
    if not mine:
        return value
    if kind == "outputs":
        return _edit_outputs(mine, value)
    args, kwargs = value
    args, kwargs = list(args), dict(kwargs)
    for edit in mine:
        where: int | str | None = edit.argument
        if where is None:
            where = (
                0
                if args
                else next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            )
        if isinstance(where, int) and where < len(args):
            args[where] = edit.apply(_tensor(args[where], edit))
        elif isinstance(where, str) and where in kwargs:
            kwargs[where] = edit.apply(_tensor(kwargs[where], edit))
        else:
            raise ValueError(
                f"{edit.module!r} was called with {len(args)} positional argument(s) and "
                f"keywords {sorted(kwargs)}: no argument {where!r} to edit; give "
                "`argument=` a position or a keyword's name"
            )
    return tuple(args), kwargs


def _edit_outputs(edits: Sequence[Edit], output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        for edit in edits:
            if edit.argument not in (None, 0):
                raise ValueError(f"{edit.module!r} returns one tensor: `argument` must be 0")
            output = edit.apply(output)
        return output
    if isinstance(output, (tuple, list)):
        parts = list(output)
        for edit in edits:
            place = 0 if edit.argument is None else edit.argument
            if not isinstance(place, int) or not 0 <= place < len(parts):
                raise ValueError(
                    f"{edit.module!r} returns {len(parts)} values: `argument` must be a "
                    f"place among them, got {place!r}"
                )
            parts[place] = edit.apply(_tensor(parts[place], edit))
        if isinstance(output, list):
            return parts
        return type(output)(*parts) if hasattr(output, "_fields") else tuple(parts)
    raise TypeError(
        f"{edits[0].module!r} returns a {type(output).__name__}: edits take a tensor or a "
        "tuple of values"
    )


def _tensor(value: Any, edit: Edit) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"the {edit.kind} of {edit.module!r} edited is a {type(value).__name__}, not a tensor"
        )
    return value
