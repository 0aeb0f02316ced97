"""The GPU path without a GPU: the pinned ring's accounting, the ordering of the copies
(with CPU fakes of the CUDA calls that defer the side-stream copy, as a GPU would), and
the fallback. The same code runs on a GPU in tests/gpu/."""

from __future__ import annotations

import copy
import io
import itertools
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_iocatch import ModelIOCatcher
from lightning_iocatch.capture.host_copy import CudaOps
from lightning_iocatch.capture.pinned_ring import PinnedRing, StagedCopy
from lightning_iocatch.capture.snapshots import CaptureTransfer


def plain_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class DeferredCopy:
    """A fake CUDA event: the side-stream copy lands only when it is waited for, as the
    kernel enqueued then (in the inference mode of that moment) would have written it."""

    def __init__(self, log: list[str], staging: torch.Tensor, source: torch.Tensor) -> None:
        self.log, self.staging, self.source = log, staging, source
        self.inference = torch.is_inference_mode_enabled()
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1
        if self.waited == 1:
            with torch.inference_mode(self.inference):
                self.staging.copy_(self.source)
            self.log.append("copy landed")


class FakeCudaOps(CudaOps):
    """CPU tensors play device tensors; the model's stream runs at once, the side stream
    only when its event is waited for: the latest a real GPU may run it."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.events: list[DeferredCopy] = []

    def is_source(self, tensor: torch.Tensor) -> bool:
        return True

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.ring_buffer = plain_bytes(nbytes)
        return self.ring_buffer

    def snapshot(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self.log.append("snapshot")
        return super().snapshot(tensor, dtype)

    def copy_to_host(self, staging: torch.Tensor, snapshot: torch.Tensor) -> Any:
        self.log.append("copy enqueued")
        self.events.append(DeferredCopy(self.log, staging, snapshot))
        return self.events[-1]


class InPlaceAfter(nn.Module):
    """Captured ``block`` followed by in-place ops on its output and on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        out += 100.0  # like `out += identity` after a ResNet block's last batch norm
        x.mul_(-1.0)  # a module changing its input
        return self.act(out)


def synchronous_truth(model: InPlaceAfter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seen: list[torch.Tensor] = []
    handles = [
        model.block.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone())),
        model.block.register_forward_hook(lambda m, a, out: seen.append(out.clone())),
    ]
    model(x.clone())
    for handle in handles:
        handle.remove()
    return seen[0], seen[1]


def test_in_place_ops_after_the_hook_never_reach_a_capture() -> None:
    torch.manual_seed(0)
    model = InPlaceAfter()
    ops = FakeCudaOps()
    catcher = ModelIOCatcher(model, "cpu")
    catcher.transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=1 << 16, ops=ops)
    xs = [torch.randn(4, 8) for _ in range(50)]
    with torch.no_grad(), catcher(inputs=["block"], outputs=["block"]) as buf:
        for x in xs:
            model(x.clone())
        assert "copy landed" not in ops.log  # every copy still "in flight" after the forwards
    with torch.no_grad():
        truth = [synchronous_truth(model, x) for x in xs]
    for i, (expected_in, expected_out) in enumerate(truth):
        assert torch.equal(buf["block"]["inputs"][i]["args"][0], expected_in)
        assert torch.equal(buf["block"]["outputs"][i], expected_out)
    assert ops.log[:2] == ["snapshot", "copy enqueued"]


def test_copies_read_the_snapshot_not_the_models_tensor() -> None:
    ops = FakeCudaOps()
    transfer = CaptureTransfer(torch.device("cpu"), torch.float16, pinned_bytes=4096, ops=ops)
    live = torch.arange(6.0)
    (copied,), pending, _ = transfer((live,))
    live.zero_()  # the model's next kernel, before the copy "runs"
    for staged in pending:
        staged.synchronize()
    assert torch.equal(copied, torch.arange(6.0, dtype=torch.float16))
    assert not _inside(copied, ops.ring_buffer)  # consumers never hold ring memory


def _inside(tensor: torch.Tensor, ring: torch.Tensor) -> bool:
    start = ring.data_ptr()
    return start <= tensor.data_ptr() < start + ring.numel()


def test_a_full_ring_waits_only_for_the_oldest_copy_and_never_sleeps(monkeypatch: Any) -> None:
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("slept on a timer"))
    ops = FakeCudaOps()
    transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=1024, ops=ops)  # 4 x 256
    kept = []  # a consumer that keeps every capture forever
    for i in range(20):
        (value,), _, _ = transfer((torch.full((64,), float(i)),))  # 256 bytes each
        kept.append(value)
        waited = [event.waited for event in ops.events]
        assert waited[: max(0, i - 3)] == [1] * max(0, i - 3)  # the oldest, once each
        assert all(w == 0 for w in waited[max(0, i - 3) :])  # never a newer one
    assert transfer.host is not None and transfer.host.ring.waits == 16
    for staged in list(transfer.host.ring._fifo):
        staged.synchronize()
    assert [float(v[0]) for v in kept] == [float(i) for i in range(20)]
    assert transfer.host.ring.in_flight_bytes == 0


def test_a_tensor_larger_than_the_ring_is_copied_synchronously() -> None:
    ops = FakeCudaOps()
    transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=256, ops=ops)
    big = torch.arange(100.0)  # 400 bytes
    (copied,), pending, _ = transfer((big,))
    assert pending == [] and ops.events == [] and torch.equal(copied, big)
    assert copied.data_ptr() != big.data_ptr()
    assert CaptureTransfer(torch.device("cpu"), pinned_bytes=0).host is None


def test_staged_copies_survive_being_waited_for_out_of_order() -> None:
    ring = PinnedRing(1024, allocate=plain_bytes)
    log: list[str] = []
    copies: list[tuple[StagedCopy, torch.Tensor, torch.Tensor]] = []
    for i in range(4):
        staged, staging = ring.stage(torch.Size([64]), torch.float32)
        destination = torch.empty(64)
        staged.start(staging, destination, DeferredCopy(log, staging, torch.full((64,), i)))
        copies.append((staged, staging, destination))
    copies[2][0].synchronize()  # a later copy first: its region stays held until 0 and 1
    assert ring.in_flight_bytes == 768
    staged, staging = ring.stage(torch.Size([64]), torch.float32)  # waits for copy 0 only
    assert copies[0][0].done and not copies[1][0].done and ring.waits == 1
    assert [float(d[0]) for c, _, d in copies if c.done] == [0.0, 2.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 700), st.booleans()), min_size=1, max_size=40))
def test_live_regions_never_overlap_and_stay_inside_the_ring(steps: list[Any]) -> None:
    ring = PinnedRing(1000, align=64, allocate=plain_bytes)
    live: list[StagedCopy] = []
    for nbytes, finish_one in steps:
        staged, staging = ring.stage(torch.Size([nbytes]), torch.uint8)
        staged.start(
            staging, torch.empty(nbytes, dtype=torch.uint8), DeferredCopy([], staging, staging)
        )
        live = [c for c in live if not c.done] + [staged]
        spans = sorted((c.offset, c.offset + c.nbytes) for c in live)
        assert all(a >= 0 and b <= 1000 for a, b in spans)
        assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(spans))
        assert ring.in_flight_bytes <= 1000
        if finish_one and len(live) > 1:
            live[len(live) // 2].synchronize()


def test_a_copy_that_fails_before_it_starts_gives_its_region_back() -> None:
    class Failing(FakeCudaOps):
        fail = True

        def copy_to_host(self, staging: torch.Tensor, snapshot: torch.Tensor) -> Any:
            if self.fail:
                self.fail = False
                raise RuntimeError("CUDA out of memory (simulated)")
            return super().copy_to_host(staging, snapshot)

    ops = Failing()
    transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=512, ops=ops)  # 2 x 256
    with pytest.raises(RuntimeError, match="simulated"):
        transfer((torch.zeros(64),))
    assert transfer.host is not None and transfer.host.ring.in_flight_bytes == 0
    kept = []
    for i in range(6):  # the ring must wrap past the failed region without waiting on it
        (value,), pending, _ = transfer((torch.full((64,), float(i)),))
        kept.append((value, pending))
    for _, pending in kept:
        for staged in pending:
            staged.synchronize()
    assert [float(v[0]) for v, _ in kept] == [float(i) for i in range(6)]


def test_tensors_that_are_not_dense_take_the_synchronous_path() -> None:
    ops = FakeCudaOps()
    transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=4096, ops=ops)
    sparse = torch.eye(4).to_sparse()
    (copied,), pending, _ = transfer((sparse,))
    assert pending == [] and ops.events == [] and copied.is_sparse
    assert torch.equal(copied.to_dense(), torch.eye(4))


def fake_catcher(model: nn.Module, ops: FakeCudaOps, pinned_bytes: int = 1 << 16) -> Any:
    catcher = ModelIOCatcher(model, "cpu")
    catcher.transfer = CaptureTransfer(torch.device("cpu"), pinned_bytes=pinned_bytes, ops=ops)
    return catcher


def test_a_capture_made_in_inference_mode_is_read_after_the_block() -> None:
    """Lightning's predict and evaluation loops run under ``torch.inference_mode()``: before,
    the ring and the captured tensor were inference tensors filled in place after the block,
    and reading raised ``Inplace update to inference tensor outside InferenceMode``."""
    torch.manual_seed(0)
    model = InPlaceAfter()
    catcher = fake_catcher(model, FakeCudaOps())
    xs = [torch.randn(4, 8) for _ in range(3)]
    with catcher(outputs=["block"]) as buf:
        with torch.inference_mode():  # the ring is allocated here, on first use
            for x in xs:
                model(x.clone())
        model(xs[0].clone())  # outside inference mode, through the same ring
    with torch.no_grad():
        truth = [synchronous_truth(model, x)[1] for x in [*xs, xs[0]]]
    got = buf["block"]["outputs"]  # read after the block, outside inference mode
    assert [torch.equal(a, b) for a, b in zip(got, truth, strict=True)] == [True] * 4
    synchronous = ModelIOCatcher(model, "cpu", pinned_memory_bytes=0)
    with synchronous(outputs=["block"]) as plain, torch.inference_mode():
        model(xs[0].clone())
    # as on the synchronous path: a capture made in inference mode is an inference tensor
    assert [value.is_inference() for value in got] == [True, True, True, False]
    assert plain["block"]["outputs"][0].is_inference()


def test_a_buffer_with_copies_in_flight_pickles_and_deep_copies() -> None:
    """``torch.save(buf)`` and ``copy.deepcopy(buf)`` settle first; before, they raised
    ``cannot pickle '_thread.RLock' object`` (the pending copies hold the ring's lock)."""
    torch.manual_seed(0)
    model = InPlaceAfter()
    ops = FakeCudaOps()
    catcher = fake_catcher(model, ops)
    x = torch.randn(4, 8)
    with torch.no_grad(), catcher(outputs=["block"]):
        model(x.clone())
        session = catcher.session
        assert session is not None and not session.buffer.settled
        saved = io.BytesIO()
        torch.save(session.buffer, saved)
        copied = copy.deepcopy(session.buffer)
        assert "copy landed" in ops.log
    with torch.no_grad():
        truth = synchronous_truth(model, x)[1]
    saved.seek(0)
    for buffer in (torch.load(saved, weights_only=False), copied, session.buffer):
        assert torch.equal(buffer["block"]["outputs"][0], truth)
