"""Variants leaves the model as it found it: a TorchScript part runs every variant whole
(it takes no hooks), and no hook or swapped forward outlives a failure anywhere.

The truth: hand-written hooks on the same model; the model's hook dictionaries, the global
hooks and the modules' own ``forward`` attributes counted before and after.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

from lightning_iocatch.capture import ModelIOCatcher, Zero
from lightning_iocatch.capture.variants import Variants
from tests.capture.test_variants import by_hand


class Scripted(nn.Module):
    """A model holding a TorchScript submodule between two plain ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.s = torch.jit.script(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.s(self.a(x))))


def hooks(model: nn.Module) -> tuple[int, int, int, int]:
    """Hooks on the model's modules, modules with a forward of their own, global hooks."""
    plain = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
    return (
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in plain),
        sum("forward" in m.__dict__ for m in plain),
        len(module_globals._global_forward_hooks),
        len(module_globals._global_forward_pre_hooks),
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_submodule_runs_every_variant_whole_once_said_and_leaves_no_hook():
    net, x = Scripted().eval(), torch.randn(3, 4)
    before = hooks(net)
    runner = Variants(
        ModelIOCatcher(net, "cpu"), {"z": [Zero("a")], "zb": [Zero("b", kind="inputs")]}
    )
    with pytest.warns(UserWarning, match="TorchScript") as said:
        outputs = runner(lambda: net(x))
        outputs = runner(lambda: net(x))
    assert len([w for w in said if "TorchScript" in str(w.message)]) == 1
    assert "module 's'" in runner.fallbacks[0]
    assert torch.equal(outputs["clean"], by_hand(net, [], lambda: net(x)))
    assert torch.equal(outputs["z"], by_hand(net, [(net.a, "outputs", torch.zeros_like)],
                                             lambda: net(x)))  # fmt: skip
    assert torch.equal(outputs["zb"], torch.zeros(3, 4) @ net.b.weight.T + net.b.bias)
    assert hooks(net) == before == (0, 0, 0, 0)


class Refusing(nn.Linear):
    """A module that refuses forward hooks (as a TorchScript module does)."""

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("register_forward_hook is not supported here")


@pytest.mark.parametrize("where", ["clean", "variant", "second_variant", "registering"])
def test_no_hook_outlives_a_failure(where: str):
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    if where == "registering":
        net[3] = Refusing(4, 2).eval()
    x = torch.randn(3, 4)
    before = hooks(net)
    fail_at = {"clean": 1, "variant": 2, "second_variant": 3, "registering": 0}[where]
    forwards = [0]

    def forward() -> Any:
        forwards[0] += 1
        out = net(x)
        if forwards[0] == fail_at:
            raise ValueError("a forward failed")
        return out

    runner = Variants(ModelIOCatcher(net, "cpu"), {"a": [Zero("2")], "b": [Zero("1")]})
    with pytest.raises((ValueError, RuntimeError), match="failed|not supported"):
        runner(forward)
    assert hooks(net) == before == (0, 0, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = net(x)  # the model computes as before
    assert torch.equal(after, by_hand(net, [], lambda: net(x)))
