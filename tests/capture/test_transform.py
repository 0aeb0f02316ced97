"""transform.py: the seam where a session changes what it captures, batch by batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_iocatch.capture import ModelIOCatcher
from lightning_iocatch.capture.snapshots import CaptureTransfer
from lightning_iocatch.capture.transform import Site
from tests.capture.test_pinned_ring import FakeCudaOps


class TwiceCalled(nn.Module):
    """A shared block called twice in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        hidden = self.block(x)
        return self.block(hidden)


class Halves:
    """Keeps the first half of the rows of every tensor with an even number of rows, and
    records where it was asked."""

    def __init__(self) -> None:
        self.sites: list[Site] = []

    def capture(self, tensor: torch.Tensor, site: Site) -> torch.Tensor | None:
        self.sites.append(site)
        return tensor[: tensor.shape[0] // 2] if tensor.shape[0] % 2 == 0 else None


def test_each_batch_carries_its_transform_and_the_keys_it_changed() -> None:
    torch.manual_seed(0)
    model = TwiceCalled()
    catcher = ModelIOCatcher(model, "cpu")
    first, second = Halves(), Halves()
    x = torch.randn(4, 4)
    with torch.no_grad(), catcher(inputs=["block"], outputs=["block"], transform=first):
        session = catcher.session
        assert session is not None
        model(x)
        batch_one = session.take(transform=second)  # the next batch: its own transform
        model(x[:3])  # three rows: the transform leaves them as they are
        batch_two = session.take()
        model(x)
        batch_three = session.take()
    with torch.no_grad():
        hidden = model.block(x)
        out = model.block(hidden)
    assert batch_one.transform is first and batch_two.transform is second
    assert torch.equal(batch_one["block"]["outputs"][0], hidden[:2])
    assert torch.equal(batch_one["block"]["outputs"][1], out[:2])
    assert torch.equal(batch_one["block"]["inputs"][1]["args"][0], hidden[:2])
    assert batch_one.transformed_keys() == {
        "block/inputs/args/0",
        "block/inputs@1/args/0",
        "block/outputs",
        "block/outputs@1",
    }
    assert [(s.kind, s.call) for s in first.sites] == [
        ("inputs", 0),
        ("outputs", 0),
        ("inputs", 1),
        ("outputs", 1),
    ]
    assert batch_two.transformed_keys() == set() and batch_two["block"]["outputs"][0].shape[0] == 3
    assert batch_three.transform is None and batch_three["block"]["outputs"][0].shape[0] == 4


def test_transformed_keys_hold_for_copies_still_in_flight() -> None:
    """On the asynchronous path the keys are recorded as the values are settled."""
    model = TwiceCalled()
    catcher = ModelIOCatcher(model, "cpu")
    catcher.transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=4096, ops=FakeCudaOps())
    with torch.no_grad(), catcher(outputs=["block"], transform=Halves()) as buf:
        model(torch.randn(2, 4))
        assert not buf.settled
    assert buf.transformed_keys() == {"block/outputs", "block/outputs@1"}
    assert [tuple(v.shape) for v in buf["block"]["outputs"]] == [(1, 4), (1, 4)]


def test_a_transform_without_a_capture_method_is_refused() -> None:
    import pytest

    with pytest.raises(TypeError, match=r"`transform` must have a `capture\(tensor, site\)`"):
        ModelIOCatcher(nn.Linear(2, 2), "cpu")(outputs=[""], transform=lambda t: t)  # type: ignore[arg-type]
