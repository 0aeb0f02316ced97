"""``ShardWriter.write(tokens=...)`` stores the selected tensors one row per token only when
told which they are (issue 28, item 8c): it refuses a selection without ``token_keys`` and
token keys that name no tensor, rather than storing the token rows once per batch.

Ground truth: the real tokens of a right-padded batch, picked by hand from the mask.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_iocatch import FeatureStore, StoreError
from lightning_iocatch.store.names import POSITION_KEY, TOKEN_ID_KEY
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.tokens import TokenRows
from lightning_iocatch.store.writer import ShardWriter

IDS = torch.tensor([[11, 12, 13], [21, 22, 0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
HIDDEN = torch.arange(24.0).view(2, 3, 4)


def writer(path: Path, tokens: TokenRows) -> ShardWriter:
    settings = {"spec": None, "stage": "predict", "dtype": None, "tokens": tokens.settings()}
    return ShardWriter(path, rank=0, plan=prepare_store(path, "create", settings))


@pytest.mark.parametrize("reduce", [None, "last"])
def test_token_rows_without_token_keys_are_refused_naming_the_argument(
    tmp_path: Path, reduce: str | None
) -> None:
    """Before: accepted; ``m/outputs`` was stored as one (5, 4) tensor of the batch, and
    reading its rows said "'m/outputs' is stored once per batch"."""
    tokens = TokenRows(reduce=reduce)  # type: ignore[arg-type]
    selection = tokens.select({"input_ids": IDS, "attention_mask": MASK})
    hidden = selection.capture(HIDDEN)
    assert hidden is not None
    out = writer(tmp_path, tokens)
    fix = r"pass `token_keys=` .*transformed_keys\(\)"
    with pytest.raises(StoreError, match=rf"`tokens` without `token_keys`.*; {fix}"):
        out.write({"m/outputs": hidden}, indices=[0, 1], tokens=selection)
    with pytest.raises(StoreError, match=r"`token_keys` name 'm/output', which is not a tensor"):
        out.write({"m/outputs": hidden}, indices=[0, 1], tokens=selection, token_keys={"m/output"})
    out.close()
    assert out.rows_written == 0


def test_token_rows_with_their_keys_read_back_as_the_real_tokens(tmp_path: Path) -> None:
    tokens = TokenRows()
    selection = tokens.select({"input_ids": IDS, "attention_mask": MASK})
    hidden = selection.capture(HIDDEN)
    assert hidden is not None
    out = writer(tmp_path, tokens)
    rotary = torch.ones(1, 3)
    out.write(
        {"m/outputs": hidden, "rotary": rotary},
        indices=[7, 8],
        tokens=selection,
        token_keys={"m/outputs"},
    )
    out.close()
    store = FeatureStore(tmp_path)
    real = [(b, t) for b in range(2) for t in range(3) if MASK[b, t]]  # by hand
    assert store.indices.tolist() == [7 + b for b, _ in real]
    assert store[POSITION_KEY].tolist() == [t for _, t in real]
    assert store[TOKEN_ID_KEY].tolist() == [int(IDS[b, t]) for b, t in real]
    assert torch.equal(store["m/outputs"], torch.stack([HIDDEN[b, t] for b, t in real]))
    assert store.metadata["per_batch"] == {"rotary": 1}
