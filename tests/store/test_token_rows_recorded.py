"""What a store records of a ``TokenRows``' functions (``mask``, ``token_ids``,
``padding``): what they compute, as for an edit's function.

Before, a lambda was recorded by its own code only and a function by its name: two masks
that are closures over other thresholds, or one function reading a global that changed,
were recorded alike, so a resume under the other mask was accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError, TokenRows
from tests.lightning_models import trainer
from tests.store.test_writer_resume import Tokens, token_batches

LOWEST = 0


def above(threshold: int) -> Any:
    return lambda batch: batch[0] >= threshold


def at_least_lowest(batch: Any) -> torch.Tensor:
    return batch[0] >= LOWEST


def test_masks_that_select_other_tokens_are_recorded_differently() -> None:
    global LOWEST
    assert TokenRows(mask=above(2)).settings() != TokenRows(mask=above(5)).settings()
    assert TokenRows(mask=above(2)).settings() == TokenRows(mask=above(2)).settings()
    before = TokenRows(mask=at_least_lowest).settings()
    LOWEST = 3
    try:
        assert TokenRows(mask=at_least_lowest).settings() != before
    finally:
        LOWEST = 0
    padding = TokenRows(padding=above(1)).settings()["padding"]
    assert padding != TokenRows(padding=above(0)).settings()["padding"]
    assert TokenRows().settings()["mask"] == "attention_mask"  # the default, as before


def dump(path: Path, tokens: TokenRows, mode: str = "create") -> None:
    writer = FeatureWriter(path, tokens=tokens, mode=mode)  # type: ignore[arg-type]
    callback = IOCaptureCallback("outputs[embed]", writer=writer)
    trainer([callback]).predict(Tokens(), token_batches(), return_predictions=False)


def test_a_resume_under_a_mask_over_another_threshold_is_refused(tmp_path: Path) -> None:
    dump(tmp_path, TokenRows(mask=above(2)))
    with pytest.raises(StoreError, match="holds captures with tokens"):
        dump(tmp_path, TokenRows(mask=above(5)), "resume")
    dump(tmp_path, TokenRows(mask=above(2)), "resume")  # made again: the same
    ids = torch.arange(24).reshape(6, 4) % 10
    with torch.no_grad():
        truth = Tokens().embed(ids[ids >= 2])  # the selected tokens, in (sample, position) order
    assert torch.equal(FeatureStore(tmp_path)["embed/outputs"], truth)
