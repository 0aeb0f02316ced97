"""The compact-store study (``benchmarks/compact_sae.py``), quick: its figures against
ground truth computed here: the block's output taken by a plain forward hook, the SAE
evaluated in NumPy float64, the bytes of a float32 and a bfloat16 row counted by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name

from compact_common import QUICK, dump_ids, eval_ids  # noqa: E402
from compact_sae import QUICK_TRAINING, study  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

COORDINATES = 8 + 4 + 8  # index int64, position int32, token id int64, per row


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("compact")
    found = study(QUICK, QUICK_TRAINING, (0,), work / "stores", cache=work / "cache")
    found["work"] = work / "stores"
    return found


def hooked_outputs(lm: Any, ids: torch.Tensor) -> np.ndarray:
    """The dumped block's output for every token, by a forward hook, ``[tokens, width]``."""
    seen: list[torch.Tensor] = []
    block = lm.model.transformer.h[QUICK.block]
    handle = block.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        with torch.no_grad():
            lm.model(input_ids=ids)
    finally:
        handle.remove()
    return seen[0].reshape(-1, QUICK.width).double().numpy()


def test_the_float32_sae_evaluation_equals_numpy_on_the_held_out_rows(result):
    x = hooked_outputs(result["model"], eval_ids(QUICK))
    sae = result["saes"]["float32", 0]
    p = {name: t.detach().double().numpy() for name, t in sae.state_dict().items()}
    pre = (x / p["scale"] - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    kth = -np.sort(-pre, axis=1)[:, QUICK_TRAINING.k - 1 : QUICK_TRAINING.k]  # k-th largest
    codes = np.where(pre >= kth, np.maximum(pre, 0), 0)
    x_hat = (codes @ p["W_dec"] + p["b_dec"]) * p["scale"]
    ev = 1 - ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    figures = result["runs"]["float32"][0]
    assert len(x) == QUICK.eval_sequences * QUICK.context == result["eval_tokens"]
    assert figures["explained_variance"] == pytest.approx(ev, rel=1e-4, abs=1e-5)
    assert figures["mse"] == pytest.approx(((x - x_hat) ** 2).mean(), rel=1e-4)
    assert figures["l0"] == pytest.approx((codes > 0).sum(1).mean(), abs=0.05)
    assert 0 < figures["l0"] <= QUICK_TRAINING.k
    # CE recovered is (zero - splice) / (zero - clean) of the losses it was made from
    recovered = (figures["zero_loss"] - figures["splice_loss"]) / (
        figures["zero_loss"] - figures["clean_loss"]
    )
    assert figures["ce_recovered"] == pytest.approx(recovered, rel=1e-6)


def test_the_stores_hold_the_block_outputs_and_bf16_is_their_cast(result):
    from lightning_iocatch import FeatureStore

    key, work = QUICK.key, result["work"]
    exact = FeatureStore(work / "float32")[key]
    truth = torch.from_numpy(hooked_outputs(result["model"], dump_ids(QUICK))).float()
    assert torch.allclose(exact, truth, atol=1e-5)  # every token, in (sample, position) order
    bf16 = FeatureStore(work / "bfloat16")[key]
    assert torch.equal(bf16.to(torch.bfloat16), exact.to(torch.bfloat16))


def test_bytes_per_row_are_the_values_and_coordinates(result):
    size, width = result["bytes_per_row"], QUICK.width
    assert 4 * width + COORDINATES <= size["float32"] <= 4 * width + COORDINATES + 4
    # a bfloat16 row is 2 bytes a value smaller, headers and metadata aside
    assert size["float32"] - size["bfloat16"] == pytest.approx(2 * width, abs=0.5)


def test_a_codec_store_reads_the_rows_of_its_plain_store(result):
    if not result["codec"]:
        pytest.skip("this FeatureWriter has no `codec=` (issue 32, branch cf)")
    assert set(result["codec"].values()) == {"bit-identical"}
