"""save_saelens / load_saelens: the files against SAELens' format as documented, and the
loaded SAE against the saved one's function.

Round trips of every architecture with ``input_scale`` != 1 and perturbed weights give
back the same ``encode``/``decode`` (a BatchTopK as the JumpReLU it is out of training);
``cfg.json`` holds what SAELens' loader needs; weights written by hand in SAELens' layout
(``apply_b_dec_to_input=False``, a training checkpoint's ``topk_threshold``) load to the
function written out in NumPy; every refusal is matched by its message.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_iocatch.sae import SAELENS_VERSION, SparseAutoencoder, load_saelens, save_saelens
from tests.sae.test_sae_model import D_IN, D_SAE, trained_looking

CASES = {"topk": 3, "batchtopk": 2.5, "jumprelu": None, "relu": None}
SAVED_AS = {"topk": "topk", "batchtopk": "jumprelu", "jumprelu": "jumprelu", "relu": "standard"}


def in_float32(sae: SparseAutoencoder) -> SparseAutoencoder:
    return sae.float().eval()  # buffers stay float64: input_scale, topk_threshold


@pytest.mark.parametrize("architecture", list(CASES))
def test_round_trip_keeps_the_function(tmp_path, architecture) -> None:
    sae = in_float32(trained_looking(architecture, CASES[architecture], scale=2.5))
    sparsity = torch.linspace(-5, 0, D_SAE)
    path = save_saelens(sae, tmp_path / "sae", sparsity=sparsity, metadata={"hook_name": "h"})
    config = json.loads((path / "cfg.json").read_text())
    assert config["architecture"] == SAVED_AS[architecture]
    assert (config["d_in"], config["d_sae"], config["dtype"]) == (D_IN, D_SAE, "float32")
    assert config["metadata"]["sae_lens_version"] == SAELENS_VERSION
    assert config["metadata"]["hook_name"] == "h"
    assert config["normalize_activations"] == "none" and config["apply_b_dec_to_input"]
    assert config.get("k") == (3 if architecture == "topk" else None)
    weights = load_file(str(path / "sae_weights.safetensors"))
    expected = {"W_enc", "b_enc", "W_dec", "b_dec"} | (
        {"threshold"} if architecture in ("batchtopk", "jumprelu") else set()
    )
    assert set(weights) == expected
    assert weights["W_enc"].shape == (D_IN, D_SAE) and weights["W_dec"].shape == (D_SAE, D_IN)
    assert torch.equal(load_file(str(path / "sparsity.safetensors"))["sparsity"], sparsity)

    again = load_saelens(path).eval()
    assert again.architecture == ("jumprelu" if architecture == "batchtopk" else architecture)
    assert float(again.input_scale) == 1.0  # folded into the weights
    x = torch.randn(16, D_IN) * 1.5
    latents = sae.encode(x)
    assert (latents != 0).any() and (latents == 0).any()
    torch.testing.assert_close(again.encode(x), latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.decode(latents), sae.decode(latents), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again(x), sae(x), rtol=1e-5, atol=1e-5)


def test_load_can_change_the_dtype(tmp_path) -> None:
    sae = in_float32(trained_looking("relu", None))
    again = load_saelens(save_saelens(sae, tmp_path / "sae"), dtype=torch.float64)
    assert again.W_enc.dtype == torch.float64
    x = torch.randn(4, D_IN)
    torch.testing.assert_close(again(x.double()).float(), sae(x), rtol=1e-5, atol=1e-5)


def test_sparsity_of_the_wrong_shape_is_refused(tmp_path) -> None:
    sae = in_float32(trained_looking("relu", None))
    with pytest.raises(ValueError, match=rf"one value per latent \({D_SAE},\), got \(3,\)"):
        save_saelens(sae, tmp_path / "sae", sparsity=torch.zeros(3))


def write(path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(config))
    save_file({name: value.contiguous() for name, value in weights.items()},
              str(path / "sae_weights.safetensors"))  # fmt: skip


def saelens_weights(generator: torch.Generator) -> dict[str, torch.Tensor]:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return {"W_enc": draw(D_IN, D_SAE), "b_enc": 0.2 * draw(D_SAE), "W_dec": draw(D_SAE, D_IN),
            "b_dec": 0.5 * draw(D_IN)}  # fmt: skip


def config(architecture: str, **extra) -> dict:
    return {"architecture": architecture, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float64",
            "metadata": {"sae_lens_version": "6.54.12"}, **extra}  # fmt: skip


def test_files_without_b_dec_on_the_input_load_to_the_same_function(tmp_path) -> None:
    w = saelens_weights(torch.Generator().manual_seed(3))
    write(tmp_path / "sae", config("standard", apply_b_dec_to_input=False), w)
    sae = load_saelens(tmp_path / "sae")
    x = torch.randn(6, D_IN, dtype=torch.float64)
    n = {name: value.numpy() for name, value in w.items()}
    latents = np.maximum(x.numpy() @ n["W_enc"] + n["b_enc"], 0)  # b_dec not subtracted
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), latents, rtol=1e-12, atol=1e-12)
    decoded = latents @ n["W_dec"] + n["b_dec"]
    np.testing.assert_allclose(sae(x).detach().numpy(), decoded, rtol=1e-12, atol=1e-12)


def test_training_checkpoints_load_with_their_own_semantics(tmp_path) -> None:
    generator = torch.Generator().manual_seed(4)
    w = saelens_weights(generator)
    n = {name: value.numpy() for name, value in w.items()}
    norms = np.linalg.norm(n["W_dec"], axis=1)
    x = torch.randn(6, D_IN, dtype=torch.float64)
    pre = ((x.numpy() - n["b_dec"]) @ n["W_enc"] + n["b_enc"]) * norms

    topk_config = config("topk", k=4, rescale_acts_by_decoder_norm=True)
    write(tmp_path / "topk", topk_config, w)
    sae = load_saelens(tmp_path / "topk").eval()
    assert (sae.architecture, sae.k, sae.scale_by_decoder_norm) == ("topk", 4, True)
    latents = np.zeros_like(pre)
    for row, values in enumerate(pre):
        chosen = np.argsort(-values)[:4]
        latents[row, chosen] = np.maximum(values[chosen], 0)
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), latents, rtol=1e-12, atol=1e-12)
    decoded = (latents / norms) @ n["W_dec"] + n["b_dec"]
    np.testing.assert_allclose(sae(x).detach().numpy(), decoded, rtol=1e-12, atol=1e-12)

    threshold = torch.tensor(0.7, dtype=torch.float64)
    batch_config = config("batchtopk", k=2.0, rescale_acts_by_decoder_norm=True)
    write(tmp_path / "batchtopk", batch_config, {**w, "topk_threshold": threshold})
    sae = load_saelens(tmp_path / "batchtopk").eval()
    assert (sae.architecture, sae.k, float(sae.topk_threshold)) == ("batchtopk", 2.0, 0.7)
    latents = np.maximum(pre, 0) * (pre > 0.7)
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), latents, rtol=1e-12, atol=1e-12)

    jump = {**w, "threshold": torch.rand(D_SAE, generator=generator, dtype=torch.float64)}
    write(tmp_path / "jumprelu", config("jumprelu"), jump)
    sae = load_saelens(tmp_path / "jumprelu").eval()
    plain = (x.numpy() - n["b_dec"]) @ n["W_enc"] + n["b_enc"]
    latents = plain * (plain > jump["threshold"].float().double().numpy())
    np.testing.assert_allclose(sae.encode(x).detach().numpy(), latents, rtol=1e-12, atol=1e-12)


def test_loading_refuses_what_it_cannot_read(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"is not an SAELens SAE directory: it needs "
                       r"cfg.json and sae_weights.safetensors"):  # fmt: skip
        load_saelens(tmp_path / "nothing")
    w = saelens_weights(torch.Generator().manual_seed(5))
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "cfg.json").write_text(json.dumps(config("standard")))
    with pytest.raises(FileNotFoundError, match=r"it needs cfg.json and sae_weights"):
        load_saelens(tmp_path / "no-weights")

    old = {**config("standard"), "metadata": {}, "sae_lens_version": "5.9.1"}
    write(tmp_path / "old", old, w)
    with pytest.raises(ValueError, match=r"written before SAELens 6 \(version '5.9.1'\): load it "
                       r"with sae_lens.SAE.load_from_disk"):  # fmt: skip
        load_saelens(tmp_path / "old")
    write(tmp_path / "unversioned", {**config("standard"), "metadata": {}}, w)
    with pytest.raises(ValueError, match=r"written before SAELens 6 \(version None\)"):
        load_saelens(tmp_path / "unversioned")

    write(tmp_path / "gated", config("gated"), w)
    with pytest.raises(ValueError, match=r"holds an SAELens 'gated' SAE; SAEModule loads "
                       r"\['batchtopk', 'jumprelu', 'standard', 'topk'\]"):  # fmt: skip
        load_saelens(tmp_path / "gated")

    write(tmp_path / "norm", config("standard", normalize_activations="layer_norm"), w)
    with pytest.raises(ValueError, match=r"normalises its inputs at run time \('layer_norm'\)"):
        load_saelens(tmp_path / "norm")

    write(tmp_path / "no-k", config("topk"), w)
    with pytest.raises(ValueError, match=r"this SAELens 'topk' SAE's cfg.json has no `k`"):
        load_saelens(tmp_path / "no-k")
