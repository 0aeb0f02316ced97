"""The one pass of UnitActivations (``above_cut``, ``update_units``) against NumPy float64:
the active entries, the density (counts, sequential float64 sums, histograms) and the top
examples with their windows, whatever the batches, the chunks and the blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_iocatch.probes import UnitActivations, top_examples, unit_density
from lightning_iocatch.probes.top_examples import Rows, empty_top, update_top
from lightning_iocatch.probes.unit_density import (
    above_cut,
    empty_density,
    lowest_above,
    update_density,
)
from lightning_iocatch.probes.unit_pass import update_units
from tests.probes.test_units import numpy_top

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def awkward(
    seed: int, rows: int, units: int, dtype: torch.dtype, sparse: float = 0.05
) -> torch.Tensor:
    """Sparse ReLU-like values (``sparse`` of them above 0) with ties, exact zeros, NaN,
    +-inf and a dense unit."""
    rng = np.random.default_rng(seed)
    drawn = rng.integers(1, 5, (rows, units))
    values = np.where(rng.random((rows, units)) < sparse, drawn, 0.0)
    values[:, 0] = rng.normal(size=rows)  # dense, half negative
    for odd in (np.nan, np.inf, -np.inf):
        values[rng.random((rows, units)) < sparse / 5] = odd
    return torch.from_numpy(values).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "block"), [(0, 8), (5, 8), (203, 8), (203, 3), (64, 1)])
def test_above_cut_finds_every_entry_at_or_above_the_cut(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, block: int
) -> None:
    """Rows not a multiple of the block, a NaN beside an active value in a block, a dense
    unit (blocks compared directly where most hold something), a cut per unit."""
    monkeypatch.setattr(unit_density, "_BLOCK", block)
    values = awkward(rows, rows, 9, dtype, sparse=0.004)
    if rows == 203 and block == 8:  # the premise: most blocks hold nothing (or NaN) above 0
        blocks = values[:200].reshape(25, 8, 9)
        assert float((~(blocks <= 0)).any(1).float().mean()) <= 0.25
    for cut in (lowest_above(0.0, dtype), torch.linspace(-1.0, 3.0, 9, dtype=torch.float32)):
        row, unit, value = above_cut(values, cut)
        wide = values.double().numpy()
        expected = np.nonzero(wide >= cut.double().numpy())  # NaN never is
        got = np.lexsort((row.numpy(), unit.numpy()))
        want = np.lexsort((expected[0], expected[1]))
        np.testing.assert_array_equal(unit.numpy()[got], expected[1][want])
        np.testing.assert_array_equal(row.numpy()[got], expected[0][want])
        assert value.dtype == dtype
        np.testing.assert_array_equal(value.double().numpy()[got], wide[expected][want])
        for each in unit.unique():  # each unit's entries in ascending rows (its sums' order)
            mine = row[unit == each]
            assert bool((mine[1:] > mine[:-1]).all())
    dense = torch.ones(64, 3, dtype=dtype)  # every block holds some: compared directly
    assert above_cut(dense, lowest_above(0.0, dtype))[0].numel() == 192


def sequential_density(values: np.ndarray, threshold: float, low: float, high: float, bins: int):
    """Counts, float64 sums added one row after another (as the probe adds), histograms of
    ``floor((log10(v) - low) / width)`` clamped: the rule the module docstring states."""
    active = values > threshold
    sums = np.zeros(values.shape[1])
    histogram = np.zeros((values.shape[1], bins), dtype=np.int64)
    width = (high - low) / bins
    for unit in range(values.shape[1]):
        chosen = values[active[:, unit], unit].astype(np.float64)
        for value in chosen:
            sums[unit] += value
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.where(chosen > 0, chosen, 0.0))
        slots = np.floor(np.clip((logs - low) / width, 0, bins - 1)).astype(np.int64)
        np.add.at(histogram[unit], slots, 1)
    return active.sum(0), sums, histogram


@pytest.mark.parametrize("seed", range(12))
def test_update_units_equals_numpy_whatever_the_batches_and_chunks(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(unit_density, "_CHUNK", int(rng.choice([1 << 22, 50, 7])))
    monkeypatch.setattr(unit_density, "_BLOCK", int(rng.choice([8, 2, 5])))
    dtype = DTYPES[seed % 4]
    rows, units, k, width = 300, 6, int(rng.integers(1, 5)), int(rng.integers(0, 3))
    values = awkward(seed, rows, units, dtype, sparse=[0.05, 0.004][seed % 2])
    values[:, 3] = 0  # a unit never active
    values[:40, 4] = 2.0  # ties, broken by index then position
    samples = rng.permutation(60)[:30]
    samples = np.sort(samples) if seed % 4 < 2 else samples  # rows in (index, position) order
    index = np.repeat(samples, 10)
    position = np.tile(np.arange(10), 30)
    position[position >= 7] += 3  # a gap in the positions: windows search past it
    threshold, above = [(0.0, 0.0), (0.5, 1.0), (-0.5, 0.0)][seed % 3]
    top, density = empty_top(units, k, width), empty_density(units, bins=6)
    bounds = np.sort(rng.choice(np.arange(1, 30), size=3, replace=False)) * 10
    for part in np.split(np.arange(rows), bounds):  # several batches of whole samples
        batch = Rows(
            values[part],
            torch.from_numpy(index[part]),
            torch.from_numpy(position[part]),
            torch.from_numpy(index[part] * 100 + position[part]),
        )
        top, density = update_units(
            top, density, batch, above=above, threshold=threshold, log10_range=(-1.0, 1.0)
        )
    wide = values.double().numpy()
    active, sums, histogram = sequential_density(wide, threshold, -1.0, 1.0, 6)
    assert int(density.rows) == rows
    np.testing.assert_array_equal(density.active.numpy(), active)
    np.testing.assert_array_equal(density.active_sum.numpy(), sums)  # bit for bit
    np.testing.assert_array_equal(density.histogram.numpy(), histogram)
    expected = numpy_top(wide, index, position, k, above)
    np.testing.assert_array_equal(top.values.numpy(), expected[0])
    np.testing.assert_array_equal(top.indices.numpy(), expected[1])
    np.testing.assert_array_equal(top.positions.numpy(), expected[2])
    where = {(i, p): r for r, (i, p) in enumerate(zip(index, position, strict=True))}
    for unit, slot in zip(*np.nonzero(expected[1] >= 0), strict=True):
        sample, at = int(expected[1, unit, slot]), int(expected[2, unit, slot])
        for offset in range(-width, width + 1):
            row = where.get((sample, at + offset))
            got_id = int(top.context_ids[unit, slot, offset + width])
            got_value = float(top.context_values[unit, slot, offset + width])
            assert got_id == (-1 if row is None else sample * 100 + at + offset)
            if row is None or math.isnan(wide[row, unit]):
                assert math.isnan(got_value)
            else:
                assert got_value == np.float32(wide[row, unit])


@pytest.mark.parametrize(("above", "threshold"), [(None, 0.0), (-1.0, 0.0), (0.0, 0.0)])
def test_one_pass_equals_the_two_statistics_apart(above: float | None, threshold: float) -> None:
    """Rows repeated inside a batch (a sampler's padding) and every kind of ``above``."""
    values = awkward(7, 120, 5, torch.float32)
    index = torch.arange(120) // 6
    position = torch.arange(120) % 6
    position[10:12] = position[8:10]  # two tokens seen twice
    index[10:12] = index[8:10]
    rows = Rows(values, index, position, None)
    top, density = update_units(
        empty_top(5, 3, 1), empty_density(5, 4), rows,
        above=above, threshold=threshold, log10_range=(-1.0, 1.0),
    )  # fmt: skip
    apart = update_top(empty_top(5, 3, 1), rows, above)
    counted = update_density(empty_density(5, 4), values, threshold, (-1.0, 1.0))
    for got, want in zip((*top, *density), (*apart, *counted), strict=True):
        assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))


def test_tokens_of_padded_sequences_are_rows_once() -> None:
    """A padded ``(batch, seq, units)`` batch: padding never counts, nor fills a window."""
    hidden = awkward(3, 2 * 40, 4, torch.float32).reshape(2, 40, 4)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, 33:] = False  # right padding
    probe = UnitActivations(k=4, window=2, above=0.0)
    ids = torch.arange(80).reshape(2, 40)
    probe.update(hidden, batch={"attention_mask": mask}, indices=[3, 9], tokens=mask,
                 token_ids=ids)  # fmt: skip
    summary = probe.compute()
    real = hidden[mask].double().numpy()
    sample = np.repeat([3, 9], mask.sum(1).numpy())
    position = np.concatenate([np.arange(35), np.arange(33)])
    expected = numpy_top(real, sample, position, 4, 0.0)
    np.testing.assert_array_equal(summary.top_index.numpy(), expected[1])
    np.testing.assert_array_equal(summary.top_position.numpy(), expected[2])
    assert summary.rows == 68
    assert summary.active.tolist() == (torch.from_numpy(real) > 0).sum(0).tolist()
    kept = summary.context_ids[summary.context_ids >= 0]
    assert bool(mask.view(-1)[kept].all())  # no padded token in any window


def test_a_crowded_chunk_bounds_an_unfilled_units_candidates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many active values of an empty unit in several chunks: at most ``k`` (and ties) a
    unit and chunk reach the sort, and the slots are the lexsort's."""
    monkeypatch.setattr(unit_density, "_CHUNK", 4000)
    seen: list[int] = []
    best_pairs = top_examples._best_pairs

    def counted(*args: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(args[1].numel())  # type: ignore[union-attr]
        return best_pairs(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(top_examples, "_best_pairs", counted)
    generator = torch.Generator().manual_seed(3)
    values = torch.rand(20_000, 4, generator=generator)  # every value active
    index, position = torch.arange(20_000) // 10, torch.arange(20_000) % 10
    top, _ = update_units(
        empty_top(4, 5, 0), empty_density(4, 3), Rows(values, index, position),
        above=0.0, threshold=0.0, log10_range=(-1.0, 1.0),
    )  # fmt: skip
    assert seen and seen[-1] <= 4 * 5 * (20_000 // 1000)  # chunks of 1,000 rows
    expected = numpy_top(values.double().numpy(), index.numpy(), position.numpy(), 5, 0.0)
    np.testing.assert_array_equal(top.values.numpy(), expected[0])
    np.testing.assert_array_equal(top.indices.numpy(), expected[1])
