"""SAEModule in real ``Trainer.fit`` runs on CPU, against figures computed independently.

The reconstruction error falls on low-rank rows for every architecture; every batch form
gives the run of the plain tensor; the input normalisation is NumPy's
``sqrt(d_in) / mean row norm`` over the first batches, which take no optimizer step; the
dead-latent counts, the dead masks handed to each step and BatchTopK's running threshold
follow their definitions (SAELens': rows since a latent last fired; ``0.99 t + 0.01 min``
in float64) replayed over the latents each step produced; the validation figures are
NumPy float64 sums over the whole validation set; bf16-mixed keeps float32 parameters.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.sae import SAEModule
from tests.sae.test_sae_model import numpy_decode, numpy_encode

D_IN, D_SAE, ROWS = 16, 64, 32
K = {"topk": 4, "batchtopk": 4.0, "jumprelu": None, "relu": None}


def low_rank(batches: int, rows: int = ROWS, seed: int = 0) -> list[torch.Tensor]:
    """Rows of one 4-dimensional non-negative mixture plus a little noise (``seed``: the
    draws; the mixture is always the same)."""
    basis = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.relu(torch.randn(rows, 4, generator=generator)) @ basis
        + 0.05 * torch.randn(rows, D_IN, generator=generator)
        for _ in range(batches)
    ]


def fit(module: SAEModule, batches: list[Any], *, val: list[Any] | None = None, **options):
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         **options)  # fmt: skip
    loader = DataLoader(batches, batch_size=None, shuffle=False)
    val_loader = None if val is None else DataLoader(val, batch_size=None, shuffle=False)
    trainer.fit(module, loader, val_loader)
    return trainer


def mse(module: SAEModule, rows: torch.Tensor) -> float:
    sae = copy.deepcopy(module.sae).eval()  # the module's own stays in training mode
    with torch.no_grad():
        return float(((sae(rows) - rows) ** 2).sum(-1).mean())


class Steps:
    """What each training step handed to and got from the objective."""

    def __init__(self, module: SAEModule) -> None:
        self.latents: list[torch.Tensor] = []
        self.dead: list[torch.Tensor] = []
        module.objective.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, objective: Any, args: Any, kwargs: dict, output: Any) -> None:
        if objective.training:
            self.latents.append(output.latents.detach().clone())
            self.dead.append(kwargs["dead"].clone())


@pytest.mark.parametrize("architecture", list(K))
def test_training_lowers_the_reconstruction_error(architecture) -> None:
    data = low_rank(25)
    held_out = torch.cat(low_rank(2, seed=1))
    sparsity = {"relu": 1e-3, "jumprelu": 1e-3}.get(architecture, 1.0)
    module = SAEModule(D_IN, D_SAE, architecture, K[architecture], lr=1e-2,
                       sparsity_coefficient=sparsity)  # fmt: skip
    before = mse(module, held_out)
    trainer = fit(module, data)
    assert trainer.global_step == 25
    after = mse(module, held_out)
    assert after < 0.5 * before, (before, after)


def forms() -> dict[str, tuple[Any, Any]]:
    """Each batch form: a function of the rows, and the module's ``key``."""
    return {
        "dict with key": (lambda x: {"h": x, "other": x * 2}, "h"),
        "dict of one float tensor": (lambda x: {"h": x, "ids": torch.arange(len(x))}, None),
        "tuple": (lambda x: (x, torch.zeros(len(x))), None),
        "list": (lambda x: [x], None),
        "3-d tensor": (lambda x: x.reshape(4, -1, D_IN), None),
    }


def test_every_batch_form_trains_on_its_rows() -> None:
    data = low_rank(3)
    plain = SAEModule(D_IN, D_SAE, "topk", 4, lr=1e-2)
    fit(plain, data)
    assert not torch.equal(plain.sae.W_enc, SAEModule(D_IN, D_SAE, "topk", 4).sae.W_enc)
    for form, (make, key) in forms().items():
        module = SAEModule(D_IN, D_SAE, "topk", 4, lr=1e-2, key=key)
        trainer = fit(module, [make(x) for x in data])
        assert trainer.global_step == 3, form
        for name, value in plain.sae.state_dict().items():
            torch.testing.assert_close(module.sae.state_dict()[name], value, rtol=0, atol=0)


def test_batches_it_cannot_read_are_refused() -> None:
    x = low_rank(1)[0]
    with pytest.raises(ValueError, match=r"the batch holds \['a', 'b'\]: name the rows' key "
                       r"with SAEModule\(key=...\)"):  # fmt: skip
        fit(SAEModule(D_IN, D_SAE, "topk", 4), [{"a": x, "b": x}])
    with pytest.raises(ValueError, match=rf"rows of width d_in={D_IN} expected, got \(32, 5\)"):
        fit(SAEModule(D_IN, D_SAE, "topk", 4), [x[:, :5]])
    with pytest.raises(ValueError, match=rf"rows of width d_in={D_IN} expected, got str"):
        fit(SAEModule(D_IN, D_SAE, "topk", 4), [("text", x)])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"d_in": None, "d_sae": 8}, r"SAEModule needs `d_in` and `d_sae`, or an `sae` to train"),
        ({"sae": "x"}, r"`sae` must be a SparseAutoencoder, got str"),
        ({"normalize_batches": -1}, r"`normalize_batches` must be a non-negative int, got -1"),
        ({"lr_warmup_steps": 1.5}, r"`lr_warmup_steps` must be a non-negative int, got 1.5"),
        ({"dead_after_tokens": True}, r"`dead_after_tokens` must be a non-negative int"),
        ({"lr_schedule": "linear"}, r"`lr_schedule` must be 'constant' or 'cosine', got 'linear'"),
    ],
)
def test_bad_arguments_are_refused(options, match) -> None:
    arguments = {"d_in": D_IN, "d_sae": D_SAE, "architecture": "relu", **options}
    with pytest.raises((ValueError, TypeError), match=match):
        SAEModule(**arguments)


def test_normalisation_is_estimated_from_the_first_batches_without_steps() -> None:
    data = [x * 3.0 + 1.0 for x in low_rank(6)]
    data[1] = data[1][:20]  # batches of different sizes: a mean over rows, not over batches
    module = SAEModule(D_IN, D_SAE, "topk", 4, lr=1e-2, normalize_batches=2)
    start = module.sae.W_enc.detach().clone()
    steps = Steps(module)
    trainer = fit(module, data)
    assert trainer.global_step == 4 and len(steps.latents) == 4
    norms = np.linalg.norm(np.concatenate([x.double().numpy() for x in data[:2]]), axis=1)
    # rows' norms are float32 (as SAELens'), their sum float64
    assert float(module.sae.input_scale) == pytest.approx(math.sqrt(D_IN) / norms.mean(), 1e-6)
    assert not torch.equal(module.sae.W_enc, start)


def test_dead_latents_are_counted_in_rows_since_they_fired() -> None:
    data = low_rank(12)
    data[5] = data[5][:17]  # a short batch counts its own rows
    module = SAEModule(D_IN, D_SAE, "topk", 2, lr=1e-2, dead_after_tokens=2 * ROWS)
    steps = Steps(module)
    fit(module, data)
    since = np.zeros(D_SAE, dtype=np.int64)
    for latents, dead, x in zip(steps.latents, steps.dead, data, strict=True):
        np.testing.assert_array_equal(dead.numpy(), since > 2 * ROWS)
        since += len(x)
        since[(latents.numpy() != 0).any(0)] = 0
    np.testing.assert_array_equal(module.tokens_since_fired.numpy(), since)
    assert (since > 2 * ROWS).any() and (since == 0).any()  # some died, some fire


def test_batchtopk_threshold_is_the_running_average_of_each_batch_smallest_kept() -> None:
    module = SAEModule(D_IN, D_SAE, "batchtopk", 3.0, lr=1e-2)
    steps = Steps(module)
    fit(module, low_rank(10))
    threshold = 0.0
    for latents in steps.latents:
        smallest = latents[latents > 0].double().min().item()
        threshold = 0.99 * threshold + 0.01 * smallest
    assert float(module.sae.topk_threshold) == pytest.approx(threshold, rel=1e-13)
    assert module.sae.topk_threshold.dtype == torch.float64 and threshold > 0


def test_bf16_mixed_keeps_float32_parameters_and_trains() -> None:
    data = low_rank(20)
    module = SAEModule(D_IN, D_SAE, "topk", 4, lr=3e-3)
    before = mse(module, data[0])
    fit(module, data, precision="bf16-mixed")
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert mse(module, data[0]) < 0.7 * before


def numpy_figures(module: SAEModule, val: list[torch.Tensor]) -> dict[str, float]:
    """The validation figures over all rows, in the SAE's normalised space, in float64."""
    sae = module.sae.eval()
    x = np.concatenate([v.double().numpy() for v in val])
    scale = float(sae.input_scale)
    latents = numpy_encode(sae, x)
    error = ((scale * numpy_decode(sae, latents) - scale * x) ** 2).sum()
    spread = ((scale * x - (scale * x).mean(0)) ** 2).sum()
    return {"mse": error / len(x), "normalized_mse": error / (scale * scale * (x**2).sum()),
            "explained_variance": 1 - error / spread,
            "l0": (latents != 0).sum() / len(x)}  # fmt: skip


@pytest.mark.parametrize(("architecture", "normalize"), [("topk", 0), ("relu", 0), ("topk", 2)])
def test_validation_figures_are_those_of_the_whole_validation_set(architecture, normalize) -> None:
    val = [x + 2.0 for x in low_rank(3, seed=5)]
    val[2] = val[2][:7]  # uneven batches: sums over rows, not means of batch means
    module = SAEModule(D_IN, D_SAE, architecture, K[architecture], lr=2e-2,
                       normalize_batches=normalize, sparsity_coefficient=1e-3)  # fmt: skip
    trainer = fit(module, [x + 2.0 for x in low_rank(15)], val=val)
    if normalize:
        assert float(module.sae.input_scale) != 1.0
    metrics = trainer.callback_metrics
    expected = numpy_figures(module, val)
    assert 0 < expected["explained_variance"] < 1
    for name, value in expected.items():
        assert float(metrics[f"val/{name}"]) == pytest.approx(value, rel=2e-5), name
