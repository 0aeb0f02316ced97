"""SAE corners a review found: the learning rate after the schedule's end (SAELens' LinearLR
stays at 0), padded token batches (only real tokens train), a JumpReLU threshold left below
0 by the last step (no negative latents, as SAELens' inference), SAELens training
checkpoints with their activation scaler, gradients clipped after AMP unscales them,
hyperparameters of a module built from an SAE, logs sent at Lightning's steps."""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch.lightning.sae import SAEModule
from lightning_iocatch.lightning.sae.schedule import lr_factor
from lightning_iocatch.lightning.sae.statistics import batch_rows
from lightning_iocatch.sae import SparseAutoencoder, load_saelens, save_saelens


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*no `val_dataloader`.*")


def _trainer(**options: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(accelerator="cpu", max_epochs=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False)  # fmt: skip
    return pl.Trainer(**{**defaults, **options})


def _rows(n: int = 256, width: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(n, width, generator=generator) @ torch.randn(
        width, width, generator=generator
    )


def test_the_learning_rate_stays_at_zero_after_the_decay_and_at_the_end_after_a_cosine() -> None:
    decay = lr_factor(warmup=0, decay=2, total=5, schedule="constant", end_ratio=1.0)
    assert [decay(step) for step in range(9)] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    cosine = lr_factor(warmup=0, decay=0, total=4, schedule="cosine", end_ratio=0.1)
    assert [round(cosine(step), 12) for step in (4, 5, 9)] == [0.1, 0.1, 0.1]
    assert cosine(0) == 1.0 and math.isfinite(
        lr_factor(warmup=2, decay=2, total=4, schedule="cosine", end_ratio=0.1)(2)
    )


def test_padded_token_batches_give_their_real_tokens_only() -> None:
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    rows = batch_rows({"h": hidden, "attention_mask": mask}, "h", 4)
    assert torch.equal(rows, hidden[mask.bool()])
    kept = batch_rows({"h": hidden, "attention_mask": mask}, "h", 4, kept=[False, True])
    assert torch.equal(kept, hidden[1])
    module = SAEModule(4, 8, "topk", k=2, key="h", normalize_batches=1)
    _trainer(max_steps=1).fit(module, DataLoader([{"h": hidden, "attention_mask": mask}] * 2,
                                                  batch_size=None))  # fmt: skip
    real = hidden[mask.bool()].double()
    assert int(module.norm_rows) == 5
    assert float(module.norm_sum) == pytest.approx(float(real.norm(dim=-1).sum()), rel=1e-12)


def test_a_jumprelu_threshold_below_zero_gives_no_negative_latent_outside_training(
    tmp_path: Path,
) -> None:
    sae = SparseAutoencoder(8, 32, "jumprelu", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sae.threshold.fill_(-0.05)
        sae.b_enc.fill_(-0.01)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    latents = sae.eval().encode(x)
    pre = sae.pre_activations(sae.scaled(x))
    assert float(latents.detach().min()) >= 0
    assert torch.equal(latents, pre.relu())  # above every threshold, ReLU'd
    again = load_saelens(save_saelens(sae, tmp_path / "sae"))
    assert float(again.threshold.min()) == 0.0
    assert torch.equal(again.eval().encode(x), latents)


def test_a_saelens_training_checkpoint_loads_with_its_activation_scaler(tmp_path: Path) -> None:
    sae = SparseAutoencoder(8, 16, "topk", k=3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        sae.input_scale.fill_(2.5)
    weights = {
        name: getattr(sae, name).detach().clone() for name in ("W_enc", "b_enc", "W_dec", "b_dec")
    }
    config = {"architecture": "topk", "d_in": 8, "d_sae": 16, "k": 3,
              "rescale_acts_by_decoder_norm": True,
              "normalize_activations": "expected_average_only_in",
              "metadata": {"sae_lens_version": "6.54.12"}}  # fmt: skip
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    save_file(weights, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_scaler.json, which is not there"):
        load_saelens(folder)
    (folder / "activation_scaler.json").write_text(
        json.dumps({"scaling_factor": 2.5, "has_whitening": False})
    )
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(load_saelens(folder).encode(x), sae.encode(x), atol=1e-6)
    (folder / "activation_scaler.json").write_text(
        json.dumps({"scaling_factor": 2.5, "has_whitening": True})
    )
    with pytest.raises(ValueError, match="whitens the inputs"):
        load_saelens(folder)


class _Recorded(SAEModule):
    """Records the gradients' norm Adam stepped with (its step post-hook: the closure that
    unscales and clips runs inside the step)."""

    norms: list[float]

    def configure_optimizers(self) -> Any:
        found = super().configure_optimizers()
        self.norms = []

        def record(optimizer: Any, *args: Any) -> None:
            grads = [p.grad for p in self.sae.parameters() if p.grad is not None]
            self.norms.append(float(torch.stack([g.norm() for g in grads]).norm()))

        found["optimizer"].register_step_post_hook(record)
        return found


def test_gradients_are_clipped_after_amp_unscales_them() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    rows = DataLoader(TensorDataset(_rows(512) * 10), batch_size=64)  # norms far above 1
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # steps that overflow are skipped
    for plugins in ([], [MixedPrecision("16-mixed", "cpu", scaler=scaler)]):
        module = _Recorded(16, 32, "topk", k=4, lr=1e-3)
        _trainer(max_steps=4, plugins=plugins).fit(module, rows)
        assert module.norms and all(norm == pytest.approx(1.0, rel=1e-3) for norm in module.norms)


def test_a_module_built_from_an_sae_records_its_shape_and_loads_again(tmp_path: Path) -> None:
    sae = SparseAutoencoder(16, 48, "batchtopk", k=4.5, generator=torch.Generator().manual_seed(4))
    module = SAEModule(sae=sae, lr=1e-3)
    assert (module.hparams["d_in"], module.hparams["d_sae"], module.hparams["architecture"],
            module.hparams["k"]) == (16, 48, "batchtopk", 4.5)  # fmt: skip
    trainer = _trainer(max_steps=2)
    trainer.fit(module, DataLoader(TensorDataset(_rows()), batch_size=64))
    trainer.save_checkpoint(tmp_path / "sae.ckpt")
    again = SAEModule.load_from_checkpoint(tmp_path / "sae.ckpt")
    assert torch.equal(again.sae.W_dec, module.sae.W_dec)
    assert again.sae.topk_threshold == module.sae.topk_threshold
    with torch.no_grad():
        sae.input_scale.fill_(3.0)
    with pytest.raises(ValueError, match="already scales its inputs by 3"):
        SAEModule(sae=sae, normalize_batches=4)


def test_training_figures_reach_the_logger_at_lightnings_steps(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    for normalize in (0, 1):
        logger = CSVLogger(tmp_path, name=f"n{normalize}")
        _trainer(max_steps=6, logger=logger, log_every_n_steps=2).fit(
            SAEModule(16, 32, "topk", k=4, normalize_batches=normalize),
            DataLoader(TensorDataset(_rows()), batch_size=32),
        )
        lines = Path(logger.log_dir, "metrics.csv").read_text().splitlines()
        header = lines[0].split(",")
        steps = [row.split(",")[header.index("step")] for row in lines[1:]
                 if row.split(",")[header.index("train/mse")]]  # fmt: skip
        assert len(steps) == 3, (normalize, steps)  # every second of 6 steps, none one late
