"""2-process CPU DDP: each rank captures its own batches; together they cover the data once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_script
from tests.lightning_models import TinyModule, dataset, manual_outputs


@pytest.mark.slow
def test_ddp_predict_and_validate(tmp_path: Path) -> None:
    run_script(ROOT / "tests" / "scripts" / "ddp_capture.py", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    module = TinyModule()
    module.load_state_dict(ranks[0]["state_dict"])
    expected = manual_outputs(module, dataset(21).tensors[0])[1]
    seen: list[int] = []
    for rank in ranks:
        assert rank["hooks_left"] == 0 and rank["predict_step_restored"]
        assert rank["tail_calls_in_predict"] == 0  # early exit cut every predict forward short
        assert rank["tail_calls"] == 3  # validation forwards run whole: 3 batches a rank
        for indices, captured in zip(rank["predict_indices"], rank["predict_outputs"], strict=True):
            assert torch.equal(captured, expected[list(indices)])
            seen += indices
        assert len(rank["validate_outputs"]) == 3  # 20 samples, 2 ranks, batches of 4
    assert sorted(seen) == list(range(21))  # every sample exactly once across ranks
