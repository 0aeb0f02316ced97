"""Wrapped models: activation checkpointing and FSDP wrappers, captured by plain names.

Ground truth is a hand-written hook on the same layers of the unwrapped model.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from lightning_iocatch import ModelIOCatcher, UnknownModuleError
from tests.conftest import Blocks, hook_count

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = ("layers.1", "layers.1.0", "layers.3")
INPUTS = ("layers.2",)


def hand_hooked_run(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outputs of ``OUTPUTS`` and first inputs of ``INPUTS`` from hooks written by hand."""
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str) -> Any:
        return lambda module, args, output=None: seen.setdefault(
            key, (output if output is not None else args[0]).detach().clone()
        )

    handles = [model.get_submodule(n).register_forward_hook(keep(f"out:{n}")) for n in OUTPUTS]
    handles += [model.get_submodule(n).register_forward_pre_hook(keep(f"in:{n}")) for n in INPUTS]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def captured(buf: Any) -> dict[str, torch.Tensor]:
    found = {f"out:{n}": buf[n]["outputs"][0] for n in OUTPUTS}
    found.update({f"in:{n}": buf[n]["inputs"][0]["args"][0] for n in INPUTS})
    return found


def checkpointed(model: Blocks, impl: CheckpointImpl) -> Blocks:
    """``model`` with every layer wrapped by ``checkpoint_wrapper`` (in place)."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    return model


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_checkpoint_wrapped_layers_capture_by_plain_names_like_hand_hooks(
    impl: CheckpointImpl,
) -> None:
    torch.manual_seed(0)
    model = Blocks()
    plain_names = [name for name, _ in model.named_modules()]
    layer_1 = model.layers[1]
    x = torch.randn(3, 8, requires_grad=True)  # reentrant checkpointing wants one
    expected = hand_hooked_run(model, x)
    model = checkpointed(model, impl)
    assert "layers.1._checkpoint_wrapped_module.0" in dict(model.named_modules())
    catcher = ModelIOCatcher(model, "cpu")
    assert catcher.module_names == plain_names
    with catcher(inputs=list(INPUTS), outputs=list(OUTPUTS)) as buf:
        assert len(layer_1._forward_hooks) == 1, "the hook belongs on the layer that runs"
        model(x)
    assert captured(buf).keys() == expected.keys()
    for key, value in captured(buf).items():
        assert torch.equal(value, expected[key]), key
    with catcher(outputs=["layers.1._checkpoint_wrapped_module", "layers.2"], early_exit=True):
        assert catcher.run(x) is None  # a spelling with the wrapper is the same layer
    assert hook_count(model) == 0


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_checkpoint_recomputation_in_backward_adds_no_capture(impl: CheckpointImpl) -> None:
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(3, 8, requires_grad=True)
    expected = hand_hooked_run(model, x)
    model = checkpointed(model, impl)
    with ModelIOCatcher(model, "cpu")(inputs=list(INPUTS), outputs=list(OUTPUTS)) as buf:
        model(x).sum().backward()  # backward re-runs every checkpointed layer
    assert all(len(buf[n]["outputs"]) == 1 for n in OUTPUTS)
    assert all(len(buf[n]["inputs"]) == 1 for n in INPUTS)
    for key, value in captured(buf).items():
        assert torch.equal(value, expected[key]), key


def test_unknown_name_in_wrapped_model_suggests_the_plain_name_with_the_same_index() -> None:
    model = checkpointed(Blocks(depth=12), CheckpointImpl.NO_REENTRANT)
    catcher = ModelIOCatcher(model, "cpu")
    with pytest.raises(UnknownModuleError, match=r"did you mean 'layers\.1'\?"):
        catcher(outputs=["layer.1"])
    with pytest.raises(UnknownModuleError, match=r"'layers' has 0\.\.11, not 12") as info:
        catcher(outputs=["layers.12"])
    assert "did you mean" not in str(info.value)


def _fsdp_worker(out: str, store: str) -> None:
    """Run in a fresh process: FSDP on CPU in a 1-process gloo group, with checkpointing."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Blocks()
        plain_names = [name for name, _ in model.named_modules()]
        x = torch.randn(3, 8)
        expected = hand_hooked_run(copy.deepcopy(model), x)
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), device_id="cpu"
        )
        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, nn.Sequential))
        raw_names = [name for name, _ in wrapped.named_modules()]
        catcher = ModelIOCatcher(wrapped, "cpu")
        with catcher(inputs=list(INPUTS), outputs=list(OUTPUTS)) as buf:
            wrapped(x)
        torch.save(
            {
                "plain_names": plain_names,
                "raw_names": raw_names,
                "module_names": catcher.module_names,
                "expected": expected,
                "captured": captured(buf),
                "hooks_left": hook_count(wrapped),
            },
            out,
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_and_checkpoint_wrapped_layers_capture_by_plain_names(tmp_path: Path) -> None:
    out, store = tmp_path / "fsdp.pt", tmp_path / "store"
    code = (
        "import sys; from tests.capture.test_wrapped_names import _fsdp_worker as w; "
        "w(*sys.argv[1:])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(out), str(store)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = torch.load(out)
    assert any(
        "_fsdp_wrapped_module" in n and "_checkpoint_wrapped_module" in n
        for n in found["raw_names"]
    )
    assert found["module_names"] == found["plain_names"]
    assert found["captured"].keys() == found["expected"].keys()
    for key, value in found["captured"].items():
        assert torch.equal(value, found["expected"][key]), key
    assert found["hooks_left"] == 0
