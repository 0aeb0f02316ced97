"""SparseAutoencoder and its activation functions against independent ground truth.

The model's encode/decode/forward for every architecture are checked against a NumPy
float64 implementation of the formulas in its docstring (``input_scale`` != 1, with and
without the decoder-norm scaling); ``folded()`` weights against the plain SAELens
inference formula. BatchTopK's selection is checked against ``torch.topk`` over the flat
batch, its ties against the flat order, and its ``Across`` form against the one-process
mask over 2 and 3 simulated processes; the JumpReLU and Step gradients against their
straight-through formulas written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from lightning_iocatch.sae import SparseAutoencoder
from lightning_iocatch.sae.activations import Across, JumpReLU, Step, batch_topk_mask

D_IN, D_SAE = 8, 32


def trained_looking(architecture: str, k: float | None, *, scale: float = 2.5, **options: Any):
    """A float64 SAE whose weights, biases and thresholds are all perturbed, so no term of
    a formula is zero or symmetric by construction."""
    generator = torch.Generator().manual_seed(7)
    sae = SparseAutoencoder(
        D_IN, D_SAE, architecture, k, dtype=torch.float64, generator=generator, **options
    )
    with torch.no_grad():
        for name in ("W_enc", "W_dec"):
            value = getattr(sae, name)
            value.add_(0.3 * torch.randn(value.shape, generator=generator, dtype=torch.float64))
        sae.b_enc.copy_(0.2 * torch.randn(D_SAE, generator=generator, dtype=torch.float64))
        sae.b_dec.copy_(0.5 * torch.randn(D_IN, generator=generator, dtype=torch.float64))
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(D_SAE, generator=generator) * 0.5)
        if architecture == "batchtopk":
            sae.topk_threshold.fill_(0.3)
        sae.input_scale.fill_(scale)
    return sae


def numpy_weights(sae: SparseAutoencoder) -> dict[str, np.ndarray]:
    return {name: value.detach().double().numpy() for name, value in sae.state_dict().items()}


def numpy_activation(sae: SparseAutoencoder, pre: np.ndarray, w: dict[str, np.ndarray]):
    """The documented ``act``, written without torch."""
    if sae.architecture == "topk":
        out = np.zeros_like(pre)
        for row, values in enumerate(pre):
            chosen = np.argsort(-values)[: int(sae.k)]
            out[row, chosen] = np.maximum(values[chosen], 0)
        return out
    if sae.architecture == "batchtopk" and sae.training:
        acts = np.maximum(pre, 0)
        wanted = int(sae.k * pre.shape[0])
        cut = np.sort(acts.ravel())[::-1][wanted - 1]
        return acts * (acts >= cut)  # values are distinct: no ties at the cut
    if sae.architecture == "batchtopk":
        return np.maximum(pre, 0) * (pre > w["topk_threshold"])
    if sae.architecture == "jumprelu":
        return pre * (pre > w["threshold"])
    return np.maximum(pre, 0)


def numpy_encode(sae: SparseAutoencoder, x: np.ndarray) -> np.ndarray:
    w = numpy_weights(sae)
    s = float(w["input_scale"])
    pre = (x * s - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    norms = np.linalg.norm(w["W_dec"], axis=1)
    if sae.scale_by_decoder_norm:
        pre = pre * norms
    latents = numpy_activation(sae, pre, w)
    return latents / s if sae.scale_by_decoder_norm else latents


def numpy_decode(sae: SparseAutoencoder, latents: np.ndarray) -> np.ndarray:
    w = numpy_weights(sae)
    s = float(w["input_scale"])
    if sae.scale_by_decoder_norm:
        latents = latents * s / np.linalg.norm(w["W_dec"], axis=1)
    return (latents @ w["W_dec"] + w["b_dec"]) / s


CASES = [
    ("topk", 3, {}),
    ("topk", 3, {"scale_by_decoder_norm": False}),
    ("batchtopk", 2.5, {}),
    ("batchtopk", 2.5, {"scale_by_decoder_norm": False}),
    ("jumprelu", None, {}),
    ("jumprelu", None, {"scale_by_decoder_norm": True}),
    ("relu", None, {}),
    ("relu", None, {"scale_by_decoder_norm": True}),
]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(("architecture", "k", "options"), CASES)
def test_encode_decode_match_the_formulas(architecture, k, options, training) -> None:
    sae = trained_looking(architecture, k, **options).train(training)
    x = torch.randn(6, D_IN, dtype=torch.float64) * 1.5
    latents = sae.encode(x)
    expected = numpy_encode(sae, x.numpy())
    np.testing.assert_allclose(latents.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    assert (latents != 0).any() and (latents == 0).any()  # the cut is exercised
    decoded = numpy_decode(sae, expected)
    np.testing.assert_allclose(
        sae.decode(latents).detach().numpy(), decoded, rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(sae(x).detach().numpy(), decoded, rtol=1e-12, atol=1e-12)
    if architecture == "topk":
        assert ((latents != 0).sum(-1) <= k).all()


@pytest.mark.parametrize(("architecture", "k", "options"), CASES)
def test_folded_weights_give_the_same_function_without_scaling(architecture, k, options) -> None:
    sae = trained_looking(architecture, k, **options).eval()
    folded = {name: value.numpy() for name, value in sae.folded().items()}
    x = torch.randn(6, D_IN, dtype=torch.float64) * 1.5
    pre = (x.numpy() - folded["b_dec"]) @ folded["W_enc"] + folded["b_enc"]
    if architecture == "topk":
        latents = np.zeros_like(pre)
        for row, values in enumerate(pre):
            chosen = np.argsort(-values)[:k]
            latents[row, chosen] = np.maximum(values[chosen], 0)
    elif architecture == "relu":
        latents = np.maximum(pre, 0)
    else:  # a BatchTopK out of training is a JumpReLU at its learned threshold
        latents = pre * (pre > folded["threshold"])
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), latents, rtol=1e-12, atol=1e-12)
    decoded = latents @ folded["W_dec"] + folded["b_dec"]
    np.testing.assert_allclose(sae(x).detach().numpy(), decoded, rtol=1e-12, atol=1e-12)
    if sae.scale_by_decoder_norm:
        np.testing.assert_allclose(np.linalg.norm(folded["W_dec"], axis=1), 1.0, rtol=1e-12)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 8, "relu", None), r"`d_in` must be a positive int, got 0"),
        ((8.0, 8, "relu", None), r"`d_in` must be a positive int, got 8.0"),
        ((True, 8, "relu", None), r"`d_in` must be a positive int, got True"),
        ((8, -1, "relu", None), r"`d_sae` must be a positive int, got -1"),
        ((8, 16, "topk", None), r"`k` must be a number in \(0, d_sae=16\] for 'topk', got None"),
        ((8, 16, "batchtopk", 17), r"`k` must be a number in \(0, d_sae=16\] for 'batchtopk'"),
        ((8, 16, "topk", 0), r"`k` must be a number in \(0, d_sae=16\]"),
        ((8, 16, "topk", 2.5), r"`k` must be a whole number for 'topk', got 2.5"),
        ((8, 16, "relu", 4), r"`k` is for 'topk' and 'batchtopk', not 'relu': leave it out"),
        ((8, 16, "jumprelu", 4), r"`k` is for 'topk' and 'batchtopk', not 'jumprelu'"),
        ((8, 16, "gated", None), r"`architecture` must be one of \('topk', .*got 'gated'"),
    ],
)
def test_constructor_refuses_bad_shapes(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        SparseAutoencoder(*args)


# -- BatchTopK's selection ---------------------------------------------------------------


def simulated_ranks(chunks: Sequence[torch.Tensor], call: Callable[[torch.Tensor, Across], Any]):
    """``call(chunk, across)`` on each chunk as if each were one process of a batch: a first
    pass records what each process hands to ``gather``, a second answers every gather with
    the table of all processes' values in rank order (what ``all_gather`` returns)."""
    world, rows = len(chunks), sum(chunk.shape[0] for chunk in chunks)
    sent: list[torch.Tensor] = []

    def record(values: torch.Tensor) -> torch.Tensor:
        sent.append(values.detach().clone())
        return values.detach().expand(world, -1)  # a stand-in; this pass is discarded

    for rank, chunk in enumerate(chunks):
        call(chunk, Across(rows, rank, world, record))
    assert len(sent) in (0, world)
    table = torch.stack(sent) if sent else None

    def gather(values: torch.Tensor) -> torch.Tensor:
        assert table is not None and values.shape == table.shape[1:]
        return table

    return [call(chunk, Across(rows, rank, world, gather)) for rank, chunk in enumerate(chunks)]


@pytest.mark.parametrize("k", [0.5, 1.0, 2.5, 7.0])
def test_batch_topk_mask_takes_the_batch_largest_values(k) -> None:
    acts = torch.rand(6, 10, dtype=torch.float64)  # distinct values
    mask = batch_topk_mask(acts, k)
    wanted = int(k * 6)
    expected = torch.zeros(60, dtype=torch.bool)
    expected[torch.topk(acts.reshape(-1), wanted).indices] = True
    assert torch.equal(mask, expected.view(6, 10))


def flat_order_mask(acts: np.ndarray, wanted: int) -> np.ndarray:
    """The ``wanted`` largest values, ties at the cut taken first in the flat order."""
    flat = acts.ravel()
    cut = np.sort(flat)[::-1][wanted - 1]
    mask = flat > cut
    ties = np.flatnonzero(flat == cut)[: wanted - int(mask.sum())]
    mask[ties] = True
    return mask.reshape(acts.shape)


def test_batch_topk_mask_with_ties_takes_as_many_of_them_as_the_cut_leaves() -> None:
    acts = torch.tensor([[0.9, 0.5, 0.1, 0.5], [0.5, 0.0, 0.5, 0.7], [0.2, 0.5, 0.0, 0.5]])
    mask = batch_topk_mask(acts, 5 / 3)  # 5 of 12: 0.9, 0.7 and three of the six 0.5s
    assert int(mask.sum()) == 5
    assert mask[acts > 0.5].all() and (acts[mask] >= 0.5).all()
    assert not batch_topk_mask(acts, 0.2).any()  # int(0.2 * 3) == 0: nothing
    for sizes in ((1, 2), (2, 1), (1, 1, 1)):  # the cut splits the ties between processes
        masks = simulated_ranks(acts.split(list(sizes)), lambda c, a: batch_topk_mask(c, 5 / 3, a))
        expected = torch.zeros(12, dtype=torch.bool)
        expected[[0, 1, 3, 4, 7]] = True  # 0.9, 0.7 and the first three 0.5s in flat order
        assert torch.equal(torch.cat(masks), expected.view(3, 4)), sizes


def tied_acts(rows: int, units: int) -> torch.Tensor:
    """Non-negative values on a coarse grid: many ties at any cut, and zeros."""
    return torch.randint(0, 6, (rows, units)).double() / 5


@pytest.mark.parametrize("sizes", [(3, 3), (1, 5), (4, 1, 2), (2, 0, 5), (5, 2, 1)])
@pytest.mark.parametrize("k", [0.5, 1.5, 3.0, 5.0])
@pytest.mark.parametrize("ties", [False, True])
def test_batch_topk_across_simulated_processes_is_the_one_process_mask(sizes, k, ties) -> None:
    units = 5
    rows = sum(sizes)
    acts = tied_acts(rows, units) if ties else torch.rand(rows, units, dtype=torch.float64)
    masks = simulated_ranks(acts.split(list(sizes)), lambda c, a: batch_topk_mask(c, k, a))
    # ties at the cut: the first in the flat batch, a process's after those of lower ranks
    expected = flat_order_mask(acts.numpy(), int(k * rows))
    np.testing.assert_array_equal(torch.cat(masks).numpy(), expected)
    if not ties:  # distinct values: the one-process mask
        assert torch.equal(torch.cat(masks), batch_topk_mask(acts, k))


def rect(u: np.ndarray) -> np.ndarray:
    return ((u > -0.5) & (u < 0.5)).astype(np.float64)


def test_jumprelu_and_step_gradients_are_the_straight_through_formulas() -> None:
    bandwidth = 0.3
    threshold = torch.linspace(0.0, 1.0, 7, dtype=torch.float64)
    x = torch.rand(9, 7, dtype=torch.float64) * 1.6 - 0.2
    upstream = torch.randn(9, 7, dtype=torch.float64)
    xn, tn, gn = x.numpy(), threshold.numpy(), upstream.numpy()
    window = rect((xn - tn) / bandwidth)
    assert 0 < window.sum() < window.size  # some inside the kernel, some outside

    x_ = x.clone().requires_grad_(True)
    t_ = threshold.clone().requires_grad_(True)
    out = JumpReLU.apply(x_, t_, bandwidth)
    np.testing.assert_array_equal(out.detach().numpy(), xn * (xn > tn))
    x_grad, t_grad = torch.autograd.grad(out, (x_, t_), upstream)
    np.testing.assert_allclose(x_grad.numpy(), (xn > tn) * gn, rtol=0, atol=0)
    expected = (-(tn / bandwidth) * window * gn).sum(0)
    np.testing.assert_allclose(t_grad.numpy(), expected, rtol=1e-14, atol=1e-14)

    t_ = threshold.clone().requires_grad_(True)
    out = Step.apply(x, t_, bandwidth)
    np.testing.assert_array_equal(out.detach().numpy(), (xn > tn).astype(np.float64))
    (t_grad,) = torch.autograd.grad(out, (t_,), upstream)
    np.testing.assert_allclose(t_grad.numpy(), (-(1 / bandwidth) * window * gn).sum(0), rtol=1e-14)
