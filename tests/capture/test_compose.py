"""Several callbacks and catchers on one model: each captures what it would alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch import IOCaptureCallback, ModelIOCatcher
from lightning_iocatch.capture.catcher import CaptureSession
from lightning_iocatch.lightning.predict_route import (
    PredictMember,
    join_predict_route,
    leave_predict_route,
)
from tests.conftest import Blocks, hook_count
from tests.lightning_models import TinyModule, loader, manual_outputs, trainer


def calls_of(module: nn.Module) -> list[int]:
    """A hand-written hook counting the calls of ``module`` (independent of the library)."""
    seen = [0]

    def count(*_: Any) -> None:
        seen[0] += 1

    module.register_forward_pre_hook(count)
    return seen


def manual(blocks: Blocks, x: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for layer in blocks.layers:
            x = layer(x)
            outs.append(x)
    return outs


def test_an_early_exit_session_never_cuts_another_sessions_captures_short(blocks: Blocks) -> None:
    x = torch.randn(3, 8)
    expected = manual(blocks, x)
    early, whole = ModelIOCatcher(blocks, "cpu"), ModelIOCatcher(blocks, "cpu")
    with (
        early.from_spec("outputs[layers.0]", early_exit=True) as first,
        whole.from_spec("outputs[layers.3]") as last,
    ):
        out = early.run(x)
    assert torch.equal(out, expected[3])  # the forward ran whole: `whole` has no early exit
    assert blocks.tail.calls == 1
    assert torch.equal(first["layers.0"]["outputs"][0], expected[0])
    assert torch.equal(last["layers.3"]["outputs"][0], expected[3])


def test_a_forward_stops_once_every_early_exit_session_is_done(blocks: Blocks) -> None:
    x = torch.randn(3, 8)
    expected = manual(blocks, x)
    layer3 = calls_of(blocks.layers[3])
    a, b = ModelIOCatcher(blocks, "cpu"), ModelIOCatcher(blocks, "cpu")
    with (
        a.from_spec("outputs[layers.0]", early_exit=True) as first,
        b.from_spec("outputs[layers.2]", early_exit=True) as second,
    ):
        for _ in range(3):
            assert b.run(x) is None
    assert layer3 == [0] and blocks.tail.calls == 0  # stopped right after layers.2
    assert [len(first["layers.0"]["outputs"]), len(second["layers.2"]["outputs"])] == [3, 3]
    assert all(torch.equal(v, expected[2]) for v in second["layers.2"]["outputs"])
    assert hook_count(blocks) == 1  # only the hand-written counter is left


class SharedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def test_an_early_exit_session_captures_the_same_with_or_without_another_open() -> None:
    model = SharedTwice()
    x = torch.randn(2, 4)
    alone = ModelIOCatcher(model, "cpu")
    with alone.from_spec("outputs[block]", early_exit=True) as by_itself:
        alone.run(x)
    other = ModelIOCatcher(model, "cpu")
    with (
        alone.from_spec("outputs[block]", early_exit=True) as beside,
        other.from_spec("outputs[head]") as head,
    ):
        alone.run(x)
    # the shared block runs twice; early exit counts its first call, whoever keeps going
    assert len(by_itself["block"]["outputs"]) == len(beside["block"]["outputs"]) == 1
    assert torch.equal(by_itself["block"]["outputs"][0], beside["block"]["outputs"][0])
    assert len(head["head"]["outputs"]) == 1


def test_a_done_early_exit_session_copies_nothing_more_while_another_keeps_the_forward() -> None:
    """Before, the finished session still snapshotted and copied the block's second call
    (and dropped it): one copy too many per forward, on a GPU a device-to-host copy."""
    model = SharedTwice()
    done, other = ModelIOCatcher(model, "cpu"), ModelIOCatcher(model, "cpu")
    copies: list[int] = []
    transfer = done.transfer
    done.transfer = lambda *args: copies.append(1) or transfer(*args)  # type: ignore[assignment]
    with (
        done.from_spec("outputs[block]", early_exit=True) as first,
        other.from_spec("outputs[head]"),
    ):
        for _ in range(3):
            done.run(torch.randn(2, 4))
    assert len(copies) == 3 and len(first["block"]["outputs"]) == 3  # one call a forward


def test_two_early_exit_callbacks_each_get_every_batch_and_predict_returns_both() -> None:
    module = TinyModule()
    first = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    second = IOCaptureCallback("outputs[model.layers.1]", early_exit=True)
    batches = trainer([first, second]).predict(module, loader(10, 5))
    assert module.model.tail.calls == 0  # stopped after layers.1, the later of the two
    x = loader(10, 5).dataset.tensors[0]
    expected = manual_outputs(module, x)
    for callback, layer in ((first, 0), (second, 1)):
        got = torch.cat(callback.captures["predict"][0][f"model.layers.{layer}"]["outputs"])
        assert torch.equal(got, expected[layer])
    assert [sorted(b) for b in batches] == [["model.layers.0", "model.layers.1"]] * 2
    assert torch.equal(batches[1]["model.layers.1"]["outputs"][0], expected[1][5:])


def plain_predictions(module: TinyModule) -> torch.Tensor:
    return torch.cat(trainer([]).predict(module, loader(10, 5)))


@pytest.mark.parametrize("order", ["early_first", "early_last"])
@pytest.mark.parametrize("fail", [False, True])
def test_predict_step_is_restored_exactly_whatever_the_order(order: str, fail: bool) -> None:
    module = TinyModule(fail_at_batch=1 if fail else None)
    early = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    whole = IOCaptureCallback("outputs[model.layers.2]", stages=["predict"])
    callbacks = [early, whole] if order == "early_first" else [whole, early]
    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            trainer(callbacks).predict(module, loader(10, 5))
        module.fail_at_batch = None
    else:
        trainer(callbacks).predict(module, loader(10, 5))
    assert "predict_step" not in vars(module) and hook_count(module) == 0
    x = loader(10, 5).dataset.tensors[0]
    with torch.no_grad():
        assert torch.equal(plain_predictions(module), torch.cat([module(x[:5]), module(x[5:])]))


@pytest.mark.parametrize("leave_order", [(0, 1), (1, 0)])
def test_a_users_own_predict_step_attribute_comes_back_as_it_was(leave_order: Any) -> None:
    module = TinyModule()

    def users_step(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> str:
        return "mine"

    module.predict_step = users_step  # type: ignore[method-assign]
    members = []
    for layer in (0, 1):
        session: CaptureSession = ModelIOCatcher(module, "cpu").from_spec(
            f"outputs[model.layers.{layer}]", early_exit=True
        )
        members.append(PredictMember(session, lambda: False))
        join_predict_route(module, members[-1])
    assert module.predict_step is not users_step
    for position in leave_order:
        leave_predict_route(module, members[position])
        leave_predict_route(module, members[position])  # leaving twice is harmless
    assert vars(module)["predict_step"] is users_step


def test_a_resumed_callback_that_skips_does_not_keep_the_batch_another_computes() -> None:
    module = TinyModule()

    class Skipping(IOCaptureCallback):
        def _decide_skip(self, *args: Any) -> None:
            self._skip_step = True

    skipping = Skipping("outputs[model.layers.0]", stages=["predict"], keep_in_memory=True)
    computing = IOCaptureCallback("outputs[model.layers.0]", stages=["predict"])
    trainer([skipping, computing]).predict(module, loader(10, 5))
    assert skipping.captures["predict"] == {}  # nothing carried into a later batch
    assert len(computing.captures["predict"][0]["model.layers.0"]["outputs"]) == 2


def test_a_users_catcher_session_and_an_early_exit_callback_compose() -> None:
    module = TinyModule()
    early = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    with ModelIOCatcher(module, "cpu").from_spec("outputs[model.layers.2]") as mine:
        trainer([early]).predict(module, loader(10, 5))
    x = loader(10, 5).dataset.tensors[0]
    expected = manual_outputs(module, x)
    # the user's session has no early exit, so every forward ran whole
    assert torch.equal(torch.cat(mine["model.layers.2"]["outputs"]), expected[2])
    got = torch.cat(early.captures["predict"][0]["model.layers.0"]["outputs"])
    assert torch.equal(got, expected[0])
    assert "predict_step" not in vars(module) and hook_count(module) == 0


def test_sessions_on_a_model_and_on_its_submodule_are_involved_together() -> None:
    torch.manual_seed(0)
    inner = Blocks()
    outer = nn.Sequential(inner, nn.Linear(8, 8))
    x = torch.randn(2, 8)
    expected = manual(inner, x)
    whole = ModelIOCatcher(outer, "cpu")  # no early exit, on the enclosing model
    early = ModelIOCatcher(inner, "cpu")  # early exit, on the submodule
    with (
        whole.from_spec("outputs[0.layers.3]") as kept,
        early.from_spec("outputs[layers.0]", early_exit=True) as first,
    ):
        assert torch.equal(early.run(x), expected[3])  # not cut: `whole` needs layers.3
    assert torch.equal(kept["0.layers.3"]["outputs"][0], expected[3])
    assert torch.equal(first["layers.0"]["outputs"][0], expected[0])


def test_a_callback_does_not_cut_short_a_users_session_on_its_inner_model() -> None:
    module = TinyModule()
    early = IOCaptureCallback("outputs[model.layers.0]", early_exit=True)
    with ModelIOCatcher(module.model, "cpu").from_spec("outputs[layers.2]") as mine:
        trainer([early]).predict(module, loader(10, 5))
    x = loader(10, 5).dataset.tensors[0]
    assert torch.equal(torch.cat(mine["layers.2"]["outputs"]), manual_outputs(module, x)[2])


def test_sessions_on_unrelated_models_do_not_hold_each_other_back() -> None:
    torch.manual_seed(0)
    a, b = Blocks(), Blocks()
    x = torch.randn(2, 8)
    with (
        ModelIOCatcher(a, "cpu").from_spec("outputs[layers.0]", early_exit=True),
        ModelIOCatcher(b, "cpu").from_spec("outputs[layers.0]") as on_b,
    ):
        catcher_a = ModelIOCatcher(a, "cpu")
        assert catcher_a.run(x) is None  # b's session is not involved in a's forward
        b(x)
    assert a.tail.calls == 0 and b.tail.calls == 1 and len(on_b["layers.0"]["outputs"]) == 1
