"""torch.compile: captures equal eager, with or without `_orig_mod.`, bounded recompiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from lightning_iocatch import ModelIOCatcher
from tests.conftest import hook_count


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def eager_layer_outputs(net: Net, x: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for layer in net.layers:
            x = layer(x)
            outs.append(x)
    return outs


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def test_compiled_model_captures_equal_eager_with_bounded_recompiles() -> None:
    torch.manual_seed(0)
    net = Net()
    compiled = torch.compile(net, backend=CompileCounter())
    x = torch.randn(2, 8)
    compiled(x)  # compiled before the catcher exists: the case Dynamo would silently ignore
    expected = eager_layer_outputs(net, x)
    catcher = ModelIOCatcher(compiled, "cpu")
    specs = ["outputs[layers.1]", "outputs[_orig_mod.layers.2]|inputs[layers.0]"]
    specs += ["outputs[layers.1]", "outputs[layers.0|layers.3]"]
    seen_sets: set[str] = set()
    for spec in specs:
        frames_before = counters["frames"]["total"]
        with catcher.from_spec(spec, early_exit=False) as buf:
            compiled(x)
            frames_in_session = counters["frames"]["total"]
            compiled(x)
            compiled(x)
            assert counters["frames"]["total"] == frames_in_session, "recompiled within a session"
        allowed = 0 if spec in seen_sets else 1
        assert frames_in_session - frames_before <= allowed, spec
        seen_sets.add(spec)
        for name, kinds in buf.items():
            index = int(name[-1])
            for out in kinds["outputs"]:
                assert torch.equal(out, expected[index])
            for entry in kinds["inputs"]:
                assert torch.equal(entry["args"][0], x)
        assert all(len(kinds["outputs"]) + len(kinds["inputs"]) == 3 for kinds in buf.values())
    assert hook_count(net) == 0
    assert torch.equal(compiled(x), expected[-1])


def test_compiled_submodule_names_with_or_without_orig_mod_and_early_exit() -> None:
    torch.manual_seed(0)
    outer = nn.Module()
    body = Net()
    outer.body = torch.compile(body, backend="eager")
    x = torch.randn(2, 8)
    expected = eager_layer_outputs(body, x)
    outer.body(x)
    catcher = ModelIOCatcher(outer, "cpu")
    assert "body.layers.1" in catcher.module_names
    for spec in ["outputs[body.layers.1]", "outputs[body._orig_mod.layers.1]"]:
        with catcher.from_spec(spec, early_exit=True) as buf:
            assert catcher.call(outer.body, x) is None
        assert torch.equal(buf["body.layers.1"]["outputs"][0], expected[1])
        assert torch.equal(buf["body._orig_mod.layers.1"]["outputs"][0], expected[1])


@pytest.mark.slow
def test_inductor_compiled_model_captures_equal_eager() -> None:
    torch.manual_seed(0)
    net = Net()
    compiled = torch.compile(net)
    x = torch.randn(4, 8)
    reference = compiled(x)
    expected = eager_layer_outputs(net, x)
    catcher = ModelIOCatcher(compiled, None)
    with catcher.from_spec("outputs[layers.*]", early_exit=False) as buf:
        out = compiled(x)
    assert torch.allclose(out, reference)
    for i in range(4):
        assert torch.allclose(buf[f"layers.{i}"]["outputs"][0], expected[i], atol=1e-6)
    assert torch.allclose(compiled(x), expected[-1], atol=1e-6)
