"""The step's cheaper arithmetic against the dense one it replaces.

``sparse_decode.decode`` against ``dense latents @ W_dec`` (values and both gradients,
float64, rows of every size including empty ones, and torch's gradcheck);
``training_losses`` by default against ``saelens_arithmetic=True`` (SAELens' own
products) for every architecture: losses, latents, reconstruction and every parameter's
gradient to float64 rounding, across simulated processes too; the dead latents' top-k
taken among their columns against SAELens' top-k over all latents with the live ones at
``-inf``, bit for bit; JumpReLU and Step against SAELens' mask products, bit for bit in
float32, at the kernel's edges and on the threshold itself.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_iocatch.sae import training_losses
from lightning_iocatch.sae.activations import JumpReLU, Step
from lightning_iocatch.sae.losses import aux_k_loss
from lightning_iocatch.sae.sparse_decode import Chosen, _Decode, decode
from tests.sae.test_sae_losses import K, rows
from tests.sae.test_sae_model import D_SAE, simulated_ranks, trained_looking


def dense_of(chosen: Chosen, d_sae: int, values: torch.Tensor) -> torch.Tensor:
    """The dense latents of ``chosen`` with ``values``, built without the module."""
    out = torch.zeros(chosen.offsets.numel() - 1, d_sae, dtype=values.dtype)
    for row in range(out.shape[0]):
        start, end = int(chosen.offsets[row]), int(chosen.offsets[row + 1])
        out[row, chosen.latents[start:end]] = values[start:end]
    return out


def choices() -> list[Chosen]:
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(6, 11, dtype=torch.float64, generator=generator)
    mask = torch.rand(6, 11, generator=generator) > 0.55
    mask[1] = False  # a row with nothing chosen
    mask[4] = True  # a row with everything
    indices = torch.rand(6, 11, generator=generator).argsort(-1)[:, :4]  # unsorted, as topk
    return [
        Chosen.of_mask(values, mask),
        Chosen.of_rows(indices, torch.rand(6, 4, dtype=torch.float64, generator=generator)),
    ]


@pytest.mark.parametrize("which", [0, 1])
def test_decode_and_its_gradients_equal_the_dense_product(which) -> None:
    chosen = choices()[which]
    generator = torch.Generator().manual_seed(4)
    W_dec = torch.randn(11, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    upstream = torch.randn(6, 5, dtype=torch.float64, generator=generator)
    values = chosen.values.detach().clone().requires_grad_(True)
    found = decode(chosen._replace(values=values), W_dec)
    found_grads = torch.autograd.grad(found, (values, W_dec), upstream)

    dense_values = values.detach().clone().requires_grad_(True)
    truth = dense_of(chosen, 11, dense_values) @ W_dec
    truth_grads = torch.autograd.grad(truth, (dense_values, W_dec), upstream)
    torch.testing.assert_close(found, truth, rtol=0, atol=1e-13)
    for mine, theirs in zip(found_grads, truth_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-13)
    assert torch.equal(chosen.dense(11), dense_of(chosen, 11, chosen.values))
    assert torch.autograd.gradcheck(
        lambda v, w: _Decode.apply(v, chosen.offsets, chosen.latents, w),
        (values.detach().clone().requires_grad_(True), W_dec.detach().clone().requires_grad_(True)),
    )


def parameter_gradients(sae, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*sae.named_parameters(), strict=True)
    found = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return dict(zip(names, found, strict=True))


@pytest.mark.parametrize("architecture", list(K))
@pytest.mark.parametrize("n_dead", [0, 3, 13])  # none, fewer than d_in // 2, more
def test_the_default_arithmetic_is_saelens_to_float64_rounding(architecture, n_dead) -> None:
    sae = trained_looking(architecture, K[architecture])
    x = rows(9)
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[torch.randperm(D_SAE, generator=torch.Generator().manual_seed(n_dead))[:n_dead]] = True
    options = {"dead": dead, "sparsity": 0.6, "aux_k_coefficient": 1.2}
    fast = training_losses(sae, sae.scaled(x), **options)
    exact = training_losses(sae, sae.scaled(x), saelens_arithmetic=True, **options)
    assert sorted(fast.losses) == sorted(exact.losses)
    for name, value in exact.losses.items():
        torch.testing.assert_close(fast.losses[name], value, rtol=1e-13, atol=1e-15, msg=name)
    if architecture in ("topk", "batchtopk") and n_dead:
        assert float(exact.losses["auxiliary_reconstruction_loss"].detach()) > 0
    torch.testing.assert_close(fast.latents, exact.latents.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(fast.reconstruction, exact.reconstruction, rtol=0, atol=1e-13)
    found, truth = parameter_gradients(sae, fast.loss), parameter_gradients(sae, exact.loss)
    for name, value in truth.items():
        assert value.abs().max() > 0, name
        torch.testing.assert_close(found[name], value, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
def test_the_default_arithmetic_across_processes_is_the_one_process_gradient(architecture) -> None:
    sae = trained_looking(architecture, K[architecture])
    x = rows(11)
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::4] = True
    whole = parameter_gradients(
        sae, training_losses(sae, sae.scaled(x), dead=dead, saelens_arithmetic=True).loss
    )
    per_rank = simulated_ranks(
        x.split([4, 7]),
        lambda chunk, across: parameter_gradients(
            sae, training_losses(sae, sae.scaled(chunk), dead=dead, across=across).loss
        ),
    )
    for name, truth in whole.items():
        averaged = sum(rank[name] for rank in per_rank) / 2
        torch.testing.assert_close(averaged, truth, rtol=1e-10, atol=1e-12, msg=name)


def saelens_aux_acts(pre: torch.Tensor, dead: torch.Tensor, k_aux: int) -> torch.Tensor:
    """SAELens 6's choice: a top-k over every latent, the live ones at -inf."""
    only_dead = torch.where(dead[None], pre, -torch.inf)
    chosen = only_dead.topk(k_aux, sorted=False)
    return torch.zeros_like(pre).scatter_(-1, chosen.indices, chosen.values)


@pytest.mark.parametrize("n_dead", [2, 4, 20])  # below, at and above k_aux = 4
def test_the_dead_latents_top_k_is_saelens_bit_for_bit(n_dead) -> None:
    sae = trained_looking("topk", 3)
    scaled = sae.scaled(rows(10))
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[torch.randperm(D_SAE, generator=torch.Generator().manual_seed(1))[:n_dead]] = True
    step = training_losses(sae, scaled, dead=None, saelens_arithmetic=True)
    pre = step.pre.detach().requires_grad_(True)
    found = aux_k_loss(sae, scaled, step.reconstruction.detach(), pre, dead, (10, 1))
    (found_grad,) = torch.autograd.grad(found, pre)

    pre_ = step.pre.detach().requires_grad_(True)
    acts = saelens_aux_acts(pre_, dead, min(scaled.shape[1] // 2, n_dead))
    residual = (scaled - step.reconstruction).detach()
    error = (sae.decode_scaled(acts, bias=False) - residual).pow(2).sum(-1)
    truth = min(n_dead / (scaled.shape[1] // 2), 1.0) * error.mean()
    (truth_grad,) = torch.autograd.grad(truth, pre_)
    assert torch.equal(found, truth)
    assert torch.equal(found_grad, truth_grad)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns: tells -0.0 from 0.0, and NaN equals itself."""
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@pytest.mark.parametrize("autocast", [False, True])
def test_the_pre_activations_are_saelens_values_and_b_dec_gradient(autocast) -> None:
    exact = trained_looking("jumprelu", None)
    with torch.no_grad():
        exact.b_dec.mul_(40.0)  # inputs with a large mean: b_dec far larger than x - b_dec
    sae = copy.deepcopy(exact).float()
    x = rows(12) + exact.b_dec.detach() / float(exact.input_scale)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        found = sae.pre_activations(sae.scaled(x), b_dec_vector_gradient=True)
        truth = sae.pre_activations(sae.scaled(x))
    assert found.dtype == truth.dtype == torch.float32
    assert torch.equal(bits(found), bits(truth))  # SAELens' values, bit for bit
    upstream = torch.randn(found.shape, dtype=torch.float64)
    (mine,) = torch.autograd.grad(found, sae.b_dec, upstream.float())
    (theirs,) = torch.autograd.grad(truth, sae.b_dec, upstream.float())
    (exact_grad,) = torch.autograd.grad(
        exact.pre_activations(exact.scaled(x)), exact.b_dec, upstream
    )
    mine_error = float((mine.double() - exact_grad).abs().max())
    their_error = float((theirs.double() - exact_grad).abs().max())
    assert mine_error <= their_error + 1e-6 * float(exact_grad.abs().max())  # as close, or closer


def test_chosen_latents_are_a_valid_compressed_sparse_row_pattern() -> None:
    for chosen in choices():
        counts = chosen.offsets.diff()
        torch.sparse_csr_tensor(  # raises where a row's latents are not ascending
            chosen.offsets, chosen.latents, chosen.values, (counts.numel(), 11),
            check_invariants=True,
        )  # fmt: skip


def saelens_jumprelu(x, threshold, bandwidth, upstream):
    """SAELens 6's JumpReLU and Step, as it writes them: masks multiplied as 0 or 1."""

    def rectangle(u):
        return ((u > -0.5) & (u < 0.5)).to(u)

    out = (x * (x > threshold)).to(x)
    x_grad = (x > threshold) * upstream
    window = rectangle((x - threshold) / bandwidth)
    threshold_grad = torch.sum(-(threshold / bandwidth) * window * upstream, dim=0)
    step = (x > threshold).to(x)
    step_grad = torch.sum(-(1.0 / bandwidth) * window * upstream, dim=0)
    return out, x_grad, threshold_grad, step, step_grad


def test_jumprelu_and_step_are_saelens_bit_for_bit_at_their_edges() -> None:
    generator = torch.Generator().manual_seed(5)
    bandwidth = 0.25
    threshold = torch.tensor([0.0, 0.5, 1.0, -0.25, 0.75, 2.0])
    x = torch.randn(64, 6, generator=generator)
    x[0], x[1] = threshold, threshold + bandwidth / 2  # on the threshold; on the kernel's edge
    x[2], x[3] = threshold - bandwidth / 2, torch.nextafter(threshold, threshold + 1)
    x[4] = -0.0
    upstream = torch.randn(64, 6, generator=generator)
    x_, t_ = x.clone().requires_grad_(True), threshold.clone().requires_grad_(True)
    out = JumpReLU.apply(x_, t_, bandwidth)
    x_grad, t_grad = torch.autograd.grad(out, (x_, t_), upstream)
    t2 = threshold.clone().requires_grad_(True)
    step = Step.apply(x, t2, bandwidth)
    (step_grad,) = torch.autograd.grad(step, t2, upstream)
    truth = saelens_jumprelu(x, threshold, bandwidth, upstream)
    for mine, theirs in zip((out, x_grad, t_grad, step, step_grad), truth, strict=True):
        assert torch.equal(bits(mine), bits(theirs))
    assert 0 < int((truth[1] != 0).sum()) < x.numel()  # some pass, some do not


def test_jumprelu_threshold_gradient_far_from_the_kernel_is_zero_in_half_precision() -> None:
    x = torch.tensor([[1000.0, 1.01]], dtype=torch.float16)  # far outside; inside
    threshold = torch.tensor([1.0, 1.0], dtype=torch.float16, requires_grad=True)
    upstream = torch.tensor([[4000.0, 4000.0]], dtype=torch.float16)  # threshold/bw * 4000: inf
    out = JumpReLU.apply(x, threshold, 0.05)
    (found,) = torch.autograd.grad(out, threshold, upstream)
    truth = saelens_jumprelu(x, threshold.detach(), 0.05, upstream)[2]
    assert torch.equal(bits(found), bits(truth))
    assert found[0] == 0 and torch.isinf(found[1])  # SAELens' 0 outside, its overflow inside


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_are_as_accurate_as_saelens_arithmetic(dtype) -> None:
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::2] = True
    exact64 = trained_looking("topk", 3)
    x = clear_choices(exact64, rows(200), dead)[:16]
    truth = parameter_gradients(
        exact64,
        training_losses(exact64, exact64.scaled(x), dead=dead, saelens_arithmetic=True).loss,
    )
    sae = trained_looking("topk", 3).to(dtype)
    fast = parameter_gradients(sae, training_losses(sae, sae.scaled(x), dead=dead).loss)
    exact = parameter_gradients(
        sae, training_losses(sae, sae.scaled(x), dead=dead, saelens_arithmetic=True).loss
    )
    for name, value in truth.items():  # the same size of error from float64's gradient
        assert fast[name].dtype == dtype
        fast_error = float((fast[name].double() - value).abs().max())
        exact_error = float((exact[name].double() - value).abs().max())
        half_step = torch.finfo(dtype).eps * float(value.abs().max())
        assert fast_error <= 2 * exact_error + 4 * half_step, name


def clear_choices(sae, x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` whose top-k choices (TopK's ``k`` and the auxiliary loss's 4 dead
    latents) are clear: a gap of 5 % of the row's largest pre-activation, so that half
    precision's rounding cannot tip them."""
    with torch.no_grad():
        pre = sae.pre_activations(sae.scaled(x))
        top = pre.topk(int(sae.k) + 1).values
        dead_top = pre[:, dead].topk(5).values
        gap = 0.05 * pre.abs().amax(-1)
        clear = (top[:, -2] - top[:, -1] > gap) & (dead_top[:, -2] - dead_top[:, -1] > gap)
    assert int(clear.sum()) >= 16
    return x[clear]
