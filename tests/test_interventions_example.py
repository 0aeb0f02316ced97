"""examples/interventions.py and examples/feature_browser.py, shortened, on one trained
language model and SAE: the splice and the steering, and the SAE's latents browsed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples import feature_browser
from examples.interventions import KEY, STRENGTHS, run, train


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_both_examples_on_one_trained_model_and_sae(tmp_path: Path) -> None:
    """One test, so that the models are trained once whatever the test scheduling."""
    models = train(tmp_path / "trained", quick=True)
    check_the_interventions_example(tmp_path / "interventions", models)
    check_the_browser_example(tmp_path / "browser", models)


def check_the_interventions_example(tmp_path: Path, models: dict[str, Any]) -> None:
    """The splice's clean loss is Hugging Face's own; the steering measures every alpha."""
    result = run(tmp_path, quick=True, models=models)
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


def check_the_browser_example(tmp_path: Path, models: dict[str, Any]) -> None:
    """Every latent active on K rows or more: its examples are those of torch.topk over all
    latent activations held in memory, ties by index then position."""
    result = feature_browser.run(tmp_path, quick=True, models=models)
    summary, store, sae = result["summary"], result["store"], result["sae"]
    indices, rows = store.rows(KEY)
    positions = store.rows("__position__")[1]
    with torch.no_grad():
        codes = sae.encode(rows.float())  # every latent on every character, in memory
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
