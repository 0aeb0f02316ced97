"""health_statistics against NumPy float64 on hard inputs: a large mean (the centring
matters), values of 1e-20 and 1e20, float16 and bfloat16, NaN and inf mixed in, masked
rows, an empty selection. The documented tolerance: mean within ``1e-6`` of the RMS,
the third centred sum within ``1e-6`` of the sum of ``|x - mean|**3``, RMS, the other
centred sums and kurtosis within a relative ``1e-6``, max ``|x|`` and counts exact.
Each case runs in float32 arithmetic (tensors of more than 65,536 values) and in float64
(smaller ones), each on the CPU's shortcut for all-finite values and on the general path
(the only one on other devices), forced."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lightning_iocatch.probes.health as health
from lightning_iocatch.probes.health import EDGES, HEAD, HealthFigures, health_statistics

TOLERANCE = 1e-6


def truth(x: np.ndarray) -> dict[str, object]:
    """The statistics of ``x`` (rows of units in the last dimension) from their definitions."""
    x = x.astype(np.float64).reshape(-1, x.shape[-1])
    finite = np.isfinite(x)
    v = x[finite]
    n = v.size
    mean = v.mean() if n else 0.0
    c = v - mean
    return {
        "count": n,
        "mean": mean,
        "m2": (c**2).sum(),
        "m3": (c**3).sum(),
        "m4": (c**4).sum(),
        "m3_scale": (np.abs(c) ** 3).sum(),  # a signed sum: its error is measured against this
        "absmax": np.abs(v).max() if n else 0.0,
        "nan": int(np.isnan(x).sum()),
        "inf": int(np.isinf(x).sum()),
        "nonzero": ((x != 0) & finite).sum(0),
        "rms": math.sqrt((v**2).mean()) if n else math.nan,
    }


def check(vector: torch.Tensor, x: np.ndarray) -> None:
    """``vector`` against the truth of ``x`` to the documented tolerance."""
    assert vector.dtype == torch.float64
    want = truth(x)
    got = vector.numpy()
    count, mean, m2, m3, m4, absmax, nan, inf = got[:HEAD]
    assert (count, absmax, nan, inf) == (want["count"], want["absmax"], want["nan"], want["inf"])
    np.testing.assert_array_equal(got[HEAD:], want["nonzero"])
    if not count:
        assert (mean, m2, m3, m4) == (0, 0, 0, 0)
        return
    scale = want["rms"]
    assert abs(mean - want["mean"]) <= TOLERANCE * scale
    assert m2 == pytest.approx(want["m2"], rel=TOLERANCE, abs=1e-300)
    assert abs(m3 - want["m3"]) <= TOLERANCE * want["m3_scale"]
    assert m4 == pytest.approx(want["m4"], rel=TOLERANCE, abs=1e-300)
    figures = HealthFigures.of(vector)
    assert figures.rms == pytest.approx(want["rms"], rel=TOLERANCE)
    if want["m2"] > 0:
        kurtosis = (want["m4"] / count) / (want["m2"] / count) ** 2
        assert figures.kurtosis == pytest.approx(kurtosis, rel=TOLERANCE)


def normal(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    flat[::97] = float("nan")
    flat[5::389] = float("inf")
    flat[11::577] = -float("inf")
    return x


def mixed_magnitudes() -> torch.Tensor:
    x = normal((32, 64))
    x[0, :8] = 1e20 * torch.tensor([1, -1, 2, -3, 1, 1, 0.5, -0.25])
    x[1:, :8] = 1e-20
    return x


CASES = {
    "normal": lambda: normal((16, 32, 48)) * 3 + 0.5,
    "large mean": lambda: 1e4 + normal((64, 64)),
    "large mean, non-finite": lambda: with_nonfinite(1e4 + normal((64, 64))),
    "tiny (1e-20)": lambda: 1e-20 * normal((32, 64)),
    "huge (1e20)": lambda: 1e20 * normal((32, 64)),
    "1e20 among 1e-20 and N(0,1)": mixed_magnitudes,
    "float32 extremes": lambda: torch.tensor([[3.4e38, -3.4e38, 1e-45, 0.0]]),
    "relu, dead units": lambda: torch.relu(normal((40, 24)) - torch.linspace(-1, 6, 24)),
    "float16 (sums beyond 65504)": lambda: (100 * normal((64, 256))).half(),
    "bfloat16, non-finite": lambda: with_nonfinite(3 + normal((64, 128))).bfloat16(),
    "float64": lambda: 1e6 + normal((16, 16)).double(),
    "beyond 65,536 values, non-finite": lambda: with_nonfinite(1e4 + 3 * normal((80, 1024))),
    "one row of 100,000 values": lambda: 1e3 + normal((100_000,)),
    "one value": lambda: torch.tensor(2.5),
    "all NaN": lambda: torch.full((3, 4), float("nan")),
    "all equal": lambda: torch.full((5, 7), 1e4 + 0.1),
}


@pytest.fixture(params=["float32", "float32 general", "by size", "by size general"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if "general" in request.param:  # as on a GPU: no host sync to learn that all are finite
        monkeypatch.setattr(health, "_all_finite", lambda low, high: False)
    if "float32" in request.param:  # as for tensors of more than 65,536 values
        monkeypatch.setattr(health, "_SMALL", 0)
    return request.param


def array(x: torch.Tensor) -> np.ndarray:
    """``x`` in float64 for NumPy, at least one-dimensional."""
    return x.double().reshape(x.shape or (1,)).numpy()


@pytest.mark.parametrize("case", CASES)
def test_statistics_equal_numpy_float64(case: str, path: str) -> None:
    x = CASES[case]()
    check(health_statistics(x), array(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES)
def test_statistics_on_a_gpu_equal_numpy_float64(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "_SMALL", 0)  # float32 arithmetic, whatever the size
    x = CASES[case]()
    check(health_statistics(x.cuda()).cpu(), array(x))


def test_masked_rows_and_empty_selection(path: str) -> None:
    x = with_nonfinite(1e4 + normal((4, 30, 16)))
    rows = torch.arange(30)[None, :] < torch.tensor([[30], [7], [0], [19]])
    check(health_statistics(x, rows), x[rows].double().numpy())
    every = torch.ones(4, 30, dtype=torch.bool)  # on the CPU: the tensor as it is
    check(health_statistics(x, every), x.double().numpy())
    none = torch.zeros(4, 30, dtype=torch.bool)
    vector = health_statistics(x, none)
    check(vector, np.zeros((0, 16)))
    assert HealthFigures.of(vector).count == 0 and math.isnan(HealthFigures.of(vector).mean)
    with pytest.raises(ValueError, match=r"`rows` of shape \(4, 29\) is not a mask"):
        health_statistics(x, every[:, 1:])


def test_histogram_places_values_at_the_edges(path: str) -> None:
    edges = np.array(EDGES)
    near = torch.tensor(edges, dtype=torch.float32)  # each edge rounded to float32
    values = torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near * 0)])
    values = torch.cat([values, -values, torch.tensor([0.0, 1e-9, 5e3, math.nan, math.inf])])
    x = values[:, None]
    got = health_statistics(x, histogram=True)[HEAD : HEAD + len(EDGES) + 1].numpy()
    wide = x.double().numpy().ravel()
    finite = np.abs(wide[np.isfinite(wide)])
    want = np.bincount(np.searchsorted(edges, finite, side="right"), minlength=len(edges) + 1)
    np.testing.assert_array_equal(got, want)
    check(health_statistics(x), x.double().numpy())
