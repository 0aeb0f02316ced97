"""Probes given a mask of real tokens (``update(..., tokens=mask)``) count those tokens only.

Ground truth: NumPy in float64 on the real tokens picked by hand (right and left padding),
never the probes' own pooling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe, pool_features
from tests.probes.test_probes import numpy_batch_stats, numpy_cka


def padded(side: str, samples: int = 6, seq: int = 7, width: int = 5, seed: int = 0):
    """ReLU features ``(samples, seq, width)`` with junk at padding, the mask, and the
    per-sample real rows by hand; sample 2 has no real token."""
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.normal(size=(samples, seq, width)), 0) + 0.1
    x[:, :, 0] = 0  # a dead unit (also at the real tokens)
    lengths = rng.integers(1, seq + 1, size=samples)
    lengths[2] = 0
    mask = np.zeros((samples, seq), dtype=bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        if side == "left":
            mask[i] = mask[i][::-1]
    x[~mask] = 1000.0  # padding: values no probe may count
    x[~mask, 0] = 7.0  # and a unit alive only at padding
    return x, mask


def hand_pool(x: np.ndarray, mask: np.ndarray, pool: str) -> np.ndarray:
    """One row per sample with a real token: the mean of its real rows, or its last one."""
    rows = []
    for sample, real in zip(x, mask, strict=True):
        where = np.flatnonzero(real)
        if where.size:
            chosen = sample[where]
            rows.append(chosen.mean(axis=0) if pool == "mean" else chosen[-1])
    return np.stack(rows)


@pytest.mark.parametrize("side", ["right", "left"])
def test_activation_stats_count_the_real_tokens_only(side: str) -> None:
    x, mask = padded(side)
    stats = ActivationStats()
    for rows in (slice(0, 3), slice(3, 6)):
        stats.update(torch.tensor(x[rows]), tokens=torch.tensor(mask[rows]))
    got = {k: float(v) for k, v in stats.compute().items()}
    expected = numpy_batch_stats([x[mask]])
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert got["dead_frac"] == pytest.approx(1 / 5)  # unit 0: alive only at padding


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("pool", ["mean", "last"])
def test_pooling_takes_the_real_tokens(side: str, pool: str) -> None:
    x, mask = padded(side)
    pooled = pool_features(torch.tensor(x), pool, torch.tensor(mask)).numpy()
    has = mask.any(axis=1)
    assert np.isnan(pooled[~has]).all()  # no real token: NaN (probes leave it out)
    np.testing.assert_allclose(pooled[has], hand_pool(x, mask, pool), rtol=1e-12)
    # a 4-D (batch, seq, heads, dim) tensor: the mean over heads too, of real tokens only
    heads = np.stack([x, 2 * x], axis=2)
    pooled4 = pool_features(torch.tensor(heads), pool, torch.tensor(mask)).numpy()
    expected4 = hand_pool(heads, mask, pool)
    expected4 = expected4.mean(axis=1) if pool == "mean" else expected4.reshape(len(expected4), -1)
    np.testing.assert_allclose(pooled4[has], expected4, rtol=1e-12)


def test_flatten_zeroes_padding_and_other_shapes_are_not_masked() -> None:
    x, mask = padded("right")
    flat = pool_features(torch.tensor(x), "flatten", torch.tensor(mask)).numpy()
    np.testing.assert_array_equal(flat, np.where(mask[:, :, None], x, 0).reshape(6, -1))
    other = torch.tensor(x[:, :3])  # (batch, 3, width): not the mask's (batch, seq)
    assert torch.equal(pool_features(other, "mean", torch.tensor(mask)), other.mean(dim=1))


def test_linear_probe_holds_the_hand_pooled_features() -> None:
    """The held-out features (nearly every sample held out) equal hand pooling, sample by
    sample; the sample without a real token is left out of training and scoring."""
    x, mask = padded("left", samples=12, seed=1)
    for pool in ("mean", "last"):
        probe = LinearProbe(
            lambda batch: batch, task="regression", pool=pool, holdout=0.999,
            holdout_dtype=torch.float64,
        )  # fmt: skip
        for start in (0, 6):
            rows = slice(start, start + 6)
            probe.update(
                torch.tensor(x[rows]),
                batch=torch.arange(6.0) + start,
                indices=list(range(start, start + 6)),
                tokens=torch.tensor(mask[rows]),
            )
        held = torch.cat(probe.held_x).numpy()
        held_index = torch.cat(probe.held_key)[:, 1].long().tolist()
        has = [i for i in range(12) if mask[i].any()]
        assert sorted(held_index) == [i for i in has if i in held_index] and 2 not in held_index
        expected = dict(zip(has, hand_pool(x, mask, pool), strict=True))
        for row, index in zip(held, held_index, strict=True):
            np.testing.assert_allclose(row, expected[index], rtol=1e-12)


@pytest.mark.parametrize(("side", "pool"), [("right", "mean"), ("left", "last")])
def test_layer_cka_pools_the_real_tokens(side: str, pool: str) -> None:
    x, mask = padded(side, samples=10)
    y = np.tanh(x @ np.random.default_rng(3).normal(size=(5, 4)))
    pooled_b = torch.tensor(np.random.default_rng(4).normal(size=(10, 3)))  # (batch, 3): whole
    cka = LayerCKA(pool=pool)
    for rows in (slice(0, 5), slice(5, 10)):
        features = {"a": torch.tensor(x[rows]), "b": torch.tensor(y[rows]), "c": pooled_b[rows]}
        cka.update(features, tokens=torch.tensor(mask[rows]))
    got = {k: float(v) for k, v in cka.compute().items()}
    a, b = hand_pool(x, mask, pool), hand_pool(y, mask, pool)
    c = pooled_b.numpy()[mask.any(axis=1)]  # the empty sample is left out of every key
    assert got["cka/a~b"] == pytest.approx(numpy_cka(a, b), rel=1e-10)
    assert got["cka/a~c"] == pytest.approx(numpy_cka(a, c), rel=1e-10)


def test_a_two_dimensional_tensor_is_one_vector_per_sample_even_as_wide_as_the_mask() -> None:
    """A ``(batch, d)`` value (a pooler's output, a classification head's logits) has no
    positions: it is counted whole, but for the sample without tokens, also where ``d``
    equals the mask's sequence length (a model padded to ``max_length`` = its width).
    Before, such a tensor was masked as if its units were positions (the review's case:
    mean -0.0901 logged for a truth of 0.0066, and ``pool="mean"`` gave width 1)."""
    x, mask = padded("right")
    assert x.shape[1] == mask.shape[1]
    pooled = x[:, 1, :]  # (batch, width) beside a (batch, seq) mask
    pooled = np.concatenate([pooled, pooled[:, :2]], axis=1)  # width 7 == seq 7
    assert pooled.shape == mask.shape
    stats = ActivationStats()
    stats.update(torch.tensor(pooled), tokens=torch.tensor(mask))
    got = {k: float(v) for k, v in stats.compute().items()}
    assert got == pytest.approx(numpy_batch_stats([pooled[mask.any(axis=1)]]), rel=1e-12)
    for pool in ("mean", "last", "flatten"):
        got_rows = pool_features(torch.tensor(pooled), pool, torch.tensor(mask))
        np.testing.assert_array_equal(got_rows.numpy(), pooled)


def test_a_mask_of_another_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`tokens` has 2 rows for a batch of 3 samples"):
        ActivationStats().update(torch.zeros(3, 4, 5), tokens=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`tokens` must be a \(batch, seq\) mask"):
        LayerCKA().update({"a": torch.zeros(3, 4, 5)}, tokens=torch.ones(3, 4, 1))
