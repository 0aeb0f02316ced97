"""Tensor-parallel values made whole (``capture/sharded.py``, ``capture/tp_layouts.py``),
without Lightning, against the same model unsharded.

One launch of ``tests/scripts/sharded_values.py`` in two gloo processes, shared by every
test here: a model sharded with each of torch's parallel styles (``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``ColwiseParallel`` and
``RowwiseParallel`` with local and DTensor outputs, an elementwise module after a
column-split Linear) and hand-written tensor-parallel layers, captured, edited, run as
``Variants`` and differentiated through ``ModelIOCatcher(model, "cpu")``. The truth is the
same :class:`~tests.scripts.sharded_values.Net` and weights unsharded, run here with
hand-written forward hooks (and hand-written edits), never the catcher. Both ranks'
values are compared: each must see the whole value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.hooks import RemovableHandle

from tests.conftest import ROOT
from tests.gloo_pair import run_pair
from tests.scripts.sharded_values import (
    CAPTURES,
    EDITS,
    GRADIENTS,
    MODES,
    ODD,
    VARIANTS,
    B,
    S,
    X,
    build,
    loss_of,
)

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "scripts" / "sharded_values.py"
WORLD = 2
TIMEOUT = 300  # seconds for both processes; the launch takes about 10


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of the one launch (both processes killed past ``TIMEOUT``)."""
    out = tmp_path_factory.mktemp("sharded_values")
    run_pair(SCRIPT, out, TIMEOUT)
    return torch.load(out / "results.pt", weights_only=False)


@contextmanager
def hooked(registrations: Iterable[Callable[[], RemovableHandle]]) -> Iterator[None]:
    """Hand-written hooks, registered on entry and removed on exit (also on exceptions)."""
    handles: list[RemovableHandle] = []
    try:
        for register in registrations:
            handles.append(register())
        yield
    finally:
        for handle in handles:
            handle.remove()


def edit_by_hand(model: torch.nn.Module, name: str) -> Callable[[], RemovableHandle]:
    """The hook that applies ``EDITS[name]``'s hand-written edit of the whole value."""
    _, module_name, kind, fn, mask = EDITS[name]
    module = model.get_submodule(module_name)

    def edited(h: torch.Tensor) -> torch.Tensor:
        return fn(h) if mask is None else torch.where(mask[..., None], fn(h), h)

    if kind == "outputs":
        return lambda: module.register_forward_hook(lambda m, args, out: edited(out))
    return lambda: module.register_forward_pre_hook(lambda m, args: (edited(args[0]),))


def keep(model: torch.nn.Module, kind: str, name: str, seen: dict[Any, torch.Tensor]) -> Any:
    """The hook that keeps a copy of ``name``'s output (or first input) in ``seen``."""
    module = model.get_submodule(name)
    if kind == "outputs":
        return lambda: module.register_forward_hook(
            lambda m, args, out: seen.__setitem__((kind, name), out.detach().clone())
        )
    return lambda: module.register_forward_pre_hook(
        lambda m, args: seen.__setitem__((kind, name), args[0].detach().clone())
    )


def output_under(*edits: str) -> torch.Tensor:
    """The unsharded model's output under the hand-written ``edits``."""
    model = build()
    with torch.no_grad(), hooked(edit_by_hand(model, name) for name in edits):
        return model(X)


def same(got: Any, want: torch.Tensor, what: str) -> None:
    """``got`` is a plain tensor equal to ``want`` (atol 1e-5); an error is shown as such."""
    assert not (isinstance(got, dict) and "error" in got), f"{what}: {got['error']}"
    assert type(got) is torch.Tensor, f"{what}: a {type(got).__name__}, not a whole tensor"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def captured() -> dict[tuple[str, str], torch.Tensor]:
    """Every value of ``CAPTURES``, as the unsharded model computes it."""
    model, seen = build(), dict[Any, torch.Tensor]()
    with torch.no_grad(), hooked(keep(model, kind, name, seen) for kind, name in CAPTURES):
        model(X)
    return seen


def test_sharded_forward_is_the_unsharded_one(ranks: list[dict[str, Any]]) -> None:
    """The sharded model itself (no catcher) computes the truth's output on each rank."""
    for rank, results in enumerate(ranks):
        same(results["output"], output_under(), f"rank {rank}")


def test_no_hook_is_left(ranks: list[dict[str, Any]]) -> None:
    """Every case, failed ones included, removed what it registered."""
    for results in ranks:
        before, after = results["hooks"]
        assert before == after


@pytest.mark.parametrize("site", CAPTURES, ids=lambda site: f"{site[0]}[{site[1]}]")
def test_captures_are_whole(
    ranks: list[dict[str, Any]], captured: dict[Any, torch.Tensor], site: tuple[str, str]
) -> None:
    """Sequence shards, last-dimension shards (local or DTensor), an elementwise module's
    inherited layout, replicated and plain values: each captured whole on each rank."""
    for rank, results in enumerate(ranks):
        same(results["captures"][site], captured[site], f"rank {rank} {site}")


def test_hand_written_layer_refused_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    """A local shard no style declares is refused at its first call, capture or edit, on
    both ranks (the launch returning at all shows neither hung); the model runs on."""
    for rank, results in enumerate(ranks):
        for case in ("refused", "refused-edit"):
            error = results[case]
            assert isinstance(error, dict) and "error" in error, (rank, case, error)
            assert error["error"].startswith("CaptureError: outputs of 'rogue' (call 0) differs")
            assert "shard_layouts={'outputs[rogue]': Shard(-1)}" in error["error"]
        same(results["after-refused"], output_under(), f"rank {rank} after the refusal")


def test_hand_written_layer_with_its_layout_given(ranks: list[dict[str, Any]]) -> None:
    """``shard_layouts`` gives the placement: the uneven (3 + 2) shards captured whole."""
    model, seen = build(), dict[Any, torch.Tensor]()
    with torch.no_grad(), hooked([keep(model, "outputs", "rogue", seen),
                                  keep(model, "inputs", "back", seen)]):  # fmt: skip
        output = model(X)
    for rank, results in enumerate(ranks):
        given = results["given"]
        assert not (isinstance(given, dict) and "error" in given), given
        assert given["rogue"].shape == (B, S, ODD)
        same(given["rogue"], seen["outputs", "rogue"], f"rank {rank} outputs[rogue]")
        same(given["back"], seen["inputs", "back"], f"rank {rank} inputs[back]")
        same(given["output"], output, f"rank {rank} output")


def _edit_cases() -> list[Any]:
    cases = []
    for mode in MODES:
        for name in EDITS:
            cases.append(pytest.param(mode, name, id=f"{name}-{mode}"))
    return cases


@pytest.mark.parametrize(("mode", "name"), _edit_cases())
def test_edit_applies_to_the_whole_value(ranks: list[dict[str, Any]], mode: str, name: str) -> None:
    """Zero, Steer, Replace (a function of the whole last dimension or sequence), Mean,
    Patch and StorePatch on local shards, DTensors, sequence shards (with `positions`),
    declared and given layouts: the model's output is the unsharded model's under the same
    edit by hand, with gradients off (as in Lightning's evaluation) and on (a plain loop,
    training)."""
    want = output_under(name)
    assert not torch.allclose(want, output_under(), atol=1e-2)  # the edit changes it
    for rank, results in enumerate(ranks):
        same(results["edits"][mode][name], want, f"rank {rank} {name} ({mode})")


def test_variants(ranks: list[dict[str, Any]]) -> None:
    """Variants (a Zero, a Steer, and two edits at once) replays the clean calls before
    each edit point, under the styles' hooks, and falls back nowhere."""
    for rank, results in enumerate(ranks):
        assert "error" not in results["variants"], results["variants"]
        outputs = results["variants"]["outputs"]
        assert results["variants"]["fallbacks"] == []  # the clean calls were replayed
        assert sorted(outputs) == sorted(["clean", *VARIANTS])
        same(outputs["clean"], output_under(), f"rank {rank} clean")
        for variant, edits in VARIANTS.items():
            same(outputs[variant], output_under(*edits), f"rank {rank} {variant}")


def gradient_by_hand(spec: str, edits: tuple[str, ...]) -> torch.Tensor:
    """The gradient of ``loss_of`` at ``spec``'s site of the unsharded model (a leaf put
    in the value's place by a hand-written hook), under the hand-written ``edits``."""
    kind, name = spec[:-1].split("[")
    model = build()
    module = model.get_submodule(name)
    leaf: list[torch.Tensor] = []

    def place(value: torch.Tensor) -> torch.Tensor:
        leaf.append(value.detach().requires_grad_())
        return leaf[0]

    def site() -> RemovableHandle:
        if kind == "grad_outputs":
            return module.register_forward_hook(lambda m, args, out: place(out))
        return module.register_forward_pre_hook(lambda m, args: (place(args[0]),))

    with hooked([*(edit_by_hand(model, e) for e in edits), site]):
        loss = loss_of(model(X))
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


@pytest.mark.parametrize("name", GRADIENTS)
def test_gradient_is_whole(ranks: list[dict[str, Any]], name: str) -> None:
    """``grad_outputs``/``grad_inputs`` under ``recording_gradients()`` at DTensor,
    local-shard, sequence-shard and given sites, alone and under an edit downstream of
    the site (its gradient flows through the edited value): equal to
    ``torch.autograd.grad`` of the unsharded model."""
    spec, edits = GRADIENTS[name]
    want = gradient_by_hand(spec, edits)
    for rank, results in enumerate(ranks):
        same(results["gradients"][name], want, f"rank {rank} {spec} under {edits}")
