"""CaptureBuffer: no way of reading it can see a value whose asynchronous copy is not done."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_iocatch import CaptureBuffer, ModelIOCatcher
from tests.conftest import Blocks


class FakeCopy:
    """Stands for a CUDA event of a device-to-host copy into ``host``.

    Until ``synchronize()`` the destination holds garbage (NaN); the copy completes then.
    """

    def __init__(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.host, self.source = host, source
        host.fill_(float("nan"))

    def synchronize(self) -> None:
        self.host.copy_(self.source)


def pending_buffer() -> tuple[CaptureBuffer, torch.Tensor, list[Any]]:
    buffer = CaptureBuffer.empty(["m"])
    early = buffer["m"]["outputs"]  # a list taken out before the capture
    source = torch.arange(4.0)
    host = torch.empty(4)
    buffer.add("m", "outputs", host, [FakeCopy(host, source)])
    return buffer, source, early


READS: dict[str, Callable[[CaptureBuffer], Any]] = {
    "getitem": lambda b: b["m"]["outputs"],
    "get": lambda b: b.get("m")["outputs"],
    "dict()": lambda b: dict(b)["m"]["outputs"],
    "{**buf}": lambda b: {**b}["m"]["outputs"],
    "copy()": lambda b: b.copy()["m"]["outputs"],
    "items()": lambda b: dict(b.items())["m"]["outputs"],
    "values()": lambda b: next(iter(b.values()))["outputs"],
    "iteration": lambda b: next(b[name] for name in b)["outputs"],
    "repr then list": lambda b: (repr(b), b["m"]["outputs"])[1],
}


@pytest.mark.parametrize("how", list(READS))
def test_every_read_path_sees_only_completed_copies(how: str) -> None:
    buffer, source, _ = pending_buffer()
    values = READS[how](buffer)
    assert len(values) == 1 and torch.equal(values[0], source)


def test_a_list_taken_before_the_capture_never_holds_an_incomplete_value() -> None:
    buffer, source, early = pending_buffer()
    assert early == []  # the capture is not part of the buffer until its copy completed
    buffer.settle()
    assert len(early) == 1 and torch.equal(early[0], source)


def test_the_buffer_is_a_read_only_mapping_not_a_dict() -> None:
    buffer, _, _ = pending_buffer()
    # dict's C-level fast paths (dict.__getitem__, dict(buf) on a subclass) would skip the wait
    assert not isinstance(buffer, dict)
    with pytest.raises(TypeError):
        dict.__getitem__(buffer, "m")  # type: ignore[index]
    assert not hasattr(buffer, "pop") and not hasattr(buffer, "__setitem__")


def test_captures_keep_their_order_when_copies_complete_late() -> None:
    buffer = CaptureBuffer.empty(["m"])
    first, late, third = torch.zeros(1), torch.empty(1), torch.full((1,), 2.0)
    buffer.add("m", "outputs", first)
    buffer.add("m", "outputs", late, [FakeCopy(late, torch.ones(1))])
    buffer.add("m", "outputs", third)  # no copy of its own, but after one still pending
    assert [float(v) for v in buffer["m"]["outputs"]] == [0.0, 1.0, 2.0]


def test_take_hands_out_a_settled_buffer_and_continues_in_a_fresh_one(blocks: Blocks) -> None:
    catcher = ModelIOCatcher(blocks, "cpu")
    session = catcher.from_spec("outputs[layers.0]")
    with session:
        blocks(torch.randn(2, 8))
        taken = session.take()
        blocks(torch.randn(2, 8))
    assert taken.settled and len(taken["layers.0"]["outputs"]) == 1
    assert session.buffer is not taken and len(session.buffer["layers.0"]["outputs"]) == 1
