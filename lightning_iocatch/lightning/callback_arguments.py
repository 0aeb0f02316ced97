"""The checks of :class:`~lightning_iocatch.lightning.callback.IOCaptureCallback`'s
arguments: each bad argument is refused with an error that names it and the fix, before
the callback binds anything.

Examples:
    >>> checked_stages(["predict", "validate"], early_exit=True)
    ('predict', 'validate')
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from torchmetrics import Metric

from lightning_iocatch.capture.edits import Edit
from lightning_iocatch.capture.spec import CaptureSpec
from lightning_iocatch.errors import SpecError
from lightning_iocatch.lightning.feature_writer import FeatureWriter
from lightning_iocatch.lightning.gradient_pass import ForwardFn, GradientPass, LossFn, OutputFn
from lightning_iocatch.lightning.probe_sink import ProbeSink, ProbeTokens
from lightning_iocatch.lightning.sinks import STAGES, CaptureSink

__all__ = [
    "checked_gradient_pass",
    "checked_sinks",
    "checked_spec",
    "checked_stages",
    "described_edits",
]


def checked_spec(spec: Any) -> CaptureSpec:
    """``spec`` parsed; it must select some module."""
    if not isinstance(spec, str):
        raise TypeError(
            f"`spec` must be a spec string such as 'outputs[model.layers.0]', got "
            f"{type(spec).__name__}"
        )
    parsed = CaptureSpec.parse(spec)
    if parsed.is_empty:
        raise SpecError(f"`spec` {spec!r} selects no module; write e.g. 'outputs[model.layers.0]'")
    return parsed


def checked_stages(stages: Sequence[str] | str, early_exit: bool) -> tuple[str, ...]:
    """The stages, once each, in order; early exit needs the predict loop."""
    if isinstance(stages, str):
        stages = (stages,)
    if not isinstance(stages, (list, tuple)):
        raise TypeError(f"`stages` must be a list of stage names, got {type(stages).__name__}")
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown or not stages:
        raise ValueError(f"`stages` must be a non-empty subset of {STAGES}, got {tuple(stages)!r}")
    if early_exit and "predict" not in stages:
        raise ValueError(
            "`early_exit=True` applies to the predict loop only (validation and test steps "
            "need the model's output), but `stages` has no 'predict': add it, or drop "
            "`early_exit`"
        )
    return tuple(dict.fromkeys(stages))


def checked_gradient_pass(
    spec: CaptureSpec,
    early_exit: bool,
    loss: LossFn | None,
    forward: ForwardFn | None,
    output: OutputFn | None,
) -> GradientPass | None:
    """The pass that computes the gradients ``spec`` asks for (``None``: it asks for none);
    ``loss``, ``forward`` and ``output`` only mean something with gradients."""
    given = {"loss": loss, "forward": forward, "output": output}
    for argument, value in given.items():
        if value is not None and not callable(value):
            raise TypeError(f"`{argument}` must be a function, got {type(value).__name__}")
    if not spec.has_gradients:
        named = [f"`{argument}`" for argument, value in given.items() if value is not None]
        if named:
            names = " and ".join(named)
            serve = "serves" if len(named) == 1 else "serve"
            example = (spec.outputs or spec.inputs or ("model.layers.0",))[0]
            raise ValueError(
                f"{names} only {serve} the gradients of a spec's grad_outputs[...] or "
                f"grad_inputs[...], but `spec` {spec.to_string()!r} asks for no gradient: add "
                f"e.g. 'grad_outputs[{example}]' to it, or drop {names}"
            )
        return None
    if early_exit:
        raise ValueError(
            f"`early_exit=True` stops each forward after its last capture, but `spec` "
            f"{spec.to_string()!r} asks for gradients, which need the whole forward up to the "
            "loss and its backward: drop `early_exit`, or capture gradients with another "
            "IOCaptureCallback"
        )
    return GradientPass(loss, forward, output)


def checked_sinks(
    writer: FeatureWriter | str | os.PathLike[str] | None,
    probes: Sequence[Metric],
    sinks: Sequence[CaptureSink],
    edits: Sequence[Edit],
    stages: tuple[str, ...],
    probe_tokens: ProbeTokens = "attention_mask",
) -> tuple[list[CaptureSink], ProbeSink | None]:
    """The callback's sinks: the writer's first, the given ones, the probes' last; and the
    probes' sink. Also checks that ``edits`` is a list of edits."""
    if writer is not None:
        if not isinstance(writer, (FeatureWriter, str, os.PathLike)):
            raise TypeError(
                f"`writer` must be a FeatureWriter or a directory path, got {type(writer).__name__}"
            )
        writer = writer if isinstance(writer, FeatureWriter) else FeatureWriter(writer)
        if "predict" not in stages:
            raise ValueError(
                "`writer` dumps the predict loop, but `stages` has no 'predict': add it"
            )
        sinks = [writer, *sinks]
    for argument, value in (("probes", probes), ("sinks", sinks), ("edits", edits)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"`{argument}` must be a list, got {type(value).__name__}")
    probe_sink = ProbeSink(probes, tokens=probe_tokens) if probes else None
    if probe_sink is not None:
        if not {"validate", "test"} & set(stages):
            raise ValueError("`probes` run in validation or test, but `stages` has neither")
        sinks = [*sinks, probe_sink]
    for sink in sinks:
        if not isinstance(sink, CaptureSink):
            raise TypeError(f"`sinks` must hold CaptureSink instances, got {type(sink).__name__}")
    return list(sinks), probe_sink


def described_edits(edits: Sequence[Edit]) -> list[dict[str, Any]] | None:
    """What a store records of ``edits`` (``None`` for none), checked to be JSON."""
    if not all(isinstance(edit, Edit) for edit in edits):
        raise TypeError("`edits` takes Edit objects (Zero, Steer, ...)")
    described = [edit.describe() for edit in edits] or None
    try:  # a store records them as JSON
        json.dumps(described, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"`edits` must describe themselves as JSON for a store to record them: {error}"
        ) from error
    return described
