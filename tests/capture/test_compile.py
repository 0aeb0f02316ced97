"""torch.compile: captures equal eager, with or without `_orig_mod.`, bounded recompiles.

With ``fullgraph=True`` a session captures exactly or refuses clearly (compiled.py).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from lightning_iocatch import CaptureError, ModelIOCatcher
from lightning_iocatch.capture.catcher import module_index
from lightning_iocatch.capture.compiled import _compiled_parts, prepare_for_hooks
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


# torch.compile(..., fullgraph=True): the catcher's hooks are a graph break, which fullgraph
# forbids. A session either captures exactly what eager computes (hooks that run outside
# the compiled code) or refuses to open with a CaptureError that says what to do; never a
# Dynamo error in the middle of a forward.


class Block(nn.Module):
    """A layer with its own ``forward`` (not ``nn.Sequential``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def eager_block_outputs(net: BlockNet, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outputs by name, computed by hand in eager mode."""
    outs = {}
    with torch.no_grad():
        for i, layer in enumerate(net.layers):
            outs[f"layers.{i}.fc"] = layer.fc(x)
            x = layer(x)
            outs[f"layers.{i}"] = x
    outs[""] = x
    return outs


def fullgraph_whole(net: BlockNet) -> nn.Module:
    return torch.compile(net, backend="eager", fullgraph=True)


def fullgraph_layer(net: BlockNet) -> nn.Module:
    net.layers[0] = torch.compile(net.layers[0], backend="eager", fullgraph=True)
    return net


def fullgraph_in_place(net: BlockNet) -> nn.Module:
    net.compile(backend="eager", fullgraph=True)
    return net


def fullgraph_layer_in_place(net: BlockNet) -> nn.Module:
    net.layers[1].compile(backend="eager", fullgraph=True)
    return net


# (how it was compiled, a name hooked inside the compiled code, what the message must say)
REFUSED = [
    (fullgraph_whole, "layers.1", r"The model is `torch\.compile\(module, fullgraph=True\)`"),
    (fullgraph_whole, "layers.2.fc", r"capture on the uncompiled module.*`compiled\._orig_mod`"),
    (fullgraph_layer, "layers.0.fc", r"`layers\.0` is `torch\.compile\(module, fullgraph=True\)`"),
    (fullgraph_in_place, "layers.1", r"compiled in place with `\.compile\(fullgraph=True\)`"),
    (fullgraph_layer_in_place, "layers.1.fc", r"`layers\.1` was compiled in place"),
]
# (how it was compiled, names whose hooks run outside the fullgraph code)
OUTSIDE = [
    (fullgraph_whole, [""]),
    (fullgraph_layer, ["layers.0", "layers.1.fc", "layers.2"]),
    (fullgraph_in_place, [""]),
    (fullgraph_layer_in_place, ["layers.1", "layers.0.fc", "layers.2"]),
]


@pytest.mark.parametrize(("compile_", "name", "fix"), REFUSED)
def test_fullgraph_refuses_to_open_with_a_message_that_says_what_to_do(
    compile_: Any, name: str, fix: str
) -> None:
    torch.manual_seed(0)
    net = BlockNet()
    x = torch.randn(2, 8)
    expected = eager_block_outputs(net, x)
    model = compile_(net)
    model(x)  # compiled before the session: its code must not be reused with hooks
    catcher = ModelIOCatcher(model, "cpu")
    with pytest.raises(CaptureError, match=r"fullgraph=True.*graph break") as info:
        catcher(outputs=[name]).open()  # refused here, before any forward
    assert re.search(fix, str(info.value)), str(info.value)
    assert "without `fullgraph=True`" in str(info.value)
    assert hook_count(model) == 0
    assert torch.equal(model(x), expected[""])  # the model is untouched and still runs


@pytest.mark.parametrize(("compile_", "names"), OUTSIDE)
def test_fullgraph_check_is_exact_about_which_modules_run_inside(
    compile_: Any, names: list[str]
) -> None:
    model = compile_(BlockNet())
    refused = {name for compiler, name, _ in REFUSED if compiler is compile_}
    for name in names:
        prepare_for_hooks(model, {name: _module(model, name)})  # no error
    for name in refused:
        with pytest.raises(CaptureError, match=f"cannot capture `{re.escape(name)}`"):
            prepare_for_hooks(model, {name: _module(model, name)})
    with pytest.raises(CaptureError, match="cannot capture in this model"):
        prepare_for_hooks(model)  # without the hooked modules: any fullgraph part refuses


def _module(model: nn.Module, name: str) -> nn.Module:
    """The module the catcher hooks for ``name``: the innermost one of that name."""
    return module_index(model)[name]


@pytest.mark.parametrize(("compile_", "names"), OUTSIDE)
def test_fullgraph_captures_outside_the_compiled_code_equal_eager(
    compile_: Any, names: list[str]
) -> None:
    torch.manual_seed(0)
    net = BlockNet()
    x = torch.randn(2, 8)
    expected = eager_block_outputs(net, x)
    model = compile_(net)
    model(x)
    catcher = ModelIOCatcher(model, "cpu")
    with catcher(outputs=names) as buf:
        model(x)
    for name in names:
        assert torch.equal(buf[name]["outputs"][0], expected[name]), name
    with catcher(outputs=names[-1:], early_exit=True) as buf:
        catcher.run(x)
    assert torch.equal(buf[names[-1]]["outputs"][0], expected[names[-1]])
    assert hook_count(model) == 0


def test_fullgraph_torch_container_is_refused_at_its_own_name() -> None:
    """``nn.Sequential.forward`` is torch's own: Dynamo traces its call, hooks included."""
    net = Net()
    net.layers[0] = torch.compile(net.layers[0], backend="eager", fullgraph=True)
    x = torch.randn(2, 8)
    net(x)
    catcher = ModelIOCatcher(net, "cpu")
    with pytest.raises(CaptureError, match=r"cannot capture .*`layers\.0` is `torch\.compile"):
        catcher(outputs=["layers.0"]).open()
    assert hook_count(net) == 0


def test_following_the_advice_captures_equal_eager() -> None:
    torch.manual_seed(0)
    net = BlockNet()
    x = torch.randn(2, 8)
    expected = eager_block_outputs(net, x)
    compiled = fullgraph_whole(net)
    compiled(x)
    assert isinstance(compiled, OptimizedModule)
    with ModelIOCatcher(compiled._orig_mod, "cpu")(outputs=["layers.1"]) as buf:
        compiled._orig_mod(x)  # "give the catcher `compiled._orig_mod` and call that"
    assert torch.equal(buf["layers.1"]["outputs"][0], expected["layers.1"])
    fullgraph_in_place(net)
    net(x)
    net.compile(backend="eager")  # "call `.compile()` on it again without fullgraph=True"
    net(x)
    with ModelIOCatcher(net, "cpu")(outputs=["layers.1", "layers.2.fc"]) as buf:
        net(x)
    assert torch.equal(buf["layers.1"]["outputs"][0], expected["layers.1"])
    assert torch.equal(buf["layers.2.fc"]["outputs"][0], expected["layers.2.fc"])


def test_in_place_compile_sees_hooks_registered_after_its_first_call() -> None:
    torch.manual_seed(0)
    net = BlockNet()
    x = torch.randn(2, 8)
    expected = eager_block_outputs(net, x)
    net.compile(backend=CompileCounter())
    net(x)  # compiled without hooks; Dynamo does not guard on hooks unless told to
    with ModelIOCatcher(net, "cpu")(outputs=["layers.0.fc"]) as buf:
        net(x)
    assert torch.equal(buf["layers.0.fc"]["outputs"][0], expected["layers.0.fc"])


def test_lightning_compiled_module_with_fullgraph_is_refused_with_lightning_advice() -> None:
    from lightning.pytorch.utilities.compile import from_compiled, to_uncompiled

    from tests.lightning_models import TinyModule

    torch.manual_seed(0)
    module = from_compiled(torch.compile(TinyModule(), backend="eager", fullgraph=True))
    catcher = ModelIOCatcher(module, "cpu")
    with pytest.raises(CaptureError, match=r"Lightning compiled `forward`.*to_uncompiled"):
        catcher(outputs=["model.layers.1"]).open()
    assert hook_count(module) == 0
    to_uncompiled(module)
    x = torch.randn(2, 8)
    with catcher(outputs=["model.layers.1"]) as buf:
        module(x)
    with torch.no_grad():
        expected = module.model.layers[1](module.model.layers[0](x))
    assert torch.equal(buf["model.layers.1"]["outputs"][0], expected)


def test_dynamo_still_records_what_compiled_py_reads() -> None:
    """Fails loudly when torch changes where it keeps the compile options."""
    net = BlockNet()
    parts = _compiled_parts(torch.compile(net, backend="eager", fullgraph=True))
    assert [(p.name, p.attribute, p.fullgraph) for p in parts] == [("", "forward", True)]
    assert parts[0].hooks_outside[1] is net  # torch.compile(module) compiles module.__call__
    net.layers[2].compile(backend="eager")
    net.compile(backend="eager", fullgraph=True)
    found = {(p.name, p.attribute, p.fullgraph) for p in _compiled_parts(net)}
    assert found == {("", "_compiled_call_impl", True), ("layers.2", "_compiled_call_impl", False)}
