"""batch_statistics (the monitor's statistics of small tensors, several in one call)
against NumPy float64 and against health_statistics of each tensor alone (bit for bit), on
the CPU's shortcut for all-finite values and on the general path (a GPU's), forced; and
the monitor's transform, which copies small tensors into blocks and reduces them later:
each placeholder reads the vector of its own tensor as it was captured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_iocatch.lightning.health_transform as health_transform
import lightning_iocatch.probes.health as health
from lightning_iocatch.capture.transform import Site
from lightning_iocatch.lightning.health_transform import StatisticsBlocks, _Statistics
from lightning_iocatch.probes.health import (
    EDGES,
    HEAD,
    batch_statistics,
    batched,
    health_statistics,
)
from tests.probes.test_health_accuracy import CASES as ACCURACY_CASES
from tests.probes.test_health_accuracy import check, normal, with_nonfinite

CASES = {  # every accuracy case batch_statistics takes, and the edges of its own
    **{name: make for name, make in ACCURACY_CASES.items() if batched(make())},
    "65,536 values": lambda: 7 + normal((256, 256)),
    "all equal": lambda: torch.full((5, 7), 1e4 + 0.1),
}


@pytest.fixture(params=["shortcut", "general"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "general":  # as on a GPU: no host sync to learn that all are finite
        monkeypatch.setattr(health, "_all_finite_batch", lambda absmax: False)
    return request.param


def siblings(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` and two other tensors of its shape and dtype, reduced with it in one call."""
    other = normal(tuple(x.shape), seed=3).to(x.dtype)
    return [x, (-2 * x.float()).to(x.dtype), other]


def block(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as ``[tensors, rows, units]`` float64, as the monitor's blocks hold them."""
    units = tensors[0].shape[-1] if tensors[0].dim() else 1
    return torch.stack([t.double().reshape(-1, units) for t in tensors])


@pytest.mark.parametrize("histogram", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_batched_statistics_equal_numpy_and_each_tensor_alone(
    case: str, histogram: bool, path: str
) -> None:
    tensors = siblings(CASES[case]())
    assert all(batched(t) for t in tensors)
    found = batch_statistics(block(tensors), histogram)
    lead = len(EDGES) + 2 if histogram else 0
    for x, vector in zip(tensors, found, strict=True):
        wide = x.double().reshape(x.shape or (1,)).numpy()
        check(torch.cat([vector[:HEAD], vector[HEAD + lead :]]), wide)  # NumPy float64
        alone = health_statistics(x, histogram=histogram)
        assert torch.equal(vector.isnan(), alone.isnan())
        assert torch.equal(vector.nan_to_num(), alone.nan_to_num())  # bit for bit
        if histogram:
            finite = np.abs(wide[np.isfinite(wide)])
            places = np.searchsorted(np.array(EDGES), finite, side="right")
            want = np.bincount(places, minlength=len(EDGES) + 1)
            np.testing.assert_array_equal(vector[HEAD : HEAD + len(EDGES) + 1].numpy(), want)
            assert vector[HEAD + len(EDGES) + 1].item() == pytest.approx(finite.sum(), rel=1e-12)


def test_batched_statistics_use_the_scratch_and_no_fresh_block() -> None:
    tensors = siblings(1 + normal((8, 16)))
    values, scratch = block(tensors), torch.empty(3, 8, 16, dtype=torch.float64)
    want = torch.stack([health_statistics(t) for t in tensors])
    assert torch.equal(batch_statistics(values, False, scratch), want)


def test_only_small_float_tensors_are_batched() -> None:
    assert batched(torch.zeros(256, 256)) and batched(torch.zeros(3, dtype=torch.bfloat16))
    assert not batched(torch.zeros(256, 257))  # beyond 65,536 values: reduced alone
    assert not batched(torch.zeros(4, dtype=torch.float64))  # its powers may overflow
    assert not batched(torch.zeros(0)) and not batched(torch.zeros(4, dtype=torch.int64))


def test_the_transform_reads_each_capture_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health_transform, "_BLOCK", 4)  # blocks fill and are reduced early
    rows = torch.arange(6)[None, :] < torch.tensor([[6], [2], [4]])  # (batch, sequence)
    scale = torch.tensor([256.0], dtype=torch.float64)
    blocks = StatisticsBlocks()
    for step in range(2):  # the second step reuses the first one's blocks
        statistics = _Statistics(rows, histogram=False, blocks=blocks)
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(11):
            kind = "grad_outputs" if i % 3 == 0 else "outputs"
            statistics.scale = scale if kind == "grad_outputs" else None
            shape = (3, 6, 8) if i % 2 else (5, 8)  # masked rows, or every row
            x = with_nonfinite(normal(shape, seed=10 * step + i)) if i == 7 else normal(shape, i)
            held = statistics.capture(x, Site(f"m{i}", kind, 0))  # type: ignore[arg-type]
            mask = rows if x.dim() == 3 else None
            alone = health_statistics(x, mask)
            if kind == "grad_outputs":
                alone = health_transform._unscaled(alone, scale)
            x.mul_(0)  # the model goes on in place: the capture keeps what it saw
            captured.append((held, alone))
        big = normal((300, 300))
        assert statistics.capture(big, Site("big", "outputs", 0)).dtype == torch.float64
        ints = statistics.capture(torch.ones(3, dtype=torch.int64), Site("i", "outputs", 0))
        assert ints.numel() == 0
        for held, alone in captured:
            assert held.dtype == torch.int64  # a place, reduced when read
            got = statistics.vector(held)
            assert torch.equal(got.nan_to_num(), alone.nan_to_num())
            assert torch.equal(got.isnan(), alone.isnan())
        assert list(statistics.order) == [
            f"m{i}/outputs" if i % 3 else f"m{i}/grad_outputs" for i in range(11)
        ] + ["big/outputs", "i/outputs"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES)
def test_batched_statistics_on_a_gpu_equal_numpy(case: str) -> None:
    tensors = [t.cuda() for t in siblings(CASES[case]())]
    statistics = _Statistics(None, histogram=False)
    held = [statistics.capture(t, Site(f"m{i}", "outputs", 0)) for i, t in enumerate(tensors)]
    assert all(h.device.type == "cpu" for h in held)  # places: no transfer, no sync
    for x, place in zip(tensors, held, strict=True):
        check(statistics.vector(place).cpu(), x.double().reshape(x.shape or (1,)).cpu().numpy())
