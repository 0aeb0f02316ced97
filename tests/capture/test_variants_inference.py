"""Variants under ``torch.inference_mode`` (as in Lightning's validation loop): the calls
are still replayed, from private copies of the inference tensors, and every variant equals
hand-written hooks, also where a module returns its input (an alias a copy would break) and
the forward then writes into it in place.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher, Steer, Zero
from lightning_iocatch.capture.variants import Variants
from tests.capture.test_variants import by_hand


class Aliasing(nn.Module):
    """``keep`` returns its input itself; the forward doubles it in place, so ``a``'s
    output is doubled too, and ``b`` reads it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.a = nn.Sequential(nn.Linear(4, 4))  # a replayed call runs nothing inside it
        self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.keep = nn.Identity()
        self.computed = 0
        self.a[0].register_forward_pre_hook(lambda *_: setattr(self, "computed", self.computed + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = self.keep(h)
        g.mul_(2.0)
        return self.head(torch.tanh(self.b(h)) + g)


def test_inference_mode_forwards_are_replayed_and_equal_the_truth():
    net, x = Aliasing().eval(), torch.randn(3, 4)
    variants = {"steer": [Steer("head", torch.ones(4), kind="inputs")], "zero": [Zero("b")]}
    runner = Variants(ModelIOCatcher(net, "cpu"), variants)
    with torch.inference_mode():
        outputs = runner(lambda: net(x.clone()))
    hooks = {
        "clean": [],
        "steer": [(net.head, "inputs", lambda h: h + 1.0)],
        "zero": [(net.b, "outputs", torch.zeros_like)],
    }
    for name, edits in hooks.items():
        assert torch.equal(outputs[name], by_hand(net, edits, lambda: net(x.clone()))), name
    assert outputs["clean"].is_inference()
    assert runner.fallbacks == []
    assert net.computed == 1 + 3  # a computed once, then in the 3 forwards of the truth
