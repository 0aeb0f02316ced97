"""A batch's transform is applied to each gradient as it arrives, in its backward's state.

The truth: the gradients of the same small network taken with ``torch.autograd.grad``
on plain tensors, multiplied by hand by the factor the transform held at each backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher
from lightning_iocatch.capture.transform import Site


class Times:
    """Multiplies gradients by ``factor`` as it is when the transform is applied; counts
    the values it saw."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.seen: list[Site] = []

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor | None:
        self.seen.append(site)
        return tensor * self.factor if site.kind.startswith("grad_") else None


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _true_grad(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    hidden = net[0](x).detach().requires_grad_()
    (grad,) = torch.autograd.grad(net[2](net[1](hidden)).sum(), hidden)
    return grad


def test_each_backward_is_transformed_in_its_own_state() -> None:
    """Two forwards and backwards in one batch, the transform's factor changed between
    them (as a GradScaler's scale changes between two optimizer steps): each call's
    gradient is multiplied by the factor of its own backward, not the last one."""
    net, times = _net(), Times()
    x = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    truth = [_true_grad(net, one) for one in x]
    catcher = ModelIOCatcher(net, "cpu")
    with catcher.from_spec("grad_outputs[0]", transform=times):
        for factor, one in zip((2.0, 8.0), x, strict=True):
            times.factor = factor
            net(one).sum().backward()
        times.factor = 1000.0  # at the batch's end: no longer the backwards' factor
        taken = catcher.session.take()  # type: ignore[union-attr]
    got = taken["0"]["grad_outputs"]
    torch.testing.assert_close(got[0], truth[0] * 2.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], truth[1] * 8.0, rtol=1e-6, atol=0)
    assert taken.transformed_keys() == {"0/grad_outputs", "0/grad_outputs@1"}
    assert [(s.kind, s.call) for s in times.seen] == [("grad_outputs", 0), ("grad_outputs", 1)]


def test_a_site_no_gradient_reached_is_zeros_through_the_transform() -> None:
    """A call off the loss' path gets zeros, through the transform like any gradient."""
    net, times = _net(), Times()
    catcher = ModelIOCatcher(net, "cpu")
    x = torch.randn(2, 3)
    with catcher.from_spec("grad_outputs[0]", transform=times):
        times.factor = 3.0
        net(x).sum().backward()
        net[0](x)  # a second call of `0`, whose output the loss does not use
        taken = catcher.session.take()  # type: ignore[union-attr]
    got = taken["0"]["grad_outputs"]
    torch.testing.assert_close(got[0], _true_grad(net, x) * 3.0, rtol=1e-6, atol=0)
    assert torch.equal(got[1], torch.zeros(2, 4))
    assert taken.transformed_keys() == {"0/grad_outputs", "0/grad_outputs@1"}


def test_two_backwards_of_one_forward_under_a_transform_are_left_out_with_a_warning() -> None:
    """The transform of a sum is not the sum of the transforms: with a transform, a call
    that two backwards reach (retain_graph) is warned about and not captured; without
    one, its gradients are summed as before."""
    net, x = _net(), torch.randn(2, 3)
    truth = _true_grad(net, x)
    for transform in (Times(), None):
        catcher = ModelIOCatcher(net, "cpu")
        with catcher.from_spec("grad_outputs[0]", transform=transform):
            loss = net(x).sum()
            loss.backward(retain_graph=True)
            loss.backward()
            if transform is None:
                taken = catcher.session.take()  # type: ignore[union-attr]
                torch.testing.assert_close(taken["0"]["grad_outputs"][0], 2 * truth)
                continue
            with pytest.warns(UserWarning, match=r"0/grad_outputs.*several backwards"):
                taken = catcher.session.take()  # type: ignore[union-attr]
            assert len(taken["0"]["grad_outputs"]) == 0
