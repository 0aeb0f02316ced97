"""SAELens' checkpoint directory, both ways: ``cfg.json``, ``sae_weights.safetensors`` and
``sparsity.safetensors``, as ``sae_lens.SAE.load_from_disk`` reads them.

Saving writes the inference SAE SAELens 6 would save (``save_inference_model``): the
input normalisation and decoder norms folded into the weights
(:meth:`SparseAutoencoder.folded`), a BatchTopK as a JumpReLU with its learned
threshold, ``k`` written for TopK (SAELens' loader would otherwise take 100), and
``metadata.sae_lens_version`` (without it, SAELens runs the file through its pre-6.0
conversion). Loading takes SAELens' inference files and its training checkpoints
(``topk``, ``batchtopk``, ``jumprelu``, ``standard``).

Examples:
    >>> import tempfile
    >>> sae = SparseAutoencoder(8, 16, "topk", k=2, generator=torch.Generator().manual_seed(0))
    >>> path = save_saelens(sae, tempfile.mkdtemp() + "/sae")
    >>> again = load_saelens(path)
    >>> x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    >>> again.architecture, bool(torch.allclose(again.encode(x), sae.encode(x), atol=1e-6))
    ('topk', True)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from lightning_iocatch.sae.model import SparseAutoencoder

__all__ = ["SAELENS_VERSION", "load_saelens", "save_saelens"]

SAELENS_VERSION = "6.54.12"
"""The SAELens release whose format is written (and tested, in a bench environment)."""

_CONFIG, _WEIGHTS, _SPARSITY = "cfg.json", "sae_weights.safetensors", "sparsity.safetensors"
_SCALER = "activation_scaler.json"
_SAELENS_ARCHITECTURE = {"topk": "topk", "batchtopk": "jumprelu", "jumprelu": "jumprelu",
                         "relu": "standard"}  # fmt: skip
_OURS = {"topk": "topk", "batchtopk": "batchtopk", "jumprelu": "jumprelu", "standard": "relu"}


def save_saelens(
    sae: SparseAutoencoder,
    path: str | os.PathLike[str],
    *,
    sparsity: Tensor | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Writes ``sae`` as SAELens' inference SAE in the directory ``path`` (made if needed).

    Args:
        sparsity: each latent's log10 firing frequency (``sparsity.safetensors``, as
            SAELens' trainer saves it), e.g. ``summary.density().log10()`` of
            :class:`~lightning_iocatch.probes.UnitActivations`.
        metadata: SAELens' metadata (``model_name``, ``hook_name``, ``context_size``...).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {name: value.detach().cpu().contiguous() for name, value in sae.folded().items()}
    dtype = str(sae.W_enc.dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architecture": _SAELENS_ARCHITECTURE[sae.architecture],
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": dtype,
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            **(metadata or {}),
            "sae_lens_version": SAELENS_VERSION,
            "sae_lens_training_version": SAELENS_VERSION,
        },
    }
    if sae.architecture == "topk":
        config["k"] = int(sae.k)  # type: ignore[arg-type]
        config["rescale_acts_by_decoder_norm"] = sae.scale_by_decoder_norm
    save_file(weights, str(path / _WEIGHTS))
    if sparsity is not None:
        if tuple(sparsity.shape) != (sae.d_sae,):
            raise ValueError(
                f"`sparsity` must hold one value per latent ({sae.d_sae},), got "
                f"{tuple(sparsity.shape)}"
            )
        save_file({"sparsity": sparsity.detach().float().cpu().contiguous()}, str(path / _SPARSITY))
    (path / _CONFIG).write_text(json.dumps(config, indent=2))
    return path


def load_saelens(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> SparseAutoencoder:
    """The SAE SAELens saved in the directory ``path`` (an inference SAE or a training
    checkpoint), as a :class:`SparseAutoencoder` to splice, browse or train on."""
    path = Path(path)
    if not (path / _CONFIG).is_file() or not (path / _WEIGHTS).is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not an SAELens SAE directory: it needs {_CONFIG} and {_WEIGHTS}"
        )
    config = json.loads((path / _CONFIG).read_text())
    weights = load_file(str(path / _WEIGHTS))
    version = config.get("sae_lens_version") or (config.get("metadata") or {}).get(
        "sae_lens_version"
    )
    if not version or int(str(version).split(".")[0]) < 6:
        raise ValueError(
            f"{str(path)!r} was written before SAELens 6 (version {version!r}): load it "
            "with sae_lens.SAE.load_from_disk and save it again with SAELens 6"
        )
    architecture = config.get("architecture")
    if architecture not in _OURS:
        raise ValueError(
            f"{str(path)!r} holds an SAELens {architecture!r} SAE; SAEModule loads {sorted(_OURS)}"
        )
    normalization = config.get("normalize_activations", "none")
    if normalization not in ("none", "expected_average_only_in"):
        raise ValueError(
            f"{str(path)!r} normalises its inputs at run time ({normalization!r}), which "
            "SparseAutoencoder does not: fold it into the weights first"
        )
    sae = _built(config, weights, _OURS[architecture], dtype)
    scaler = path / _SCALER  # a training checkpoint's factor, not folded into its weights
    if scaler.is_file():
        saved = json.loads(scaler.read_text())
        if saved.get("whitening") or saved.get("has_whitening"):
            raise ValueError(
                f"{str(scaler)!r} whitens the inputs, which SparseAutoencoder does not"
            )
        if saved.get("scaling_factor") is not None:
            sae.input_scale.fill_(float(saved["scaling_factor"]))
    elif normalization == "expected_average_only_in":
        raise ValueError(
            f"{str(path)!r} is a training checkpoint whose inputs are scaled by a factor kept in "
            f"{_SCALER}, which is not there: copy it in from the checkpoint, or load the SAE "
            "SAELens exported at the end of training"
        )
    return sae


def _built(
    config: dict[str, Any], weights: dict[str, Tensor], architecture: str, dtype: torch.dtype | None
) -> SparseAutoencoder:
    w_enc = weights["W_enc"]
    dtype = dtype or w_enc.dtype
    k = config.get("k") if architecture in ("topk", "batchtopk") else None
    if architecture in ("topk", "batchtopk") and k is None:
        raise ValueError(f"this SAELens {architecture!r} SAE's cfg.json has no `k`")
    sae = SparseAutoencoder(
        int(config["d_in"]),
        int(config["d_sae"]),
        architecture,  # type: ignore[arg-type]
        k,
        scale_by_decoder_norm=bool(config.get("rescale_acts_by_decoder_norm", False)),
        dtype=dtype,
    )
    b_enc = weights["b_enc"].double()
    if not config.get("apply_b_dec_to_input", True):  # (x - b_dec) @ W_enc + b_enc + b_dec @ W_enc
        b_enc = b_enc + weights["b_dec"].double() @ w_enc.double()
    with torch.no_grad():
        for name, value in (("W_enc", w_enc), ("b_enc", b_enc), ("W_dec", weights["W_dec"]),
                            ("b_dec", weights["b_dec"])):  # fmt: skip
            getattr(sae, name).copy_(value.to(dtype))
        if architecture == "jumprelu":  # SAELens before 6.x's direct threshold: its log
            threshold = weights.get("threshold")
            if threshold is None:
                threshold = weights["log_threshold"].exp()
            sae.threshold.copy_(threshold.float())
        if architecture == "batchtopk":
            sae.topk_threshold.copy_(weights["topk_threshold"].double())
    return sae
