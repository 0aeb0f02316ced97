"""UnitActivations against NumPy: top examples by a lexsort over every row held in
memory (ties included), density and histograms by counting, whatever the batches."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_iocatch.probes import UnitActivations, UnitSummary
from lightning_iocatch.probes.top_examples import Rows, Top, empty_top, merge_tops, update_top


def numpy_top(values: np.ndarray, index: np.ndarray, position: np.ndarray, k: int, above=None):
    """Per unit, the ``k`` best rows by (value desc, index, position), as three arrays."""
    out = np.full((3, values.shape[1], k), -1.0)
    out[0] = -np.inf
    for unit in range(values.shape[1]):
        column = values[:, unit].astype(np.float64)
        ok = ~np.isnan(column) & (column > -np.inf)
        if above is not None:
            ok &= column > above
        rows = np.flatnonzero(ok)
        best = rows[np.lexsort((position[rows], index[rows], -column[rows]))][:k]
        out[0, unit, : best.size] = column[best]
        out[1, unit, : best.size] = index[best]
        out[2, unit, : best.size] = position[best]
    return out


def random_rows(seed: int):
    """Rows of a few samples (tokens at unique positions), with many ties and some NaN."""
    rng = np.random.default_rng(seed)
    rows, units = int(rng.integers(1, 80)), int(rng.integers(1, 6))
    values = rng.integers(-3, 4, size=(rows, units)).astype(np.float32)
    if seed % 3 == 0:
        values = rng.normal(size=(rows, units)).astype(np.float32)
    if seed % 4 == 0:
        values[rng.random(values.shape) < 0.1] = np.nan
    if seed % 5 == 0:
        values = values.astype(np.float64)
    index = rng.choice(rng.permutation(10_000)[:20], size=rows)
    position = np.zeros(rows, dtype=np.int64)
    for sample in np.unique(index):
        where = np.flatnonzero(index == sample)
        position[where] = rng.permutation(50)[: where.size]
    return rng, values, index.astype(np.int64), position


def stream(values, index, position, parts, k, above, width=2) -> Top:
    """The top of each part's samples fed in the given order (a sample in one part)."""
    top = empty_top(values.shape[1], k, width)
    for part in parts:
        rows = Rows(
            torch.from_numpy(values[part]),
            torch.from_numpy(index[part]),
            torch.from_numpy(position[part]),
            torch.from_numpy(index[part] * 100 + position[part]),
        )
        top = update_top(top, rows, above)
    return top


@pytest.mark.parametrize("seed", range(60))
def test_top_equals_a_lexsort_of_all_rows_whatever_the_batches(seed: int) -> None:
    rng, values, index, position = random_rows(seed)
    k, above = int(rng.integers(1, 7)), (None if seed % 2 else 0.0)
    expected = numpy_top(values, index, position, k, above)
    samples = rng.permutation(np.unique(index))
    parts = [
        rng.permutation(np.flatnonzero(np.isin(index, group)))
        for group in np.array_split(samples, int(rng.integers(1, 6)))
    ]
    top = stream(values, index, position, parts, k, above)
    np.testing.assert_array_equal(top.values.numpy(), expected[0])
    np.testing.assert_array_equal(top.indices.numpy(), expected[1])
    np.testing.assert_array_equal(top.positions.numpy(), expected[2])
    # two processes' tops merged: the same slots, bit for bit
    halves = [parts[: len(parts) // 2], parts[len(parts) // 2 :]]
    tops = [stream(values, index, position, half, k, above) for half in halves]
    merged = merge_tops(Top(*(torch.stack(pair) for pair in zip(*tops, strict=True))))
    for got, want in zip(merged, top, strict=True):
        assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))
    # each example's window: the same sample's tokens at positions -2..2, where present
    token = {(i, p): r for r, (i, p) in enumerate(zip(index, position, strict=True))}
    for unit, slot in zip(*np.nonzero(expected[1] >= 0), strict=True):
        sample, at = int(expected[1, unit, slot]), int(expected[2, unit, slot])
        for offset in range(-2, 3):
            row = token.get((sample, at + offset))
            got_id = int(top.context_ids[unit, slot, offset + 2])
            got_value = float(top.context_values[unit, slot, offset + 2])
            assert got_id == (-1 if row is None else sample * 100 + at + offset)
            if row is None or math.isnan(values[row, unit]):
                assert math.isnan(got_value)
            else:
                assert got_value == values[row, unit]


def test_ties_go_to_the_lower_index_then_position() -> None:
    probe = UnitActivations(k=3, window=0, above=None)
    rows = torch.zeros(6, 1)  # six ties at 0: (index, position) decides
    probe.update(rows[:3], indices=[9, 2, 9], positions=torch.tensor([1, 5, 0]))
    probe.update(rows[3:], indices=[4, 2, 1], positions=torch.tensor([0, 3, 7]))
    summary = probe.compute()
    assert summary.top_index.tolist() == [[1, 2, 2]]
    assert summary.top_position.tolist() == [[7, 3, 5]]


def test_a_row_seen_twice_fills_one_slot() -> None:
    probe = UnitActivations(k=3, window=0)
    for _ in range(2):  # a sampler's padding repeats a sample, unflagged
        probe.update(torch.tensor([[5.0], [1.0]]), indices=[3, 4])
    assert probe.compute().top_index.tolist() == [[3, 4, -1]]


def numpy_density(values: np.ndarray, threshold: float, low: float, high: float, bins: int):
    active = values > threshold
    logs = np.log10(np.where(values > 0, values, np.nan).astype(np.float64))
    histogram = np.zeros((values.shape[1], bins), dtype=np.int64)
    edges = np.linspace(low, high, bins + 1)
    for unit in range(values.shape[1]):
        chosen = logs[active[:, unit], unit]
        chosen = np.where(np.isnan(chosen), -np.inf, chosen)  # zero and below: first bin
        histogram[unit] = np.histogram(np.clip(chosen, low, high - 1e-12), bins=edges)[0]
    sums = np.where(active, values.astype(np.float64), 0).sum(0)
    return active.sum(0), sums, histogram


@pytest.mark.parametrize(("threshold", "dtype"), [(0.0, torch.float32), (-0.5, torch.bfloat16)])
def test_density_and_histograms_equal_numpy(threshold: float, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3000, 7, generator=generator).mul(3).exp().sub(1.5).to(dtype)
    values[::5, 2] = torch.nan
    probe = UnitActivations(k=0, threshold=threshold, log10_range=(-2.0, 2.0), bins=8)
    for part in values.split(700):
        probe.update(part)
    summary = probe.compute()
    as_numpy = values.float().numpy()
    active, sums, histogram = numpy_density(as_numpy, threshold, -2.0, 2.0, 8)
    assert summary.rows == 3000
    np.testing.assert_array_equal(summary.active.numpy(), active)
    np.testing.assert_allclose(summary.active_sum.numpy(), sums, rtol=1e-12)
    np.testing.assert_array_equal(summary.histogram.numpy(), histogram)
    np.testing.assert_allclose(summary.mean_active().numpy(), sums / active, rtol=1e-12)
    counts, edges, dead = summary.density_histogram(per_decade=2)
    density = active / 3000
    expected = np.histogram(np.log10(density[density > 0]), bins=edges.numpy())[0]
    assert counts.tolist() == expected.tolist() and dead == int((active == 0).sum())


def test_tokens_are_rows_and_padding_is_left_out() -> None:
    hidden = torch.arange(24.0).reshape(2, 4, 3)  # (batch, seq, units)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])  # left, right padding
    batch = {"input_ids": torch.arange(8).reshape(2, 4) + 100, "attention_mask": mask}
    probe = UnitActivations(k=2, window=1)
    probe.update(hidden, batch=batch, indices=[8, 3], tokens=mask.bool())
    summary = probe.compute()
    assert summary.rows == 5
    assert summary.top_values[0].tolist() == [15.0, 12.0]  # sample 3's two tokens
    assert summary.top_index[0].tolist() == [3, 3] and summary.top_position[0].tolist() == [1, 0]
    assert summary.context_ids[0, 0].tolist() == [104, 105, -1]  # column 2 is padding
    # left padding: positions count from the first real token
    assert summary.top_position[2].tolist() == [1, 0] and summary.top_values[2].tolist() == [17, 14]
    three = UnitActivations(k=3, window=0)
    three.update(
        hidden[:1], batch={"attention_mask": mask[:1]}, indices=[8], tokens=mask[:1].bool()
    )
    assert three.compute().top_position[0].tolist() == [2, 1, 0]
    padded = UnitActivations(k=2, window=0)  # the second sample repeats one seen elsewhere
    padded.update(hidden, batch=batch, indices=[8, 3], tokens=mask.bool(), repeated=[False, True])
    assert padded.compute().rows == 3


def test_summary_survives_save_and_load(tmp_path: Path) -> None:
    probe = UnitActivations(k=2, window=1, above=0.5)
    probe.update(torch.tensor([[[1.0, 0.0], [2.0, 3.0]]]), indices=[4])
    summary = probe.compute().with_key("sae/outputs")
    summary.save(tmp_path / "units.safetensors")
    loaded = UnitSummary.load(tmp_path / "units.safetensors")
    assert (loaded.key, loaded.rows, loaded.above, loaded.window) == ("sae/outputs", 2, 0.5, 1)
    for name in ("active", "histogram", "top_index", "top_position", "context_ids"):
        assert torch.equal(getattr(loaded, name), getattr(summary, name))
    assert torch.equal(loaded.top_values.nan_to_num(-1), summary.top_values.nan_to_num(-1))
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "units.safetensors").read_bytes()[:20])
    with pytest.raises(
        ValueError, match=r"other.safetensors' is not a unit summary \(not a safetensors file"
    ):
        UnitSummary.load(tmp_path / "other.safetensors")
    from safetensors.torch import save_file

    save_file({"a": torch.ones(1)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="is not a unit summary"):
        UnitSummary.load(tmp_path / "plain.safetensors")


def test_an_encoder_gives_the_units() -> None:
    encoder = torch.nn.Linear(3, 5)
    with torch.no_grad():
        encoder.bias.fill_(0.5)
    tokens = torch.randn(1, 4, 3)
    # each token and its negative: one of W x + b and -W x + b is at least b > 0, so every
    # unit has a value above `above=0` to fill its slot, whatever the random numbers
    values = torch.cat([tokens, -tokens])
    probe = UnitActivations(k=1, window=0, of=encoder)
    probe.update(values, indices=[0, 1])
    with torch.no_grad():
        expected = encoder(values).reshape(8, 5).amax(0).double()
    assert bool((expected >= 0.5).all())  # the premise
    assert torch.equal(probe.compute().top_values[:, 0], expected)
    # bfloat16 captures (bf16-mixed) go into a float32 encoder as float32
    halves = UnitActivations(k=1, window=0, of=encoder)
    halves.update(values.bfloat16(), indices=[0, 1])
    with torch.no_grad():
        expected = encoder(values.bfloat16().float()).reshape(8, 5).amax(0).double()
    assert torch.equal(halves.compute().top_values[:, 0], expected)


def test_bad_settings_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="`k` must be a non-negative int"):
        UnitActivations(k=-1)
    with pytest.raises(ValueError, match="`log10_range` must be"):
        UnitActivations(log10_range=(2.0, 1.0))
    with pytest.raises(ValueError, match="pass `index=lambda batch"):
        UnitActivations().update(torch.ones(2, 3))
    probe = UnitActivations(k=1)
    probe.update(torch.ones(2, 3), indices=[0, 1])
    with pytest.raises(ValueError, match="this batch has 4 units, earlier ones 3"):
        probe.update(torch.ones(2, 4), indices=[2, 3])
    for option in ("above", "threshold"):
        with pytest.raises(ValueError, match=f"`{option}` must be a finite number"):
            UnitActivations(**{option: float("nan")})
    with pytest.raises(ValueError, match="must keep the leading dimensions"):
        UnitActivations(of=lambda x: x.sum(0)).update(torch.ones(2, 3), indices=[0, 1])


def test_one_unit_keeps_its_shapes(tmp_path: Path) -> None:
    """torchmetrics squeezes one-element tensors out of compute(): a (batch, 1) head."""
    for k in (1, 3):
        probe = UnitActivations(k=k, window=0)
        probe.update(torch.tensor([[0.5], [2.0], [0.0]]), indices=[0, 1, 2])
        summary = probe.compute()
        assert summary.active.shape == (1,) and summary.top_values.shape == (1, k)
        assert summary.context_ids.shape == summary.context_values.shape == (1, k, 1)
        assert summary.scalars()["dead_frac"] == 0.0 and summary.examples(0)[0]["index"] == 1
        summary.save(tmp_path / "one.safetensors")
        assert UnitSummary.load(tmp_path / "one.safetensors").top_index.shape == (1, k)


def test_a_row_repeated_in_one_batch_takes_one_slot() -> None:
    for above in (None, 0.0):
        probe = UnitActivations(k=2, window=1, above=above)
        values = torch.tensor([[5.0], [5.0], [3.0]])  # index 0 twice, then index 1
        probe.update(values, indices=[0, 0, 1], positions=torch.tensor([0, 0, 0]))
        summary = probe.compute()
        assert summary.top_index.tolist() == [[0, 1]] and summary.top_values.tolist() == [[5, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_threshold_is_compared_exactly_in_every_dtype(dtype: torch.dtype) -> None:
    values = torch.tensor([[0.1, 0.3], [0.3, 0.1], [0.05, 0.0]]).to(dtype)  # 0.1f32 > 0.1
    probe = UnitActivations(k=3, window=0, threshold=0.1, above=0.1)
    probe.update(values, indices=[0, 1, 2])
    summary = probe.compute()
    expected = values.double() > 0.1  # float64 truth
    assert summary.active.tolist() == expected.sum(0).tolist()
    assert (summary.top_index >= 0).sum(1).tolist() == expected.sum(0).tolist()
    if dtype != torch.float16:  # the premise: 0.1 rounds up, so it is above 0.1
        assert expected.sum(0).tolist() == [2, 2]


def test_left_padding_positions_without_the_batch() -> None:
    hidden = torch.arange(8.0).reshape(1, 4, 2)
    mask = torch.tensor([[False, False, True, True]])
    probe = UnitActivations(k=1, window=1)
    probe.update(hidden, indices=[0], tokens=mask, token_ids=torch.tensor([[0, 0, 11, 12]]))
    summary = probe.compute()  # token rows store positions 0 and 1 for columns 2 and 3
    assert summary.top_position.tolist() == [[1], [1]]
    assert summary.context_ids[0, 0].tolist() == [11, 12, -1]


def test_forward_merge_state_and_to_keep_the_merge_rules() -> None:
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=generator), torch.randn(5, 4, generator=generator)
    whole = UnitActivations(k=3, window=0)
    whole.update(torch.cat([a, b]), indices=list(range(11)))
    expected = whole.compute()
    forwarded = UnitActivations(k=3, window=0)
    forwarded(a, indices=list(range(6)))
    forwarded(b, indices=list(range(6, 11)))
    first, second = UnitActivations(k=3, window=0), UnitActivations(k=3, window=0)
    first.update(a, indices=list(range(6)))
    second.update(b, indices=list(range(6, 11)))
    first.merge_state(second)
    for probe in (forwarded, first):
        got = probe.compute()
        assert torch.equal(got.top_index, expected.top_index) and torch.equal(
            got.active, expected.active
        )
    moved = UnitActivations(k=3, window=0).to(torch.float16)
    moved.update(a, indices=list(range(6)))
    assert moved.compute().top_values.dtype == torch.float64


def test_coordinates_of_any_integer_dtype() -> None:
    probe = UnitActivations(k=1, window=1)
    hidden = torch.ones(1, 3, 2)
    probe.update(hidden, indices=[0], positions=torch.tensor([[0, 1, 2]], dtype=torch.int32),
                 token_ids=torch.tensor([[5, 6, 7]], dtype=torch.int16))  # fmt: skip
    assert probe.compute().context_ids[0, 0].tolist() == [-1, 5, 6]


def test_a_method_of_a_module_moves_with_the_probe() -> None:
    encoder = torch.nn.Linear(3, 2)
    probe = UnitActivations(k=1, window=0, of=encoder.forward).to(torch.float64)
    assert probe.of_module.weight.dtype == torch.float64  # registered: .to() reaches it
    copy = probe.clone()
    assert copy.of.__self__ is copy.of_module and copy.of_module is not encoder
    copy.update(torch.ones(2, 3), indices=[0, 1])  # float32 values into a float64 encoder
    assert copy.compute().top_values.dtype == torch.float64


@pytest.mark.parametrize("ties", [False, True])
def test_a_large_batch_gives_each_unfilled_unit_at_most_k_candidates(
    monkeypatch: pytest.MonkeyPatch, ties: bool
) -> None:
    """With ``above=0`` a unit whose slots are not yet full is bounded by the batch's own
    k-th best value above 0, not by 0 itself: candidates (and memory) stay ``k`` a unit
    whatever the batch, and the examples are those of a lexsort of every row."""
    from lightning_iocatch.probes import top_examples

    candidates: list[int] = []
    best_pairs = top_examples._best_pairs

    def counted(
        rank: torch.Tensor, unit: torch.Tensor, value: torch.Tensor, units: int, k: int, *rest
    ) -> tuple[torch.Tensor, torch.Tensor]:
        candidates.append(value.numel())
        return best_pairs(rank, unit, value, units, k, *rest)

    monkeypatch.setattr(top_examples, "_best_pairs", counted)
    rows, units, k = 20_000, 16, 5
    generator = torch.Generator().manual_seed(5)
    # distinct values, about half of them above 0 (GELU), or many ties (rounded)
    values = torch.nn.functional.gelu(torch.randperm(rows * units, generator=generator) / 1e4 - 8)
    values = values.reshape(rows, units)
    if ties:
        values = values.mul(4).round() / 4
    index, position = torch.arange(rows) // 10, torch.arange(rows) % 10
    top = empty_top(units, k, width=0)
    top = update_top(top, Rows(values[:3], index[:3], position[:3]), above=0.0)  # partly filled
    top = update_top(top, Rows(values[3:], index[3:], position[3:]), above=0.0)
    assert (values > 0).sum() > 10 * units * k  # the premise: many positive values
    if not ties:  # ties at the k-th value are candidates too
        assert candidates[-1] <= units * k
        expected = values.topk(k, dim=0)
        assert torch.equal(top.values, expected.values.T.double())
        assert torch.equal(top.indices * 10 + top.positions, expected.indices.T)
    truth = numpy_top(values.numpy(), index.numpy(), position.numpy(), k, above=0.0)
    np.testing.assert_array_equal(top.values.numpy(), truth[0])
    np.testing.assert_array_equal(top.indices.numpy(), truth[1])
    np.testing.assert_array_equal(top.positions.numpy(), truth[2])


def test_a_0d_tensor_is_refused_naming_the_shapes_taken() -> None:
    with pytest.raises(ValueError, match=r"shape \(rows, units\), \(rows,\) or .*got a 0-d"):
        UnitActivations(k=1).update(torch.tensor(2.0), indices=[0])
    with pytest.raises(ValueError, match=r"must keep the leading dimensions .*got \(\)"):
        UnitActivations(k=1, of=lambda x: x.sum()).update(torch.ones(3), indices=[0, 1, 2])


def test_window_0_keeps_the_examples_own_token() -> None:
    """``context_ids`` and ``context_values`` are ``(units, k, 2 * window + 1)``: with
    ``window=0`` the example's own token id and the unit's value on it."""
    hidden = torch.tensor([[[1.0, 0.5], [3.0, 0.0], [2.0, 4.0]]])  # (batch, seq, units)
    probe = UnitActivations(k=2, window=0)
    probe.update(hidden, indices=[7], token_ids=torch.tensor([[11, 12, 13]]))
    summary = probe.compute()
    assert summary.context_ids.shape == (2, 2, 1) and summary.window == 0
    assert summary.context_ids[:, :, 0].tolist() == [[12, 13], [13, 11]]
    assert summary.context_values[:, :, 0].tolist() == summary.top_values.tolist()
    assert summary.context_values.dtype == torch.float32
    rows = UnitActivations(k=3, window=0)  # rows without token ids: -1, and the value
    rows.update(torch.tensor([[2.0], [1.0]]), indices=[4, 5])
    found = rows.compute()
    assert found.context_ids.tolist() == [[[-1], [-1], [-1]]]
    assert found.context_values[0, :2, 0].tolist() == [2.0, 1.0]
    assert math.isnan(found.context_values[0, 2, 0])  # an empty slot
