"""What :class:`~lightning_iocatch.lightning.sae.SAEModule` measures in validation beyond
the reconstruction: the latents' density (a
:class:`~lightning_iocatch.probes.UnitActivations`), and, given the language model the
activations came from, the SAE spliced into it on held-out text (an
:class:`~lightning_iocatch.InterventionEffects`: CE loss recovered against zero
ablation, and KL).

Examples:
    >>> effects = splice_effects("model.layers.1", lambda h: h)
    >>> [name for name in effects.names() if name.endswith("recovered")]
    ['sae/sae/loss_recovered']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.edits import Replace, Zero
from lightning_iocatch.lightning.effects import InterventionEffects
from lightning_iocatch.lightning.health_histograms import _wandb_logger_class
from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.token_mask import real_tokens

__all__ = ["LanguageModelHooks", "checked_layer", "layer_rows", "log_density", "splice_effects"]

MODEL = "language_model"
"""Where SAEModule holds the language model (the names its edits use start with it)."""


def splice_effects(layer: str, reconstruct: Callable[[Tensor], Tensor]) -> InterventionEffects:
    """The effects of the SAE's reconstruction (``reconstruct``) and of zero ablation at
    the language model's ``layer`` on its next-token loss, logged as ``sae/...``."""
    where = f"{MODEL}.{layer}"
    return InterventionEffects(
        {"sae": [Replace(where, reconstruct)], "zero": [Zero(where)]},
        recovered={"sae": "zero"},
        forward=run_language_model,
        reuse=False,  # the validation step's forward captures the layer: not a clean one
        prefix="sae",
    )


def run_language_model(module: pl.LightningModule, batch: Any) -> Any:
    """The language model on a batch of text: ``model(**batch)`` for a mapping (a
    tokenizer's output; with ``use_cache=False`` where the model takes it: nothing decodes
    from its cache), ``model(batch[0])`` for a tuple, ``model(batch)`` otherwise."""
    model = getattr(module, MODEL)
    if isinstance(batch, Mapping):
        if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in batch:
            return model(**batch, use_cache=False)
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(batch[0])
    return model(batch)


def layer_rows(
    module: pl.LightningModule, layer: str, batch: Any, kept: list[bool] | None = None
) -> Tensor:
    """The rows the SAE reads from a batch of text: ``layer``'s output at each real token
    (the batch's ``attention_mask``; every position without one) of the samples ``kept``
    (all by default), ``(tokens, d_in)``."""
    model: nn.Module = getattr(module, MODEL)
    with ModelIOCatcher(model, module.device).from_spec(f"outputs[{layer}]") as captured:
        run_language_model(module, batch)
    output = captured[layer]["outputs"][0]
    hidden = output[0] if isinstance(output, tuple | list) else output
    if hidden.dim() < 3:  # one row a sample
        return hidden if kept is None else hidden[torch.tensor(kept, device=hidden.device)]
    found = real_tokens(batch, "SAEModule")
    mask = torch.ones(hidden.shape[:2], dtype=torch.bool) if found is None else found.bool()
    mask = mask.to(hidden.device)
    if kept is not None:
        mask = mask & torch.tensor(kept, device=hidden.device)[:, None]
    return hidden[mask]


def log_density(trainer: pl.Trainer, name: str, summary: UnitSummary, step: int) -> None:
    """The latents' density histogram (``log10`` of each live latent's firing frequency)
    to every logger that takes histograms (TensorBoard, W&B; process 0 only)."""
    if not trainer.is_global_zero or not summary.units:
        return
    counts, edges, _ = summary.density_histogram()
    wandb_logger = _wandb_logger_class()
    for logger in trainer.loggers:
        if wandb_logger is not None and isinstance(logger, wandb_logger):
            import wandb

            histogram = wandb.Histogram(np_histogram=(counts.numpy(), edges.numpy()))
            logger.experiment.log({name: histogram, "trainer/global_step": step})  # type: ignore[attr-defined]
            continue
        add = getattr(getattr(logger, "experiment", None), "add_histogram_raw", None)
        if callable(add) and int(counts.sum()):
            alive = summary.density()[summary.active > 0].log10().numpy()
            add(
                tag=name, min=float(alive.min()), max=float(alive.max()), num=int(alive.size),
                sum=float(alive.sum()), sum_squares=float(np.square(alive).sum()),
                bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(),
                global_step=step,
            )  # fmt: skip


def checked_layer(model: nn.Module | None, layer: str | None) -> str | None:
    """``layer``, checked to be a module of ``model`` (both given, or neither)."""
    if model is None and layer is None:
        return None
    if model is None or layer is None:
        raise ValueError("SAEModule: give both `language_model` and `layer`, or neither")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`language_model` must be an nn.Module, got {type(model).__name__}")
    names = dict(model.named_modules())
    if layer not in names:
        near = [name for name in names if name.endswith(layer.rsplit(".", 1)[-1])][:3]
        raise ValueError(
            f"SAEModule: `layer` {layer!r} is not a module of the language model"
            + (f"; did you mean {near}?" if near else "")
            + " (list them with `lightning-iocatch modules`)"
        )
    return layer


class LanguageModelHooks(pl.LightningModule):
    """The hooks of :class:`~lightning_iocatch.lightning.sae.SAEModule` for its
    ``language_model=``: the splice's effects as a callback, the model's modes given back
    after fit, its weights left out of checkpoints (and taken from the given model when one
    is loaded)."""

    layer: str | None
    language_model: nn.Module
    objective: Any
    _model_modes: dict[nn.Module, bool]

    @override
    def on_fit_start(self) -> None:
        if self.layer is not None:  # the model's modes, given back after fit
            self._model_modes = {m: m.training for m in self.language_model.modules()}
            self.language_model.train()  # unused in training; validation sets eval mode

    @override
    def teardown(self, stage: str) -> None:
        for module, training in getattr(self, "_model_modes", {}).items():
            module.train(training)
        self._model_modes = {}

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        return [] if self.layer is None else [splice_effects(self.layer, self._reconstruct)]

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict", {})
        for name in [name for name in state if name.startswith(f"{MODEL}.")]:
            del state[name]

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if self.layer is not None and state is not None:  # not saved: the given model's
            for name, value in self.language_model.state_dict().items():
                state[f"{MODEL}.{name}"] = value

    def _reconstruct(self, hidden: Tensor) -> Tensor:
        """The SAE's reconstruction of a layer's output, at its scale (through the
        objective's forward, where a strategy gathers the parameters)."""
        step = self.objective(hidden.reshape(-1, hidden.shape[-1]))
        raw = step.reconstruction / self.objective.sae.input_scale.to(step.reconstruction.dtype)
        return raw.reshape(hidden.shape)
