"""The SAE step's sparse decode on a real CUDA device, against the dense product there.

Skipped without CUDA (run it with `benchmarks/gpu_check.sh`). On the GPU the decode's
backward runs cuSPARSE (a sampled product for the chosen entries, a sparse product for
the decoder rows); the ground truth is the dense ``latents @ W_dec`` and its autograd
gradients in float64 on the same device, and ``saelens_arithmetic=True``'s losses and
gradients under bf16 autocast, float32 parameters, as ``bf16-mixed`` trains.
"""

from __future__ import annotations

import pytest
import torch

from lightning_iocatch.sae import SparseAutoencoder, training_losses
from lightning_iocatch.sae.sparse_decode import Chosen, decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_decode_on_cuda_equals_the_dense_product() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    options = {"device": "cuda", "dtype": torch.float64, "generator": generator}
    pre = torch.randn(512, 2048, **options)
    values, indices = pre.topk(64, dim=-1, sorted=False)
    W_dec = torch.randn(2048, 96, **options).requires_grad_(True)
    values = values.relu().requires_grad_(True)
    upstream = torch.randn(512, 96, **options)
    found = decode(Chosen.of_rows(indices, values), W_dec)
    found_grads = torch.autograd.grad(found, (values, W_dec), upstream)
    dense = torch.zeros_like(pre).scatter(-1, indices, values)
    truth = dense @ W_dec
    truth_grads = torch.autograd.grad(truth, (values, W_dec), upstream)
    torch.testing.assert_close(found, truth, rtol=0, atol=1e-12)
    for mine, theirs in zip(found_grads, truth_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
def test_a_bf16_autocast_step_on_cuda_is_saelens_step_to_rounding(architecture) -> None:
    sae = SparseAutoencoder(
        256, 4096, architecture, k=32, generator=torch.Generator().manual_seed(0)
    )
    sae = sae.cuda()
    x = torch.randn(1024, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dead = torch.zeros(4096, dtype=torch.bool, device="cuda")
    dead[::7] = True
    found, truth = {}, {}
    for exact, into in ((False, found), (True, truth)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step = training_losses(sae, sae.scaled(x), dead=dead, saelens_arithmetic=exact)
        names, params = zip(*sae.named_parameters(), strict=True)
        grads = torch.autograd.grad(step.loss, params)
        into.update(loss=step.loss.detach(), **dict(zip(names, grads, strict=True)))
    for name, value in truth.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(found[name], value, rtol=0, atol=0.02 * scale, msg=name)
