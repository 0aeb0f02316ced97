"""examples/interventions.py and examples/feature_browser.py, shortened, on one trained
language model and SAE: the splice and the steering, and the SAE's latents browsed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from examples import feature_browser
from examples.interventions import KEY, STRENGTHS, run, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("trained")
    with warnings.catch_warnings():  # Lightning's advice on workers and logging
        warnings.simplefilter("ignore", UserWarning)
        return out, train(out, quick=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_interventions_example_measures_what_hugging_face_computes(
    tmp_path: Path, trained: tuple[Path, dict[str, Any]]
) -> None:
    result = run(tmp_path, quick=True, models=trained[1])
    spliced, lm, held_out = result["spliced"], result["lm"], result["held_out"]
    # the clean loss is the model's own: Hugging Face's loss over the same windows
    windows = held_out["prose"] + held_out["code"]
    with torch.no_grad():
        own = [lm.model(input_ids=w["input_ids"][None], labels=w["input_ids"][None]).loss
               for w in windows]  # fmt: skip
    assert spliced["effects/clean/loss"] == pytest.approx(float(torch.stack(own).mean()), rel=1e-5)
    assert spliced["effects/zero/loss"] > spliced["effects/clean/loss"]
    assert spliced["effects/zero/kl"] > 0
    assert spliced["effects/splice/kl"] >= 0
    for values in result["steered"].values():
        assert {f"effects/{alpha:+g}/loss" for alpha in STRENGTHS} <= values.keys()
    assert result["rows"]["prose"] > 0 and result["rows"]["code"] > 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_browser_example_finds_what_topk_over_all_rows_finds(
    tmp_path: Path, trained: tuple[Path, dict[str, Any]]
) -> None:
    result = feature_browser.run(tmp_path, quick=True, models=trained[1])
    summary, store, sae = result["summary"], result["store"], result["sae"]
    indices, rows = store.rows(KEY)
    positions = store.rows("__position__")[1]
    with torch.no_grad():
        codes = sae.codes(rows.float())  # every latent on every character, in memory
    assert summary.rows == len(rows)
    assert torch.equal(summary.active, (codes > 0).sum(0))
    alive = (summary.active >= feature_browser.K).nonzero().flatten()
    assert len(alive) > 10
    for unit in alive.tolist():
        column = codes[:, unit]
        kth = torch.topk(column, feature_browser.K).values[-1]
        # ties (a window's first characters repeat) go to the lower index, then position
        tied = (column >= kth).nonzero().flatten().tolist()
        best = sorted(tied, key=lambda r: (-float(column[r]), int(indices[r]), int(positions[r])))
        best = torch.tensor(best[: feature_browser.K])
        assert torch.equal(summary.top_values[unit], column[best].double())
        assert torch.equal(summary.top_index[unit], indices[best])
        assert torch.equal(summary.top_position[unit], positions[best].long())
    assert result["index"].is_file()
