"""examples/interventions.py, shortened: the SAE splice and the steering, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.interventions import STRENGTHS, run


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_interventions_example_measures_what_hugging_face_computes(tmp_path: Path) -> None:
    result = run(tmp_path, quick=True)
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
