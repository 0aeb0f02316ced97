"""catcher.py: sessions, buffer layout, early exit, and each defect of the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_iocatch import CaptureError, ModelIOCatcher, SpecError, UnknownModuleError
from tests.conftest import Blocks, Counter, hook_count


def manual_layer_outputs(model: Blocks, x: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for layer in model.layers:
            x = layer(x)
            outs.append(x.clone())
    return outs


def test_buffer_layout_one_entry_per_call(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    xs = [torch.randn(2, 8) for _ in range(3)]
    with catcher(inputs=["layers.1"], outputs=["layers.0", "layers.1"]) as buf:
        for x in xs:
            catcher.run(x, scale=1.0)
    assert set(buf) == {"layers.0", "layers.1"}
    assert len(buf["layers.0"]["outputs"]) == 3 and buf["layers.0"]["inputs"] == []
    for x, entry, out in zip(
        xs, buf["layers.1"]["inputs"], buf["layers.1"]["outputs"], strict=True
    ):
        expected = manual_layer_outputs(blocks, x)
        assert torch.equal(entry["args"][0], expected[0]) and entry["kwargs"] == {}
        assert torch.equal(out, expected[1])


def test_inputs_capture_keyword_arguments() -> None:
    outer = nn.ModuleDict({"inner": Blocks()})
    catcher = ModelIOCatcher(outer, None)
    x = torch.randn(1, 8)
    with catcher(inputs=["inner"]) as buf:
        outer["inner"](x, scale=0.5)
    entry = buf["inner"]["inputs"][0]
    assert torch.equal(entry["args"][0], x) and entry["kwargs"] == {"scale": 0.5}


def test_captures_are_detached_under_grad_mode(blocks: Blocks) -> None:
    with ModelIOCatcher(blocks, "cpu")(outputs=["layers.0"], inputs=["layers.1"]) as buf:
        blocks(torch.randn(2, 8)).sum().backward()
    out, arg = buf["layers.0"]["outputs"][0], buf["layers.1"]["inputs"][0]["args"][0]
    assert out.grad_fn is None and not out.requires_grad
    assert arg.grad_fn is None and not arg.requires_grad


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h += 1  # in place on the captured output of `lin`
        h = self.act(h)
        return self.drop(h)


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("name", ["lin", "act", "drop"])
def test_later_in_place_ops_never_corrupt_captures(device: str | None, name: str) -> None:
    torch.manual_seed(0)
    model = InPlace().train()
    drop_inplace = nn.Dropout(0.5, inplace=True)
    model.drop = drop_inplace
    x = torch.randn(16, 4)
    with torch.no_grad():
        expected = {"lin": model.lin(x)}
        expected["act"] = torch.relu(expected["lin"] + 1)
    with ModelIOCatcher(model, device)(outputs=[name], inputs=["drop"]) as buf, torch.no_grad():
        model(x)
    if name != "drop":
        assert torch.equal(buf[name]["outputs"][0], expected[name])
    assert torch.equal(buf["drop"]["inputs"][0]["args"][0], expected["act"])


def test_no_hooks_exist_outside_a_session(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    assert hook_count(blocks) == 0
    with catcher(inputs=["layers.0"], outputs=["layers.2", "tail"]):
        assert hook_count(blocks) == 3
        assert len(blocks.layers[1]._forward_hooks) == 0
    assert hook_count(blocks) == 0


def test_nested_sessions_are_refused(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    with catcher(outputs=["layers.0"]) as buf:
        with pytest.raises(CaptureError, match="already open"):
            catcher(outputs=["layers.1"])
        blocks(torch.randn(1, 8))
    assert len(buf["layers.0"]["outputs"]) == 1
    session = catcher(outputs=["layers.1"])
    with session, pytest.raises(CaptureError, match="already open"), session:
        pass
    assert hook_count(blocks) == 0 and catcher.session is None


def test_two_catchers_on_one_model_capture_independently(blocks: Blocks) -> None:
    first, second = ModelIOCatcher(blocks, "cpu"), ModelIOCatcher(blocks, None)
    with first(outputs=["layers.0"]) as a, second(outputs=["layers.0", "layers.1"]) as b:
        blocks(torch.randn(1, 8))
    assert len(a["layers.0"]["outputs"]) == len(b["layers.1"]["outputs"]) == 1


def test_an_exception_inside_a_session_leaves_nothing_armed(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    with (
        pytest.raises(RuntimeError, match=r"size of tensor a \(3\)"),
        catcher(outputs=["layers.1"], early_exit=True),
    ):
        catcher.run(torch.randn(1, 3))
    assert hook_count(blocks) == 0 and catcher.session is None
    with catcher(outputs=["layers.1"], early_exit=True) as buf:
        assert catcher.run(torch.randn(1, 8)) is None
    assert len(buf["layers.1"]["outputs"]) == 1


def test_explicit_attach_and_detach(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    catcher(outputs=["layers.3"])
    buf = catcher.attach_hooks()
    try:
        blocks(torch.randn(1, 8))
    finally:
        catcher.detach_hooks()
    catcher.detach_hooks()
    assert hook_count(blocks) == 0 and len(buf["layers.3"]["outputs"]) == 1


def test_early_exit_skips_the_rest_of_the_network(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    x = torch.randn(2, 8)
    with catcher.from_spec("outputs[layers.1]", early_exit=True) as buf:
        assert catcher.run(x) is None
        assert catcher.run(x) is None
    assert blocks.tail.calls == 0
    assert torch.equal(buf["layers.1"]["outputs"][1], manual_layer_outputs(blocks, x)[1])


def test_early_exit_fires_after_the_last_capture_in_execution_order(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    x = torch.randn(2, 8)
    expected = manual_layer_outputs(blocks, x)
    # Listed last-first, and the input of layers.3 happens after the output of layers.2.
    with catcher.from_spec("outputs[layers.2|layers.0]|inputs[layers.3]", early_exit=True) as buf:
        assert catcher.run(x) is None
    assert torch.equal(buf["layers.0"]["outputs"][0], expected[0])
    assert torch.equal(buf["layers.2"]["outputs"][0], expected[2])
    assert torch.equal(buf["layers.3"]["inputs"][0]["args"][0], expected[2])
    assert buf["layers.3"]["outputs"] == [] and blocks.tail.calls == 0


def test_output_hooks_fire_after_the_whole_subtree(blocks: Blocks) -> None:
    """``layers.0``'s output is captured after its subtree (the Linear, then the ReLU) has
    run, so an early exit on both stops after the ReLU, before ``layers.1`` starts."""
    ran: list[str] = []
    handles = [
        blocks.layers[0][0].register_forward_hook(lambda *_: ran.append("layers.0.0")),
        blocks.layers[0][1].register_forward_hook(lambda *_: ran.append("layers.0.1")),
        blocks.layers[1].register_forward_pre_hook(lambda *_: ran.append("layers.1")),
    ]
    catcher = ModelIOCatcher(blocks, "cpu")
    x = torch.randn(1, 8)
    with catcher.from_spec("outputs[layers.0|layers.0.0]", early_exit=True) as buf:
        assert catcher.run(x) is None
    for handle in handles:
        handle.remove()
    assert ran == ["layers.0.0", "layers.0.1"]  # layers.1 never started
    with torch.no_grad():
        linear = blocks.layers[0][0](x)
    assert torch.equal(buf["layers.0.0"]["outputs"][0], linear)
    assert torch.equal(buf["layers.0"]["outputs"][0], torch.relu(linear))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.tail = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.first(x))


def test_a_requested_module_that_never_runs_lets_the_forward_complete() -> None:
    model = Branchy()
    catcher = ModelIOCatcher(model, "cpu")
    x = torch.randn(1, 4)
    with catcher.from_spec("outputs[first|unused]", early_exit=True) as buf:
        out = catcher.run(x)
    assert torch.equal(out, model.first(x)) and model.tail.calls == 1
    assert len(buf["first"]["outputs"]) == 1 and buf["unused"]["outputs"] == []


def test_early_exit_needs_run_and_says_so(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    with (
        catcher.from_spec("outputs[layers.0]", early_exit=True),
        pytest.raises(CaptureError, match="catcher.run"),
    ):
        blocks(torch.randn(1, 8))
    with catcher.from_spec("outputs[layers.0]", early_exit=False) as buf:
        blocks(torch.randn(1, 8))  # without early exit a direct call is fine
    assert len(buf["layers.0"]["outputs"]) == 1


class Swallower(nn.Module):
    def __init__(self, broad: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.tail = Counter()
        self.broad = broad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            x = self.first(x)
        except Exception:
            pass
        except BaseException:
            if not self.broad:
                raise
        return self.tail(x)


def test_model_code_catching_exception_cannot_swallow_the_stop() -> None:
    model = Swallower(broad=False)
    catcher = ModelIOCatcher(model, "cpu")
    with catcher.from_spec("outputs[first]", early_exit=True):
        assert catcher.run(torch.randn(1, 4)) is None
    assert model.tail.calls == 0


def test_a_model_swallowing_base_exceptions_gets_a_warning() -> None:
    model = Swallower(broad=True)
    catcher = ModelIOCatcher(model, "cpu")
    with (
        catcher.from_spec("outputs[first]", early_exit=True),
        pytest.warns(RuntimeWarning, match="swallowed"),
    ):
        catcher.run(torch.randn(1, 4))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.mid = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.mid(self.block(x)))


def test_shared_module_called_twice() -> None:
    model = Shared()
    catcher = ModelIOCatcher(model, "cpu")
    x = torch.randn(1, 4)
    with torch.no_grad():
        first = model.block(x)
        second = model.block(first)
    with catcher.from_spec("outputs[block]", early_exit=False) as buf:
        catcher.run(x)
    captured = buf["block"]["outputs"]
    assert len(captured) == 2
    assert torch.equal(captured[0], first) and torch.equal(captured[1], second)
    with catcher.from_spec("outputs[block|mid]", early_exit=True) as buf:
        assert catcher.run(x) is None  # stops at `mid`: the second call of `block` never happens
    assert len(buf["block"]["outputs"]) == 1 and torch.equal(buf["block"]["outputs"][0], first)


def test_unknown_names_and_empty_requests(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    with pytest.raises(KeyError, match="did you mean 'layers.1'.*lightning-iocatch modules"):
        catcher(outputs=["layer.1"])
    with pytest.raises(UnknownModuleError, match="glob 'heads.\\*' matches no module"):
        catcher.from_spec("outputs[heads.*]")
    with pytest.raises(ValueError, match="selects no module"):
        catcher.from_spec("inputs[]")
    with pytest.raises(ValueError, match="selects no module"):
        catcher()
    with pytest.raises(SpecError):
        catcher.from_spec("output[layers.0]")
    with pytest.raises(TypeError, match="from_spec"):
        catcher(outputs="layers.0")
    assert hook_count(blocks) == 0


def test_globs_in_a_session(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    with catcher.from_spec("outputs[layers.*]", early_exit=True) as buf:
        catcher.run(torch.randn(1, 8))
    assert list(buf) == [f"layers.{i}" for i in range(4)]
    assert blocks.tail.calls == 0
    with pytest.raises(UnknownModuleError, match="nothing was captured for 'layers.9'"):
        buf["layers.9"]


def test_dtype_option_casts_captures(blocks: Blocks) -> None:
    with ModelIOCatcher(blocks, "cpu", dtype=torch.float16)(outputs=["layers.0"]) as buf:
        blocks(torch.randn(1, 8))
    assert buf["layers.0"]["outputs"][0].dtype == torch.float16
    with pytest.raises(ValueError, match="floating-point"):
        ModelIOCatcher(blocks, "cpu", dtype=torch.int8)
    with ModelIOCatcher(blocks, "cpu", dtype="bfloat16")(outputs=["layers.0"]) as buf:
        blocks(torch.randn(1, 8))
    assert buf["layers.0"]["outputs"][0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"device": "cpux"}, ValueError, "`device` 'cpux' is not a device name"),
        ({"device": 3}, TypeError, "`device` must be a torch.device"),
        ({"dtype": "half-ish"}, ValueError, "`dtype` must be a floating-point"),
        ({"pinned_memory_bytes": -1}, ValueError, "`pinned_memory_bytes` must be >= 0"),
        ({"pinned_memory_bytes": 1.5}, TypeError, "`pinned_memory_bytes` must be an int"),
    ],
)
def test_bad_catcher_arguments_name_the_argument(
    blocks: Blocks, kwargs: dict, error: type, message: str
) -> None:
    options = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=message):
        ModelIOCatcher(blocks, **options)


def test_take_starts_a_fresh_buffer(blocks: Blocks) -> None:
    session = ModelIOCatcher(blocks, "cpu")(outputs=["layers.0"])
    with session:
        blocks(torch.randn(1, 8))
        first = session.take()
        blocks(torch.randn(1, 8))
        blocks(torch.randn(1, 8))
    assert len(first["layers.0"]["outputs"]) == 1
    assert len(session.buffer["layers.0"]["outputs"]) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outputs": ["layers.0"], "early_exit": "no"}, "`early_exit` must be True or False"),
        ({"outputs": ["layers.0"], "early_exit": 1}, "`early_exit` must be True or False"),
        ({"outputs": [1]}, "`outputs` must be a list of module names"),
        ({"outputs": None}, "`outputs` must be a list of module names"),
        ({"inputs": "layers.0"}, "`inputs` takes a list of names"),
    ],
)
def test_bad_session_arguments_name_the_argument(
    blocks: Blocks, kwargs: dict, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        ModelIOCatcher(blocks, "cpu")(**kwargs)


def test_a_generator_of_names_is_read_once(blocks: Blocks) -> None:
    session = ModelIOCatcher(blocks, "cpu")(outputs=(f"layers.{i}" for i in (0, 1)))
    assert session.outputs == ["layers.0", "layers.1"]
