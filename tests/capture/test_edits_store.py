"""Patching from a store by dataset index, and the running mean, in plain loops.

The truth of each patch is a hand-written forward hook returning the clean activations,
computed here by a manual forward of the clean inputs (token by token in Python loops for
token rows), never read back through the code under test; the running mean's truth is
NumPy's float64 mean over every value seen. The store is written with ``ShardWriter``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_iocatch import FeatureStore, StoreError
from lightning_iocatch.capture import ModelIOCatcher
from lightning_iocatch.capture.edits import Mean, RunningMean, Zero
from lightning_iocatch.capture.store_patch import PatchAt, StorePatch, refuse_left_padding
from lightning_iocatch.errors import CaptureError
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.names import INDEX_KEY, POSITION_KEY
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.stored_batches import CommittedShard
from lightning_iocatch.store.tokens import TokenRows
from lightning_iocatch.store.writer import ShardWriter
from tests.conftest import RowLinear

KEY = "1/outputs"
SETTINGS: dict[str, Any] = {"spec": None, "stage": "predict", "dtype": None}
# stored batches: progressions, one out of order (its indices are read), two shards
STORED = [[4, 5, 6], [0, 1, 2, 3], [9, 7], [8]]


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(RowLinear(4, 8), nn.Tanh(), RowLinear(8, 8), nn.Tanh(), RowLinear(8, 2))


def clean_store(path: Path, model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Store layer 1's clean outputs of ``x`` in the batches ``STORED``; return them."""
    with torch.no_grad():
        clean = model[:2](x)
    plan = prepare_store(path, "create", SETTINGS)
    writer = ShardWriter(path, rank=0, plan=plan, max_shard_bytes=200)
    for batch_idx, indices in enumerate(STORED):
        writer.write({KEY: clean[indices]}, indices=indices, batch_idx=batch_idx)
    writer.close()
    return clean


def patched_by_hand(model: nn.Sequential, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    handle = model[1].register_forward_hook(lambda m, a, out: value)
    try:
        with torch.no_grad():
            return model(x)
    finally:
        handle.remove()


def test_a_store_patch_in_a_plain_loop_equals_a_hook_patching_the_clean_rows(
    tmp_path: Path,
) -> None:
    model = net()
    x = torch.randn(10, 4)
    clean = clean_store(tmp_path, model, x)
    corrupted = x + torch.randn(10, 4)
    store = FeatureStore(tmp_path)
    patch = StorePatch("1", store, KEY)
    catcher = ModelIOCatcher(model, "cpu")
    for indices in ([5, 2, 8], [9, 0, 7, 7], [3]):  # any order, a sample twice
        truth = patched_by_hand(model, corrupted[indices], clean[indices])
        with torch.no_grad(), catcher(edits=[patch.for_batch(indices)]):
            assert torch.equal(model(corrupted[indices]), truth), indices
    # one session over batches: the session gives each batch's indices
    session = catcher(edits=[patch])
    with torch.no_grad(), session:
        for indices in ([1, 4], [6, 3, 0]):
            session.set_batch_indices(indices)
            truth = patched_by_hand(model, corrupted[indices], clean[indices])
            assert torch.equal(model(corrupted[indices]), truth), indices
            session.take()  # the batch ends: the patch needs the next batch's indices
        with pytest.raises(CaptureError, match=r"applies only to a batch whose dataset indices"):
            model(corrupted[:2])
    two_rows = catcher(edits=[patch.for_batch([1, 2])])
    with pytest.raises(ValueError, match=r"a patch of shape \(2, 8\) for '1'"), two_rows:
        model(corrupted[:3])  # three samples
    # what a store records of it: where the rows come from, not what they are
    described = patch.describe()
    assert described["store"] == str(tmp_path) and described["key"] == KEY
    assert (described["edit"], described["module"], described["dataloader_idx"]) == (
        "StorePatch",
        "1",
        0,
    )
    json.dumps(described, allow_nan=False)


def test_a_missing_index_or_unknown_indices_or_key_are_refused_by_name(tmp_path: Path) -> None:
    model = net()
    clean_store(tmp_path, model, torch.randn(10, 4))
    store = FeatureStore(tmp_path)
    patch = StorePatch("1", store, KEY)
    with pytest.raises(
        StoreError, match=rf"the store {tmp_path} holds no sample of dataset index 42"
    ):
        patch.for_batch([3, 42])
    with pytest.raises(StoreError, match="index 10, 11, 12, 13, 14, 15, 16, 17, 18, 19 and 2 more"):
        store.rows_at(KEY, range(22))
    with pytest.raises(CaptureError, match="dataset indices are unknown.*no shuffling"):
        patch.for_batch(None)
    with pytest.raises(KeyError, match="did you mean '1/outputs'"):
        StorePatch("1", store, "1/output")
    with pytest.raises(TypeError, match="`store` must be a FeatureStore"):
        StorePatch("1", tmp_path, KEY)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`indices` must be a list of dataset indices"):
        store.rows_at(KEY, torch.tensor([1.0]))
    some = tmp_path / "some"  # a key captured in only some batches
    writer = ShardWriter(some, rank=0, plan=prepare_store(some, "create", SETTINGS))
    writer.write({KEY: torch.zeros(2, 8), "extra": torch.ones(2, 3)}, indices=[0, 1])
    writer.write({KEY: torch.zeros(2, 8)}, indices=[2, 3], batch_idx=1)
    writer.close()
    with pytest.raises(StoreError, match="holds no row of 'extra' for dataset index 2, 3 "):
        StorePatch("1", FeatureStore(some), "extra").for_batch([1, 3, 2])


def test_rows_at_reads_only_the_batches_that_hold_the_indices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = net()
    x = torch.randn(10, 4)
    clean = clean_store(tmp_path, model, x)
    store = FeatureStore(tmp_path)
    read: list[str] = []
    original = CommittedShard.read

    def counted(self: CommittedShard, names: Any) -> dict[str, torch.Tensor]:
        read.extend(names)
        return original(self, names)

    monkeypatch.setattr(CommittedShard, "read", counted)
    for asked, batches in (([5], 1), ([8], 2), ([3, 1], 1), ([6, 0, 7], 3)):
        read.clear()
        rows, sample, position = store.rows_at(KEY, asked)
        assert torch.equal(rows, clean[asked]) and sample.tolist() == list(range(len(asked)))
        assert position is None
        # [8]: its own batch, and [9, 7], whose range holds 8 and whose order is irregular
        assert len([name for name in read if name.endswith(INDEX_KEY)]) == batches, asked
        assert all(name.endswith(INDEX_KEY) for name in read)  # rows: only those asked for


@pytest.mark.parametrize("name", ["store-v1-rows", "store-v2-rows", "store-v2-tokens"])
def test_rows_at_of_stores_of_earlier_formats_are_the_shards_rows(name: str) -> None:
    """Stores without index summaries (their indices are read to open them); the truth is
    each shard read by safetensors itself, row by row."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / name
    store = FeatureStore(path)
    for key in store:
        index, rows, position = [], [], []
        for record in read_ledgers(path):
            tensors = load_file(path / record.file)
            for batch in range(len(record.batches)):
                index += tensors[f"b{batch}/{INDEX_KEY}"].tolist()
                rows += list(tensors[f"b{batch}/{key}"])
                if POSITION_KEY in store:
                    position += tensors[f"b{batch}/{POSITION_KEY}"].tolist()
        asked = sorted(set(index), reverse=True)
        found = store.rows_at(key, asked)
        mine = [(p, i) for p, a in enumerate(asked) for i, x in enumerate(index) if x == a]
        assert found.sample.tolist() == [p for p, _ in mine], key
        assert torch.equal(found.rows, torch.stack([rows[i] for _, i in mine])), key
        if POSITION_KEY in store and key != POSITION_KEY:
            assert found.position is not None
            assert found.position.tolist() == [position[i] for _, i in mine], key
        else:
            assert found.position is None


class Tokens(nn.Module):
    """A sequence model: ``[batch, seq]`` token ids to ``[batch, seq, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(20, 6)
        self.mix = RowLinear(6, 6)
        self.out = RowLinear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.mix(self.embed(ids))
        return self.out(torch.tanh(hidden + hidden.cumsum(1)))


def test_a_token_row_store_patches_exactly_the_stored_positions(tmp_path: Path) -> None:
    model = Tokens()
    lengths = [4, 2, 5, 3, 1]
    ids = torch.randint(3, 20, (5, 5))
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])  # right padding
    ids = ids * mask
    tokens = TokenRows(drop_first=True)
    plan = prepare_store(tmp_path, "create", {**SETTINGS, "tokens": tokens.settings()})
    writer = ShardWriter(tmp_path, rank=0, plan=plan)
    with torch.no_grad():
        clean = model.mix(model.embed(ids))
    for rows in ([0, 1, 2], [3, 4]):  # sample 4: no token after BOS
        batch = {"input_ids": ids[rows], "attention_mask": mask[rows]}
        selection = tokens.select(batch)
        selected = selection.capture(clean[rows])
        assert selected is not None
        writer.write(
            {"mix/outputs": selected}, indices=rows, tokens=selection, token_keys={"mix/outputs"}
        )
    writer.close()
    store = FeatureStore(tmp_path)
    corrupted = torch.randint(3, 20, (5, 5)) * mask
    for order in ([2, 0, 4, 3], [1, 3]):
        by_hand: list[torch.Tensor] = []

        def patch(
            m: nn.Module,
            a: Any,
            out: torch.Tensor,
            order: list[int] = order,
            by_hand: Any = by_hand,
        ) -> Any:
            out = out.clone()
            for row, sample in enumerate(order):  # every real token but the first
                for place in range(1, lengths[sample]):
                    out[row, place] = clean[sample, place]
            by_hand.append(out)
            return out

        handle = model.mix.register_forward_hook(patch)
        with torch.no_grad():
            truth = model(corrupted[order])
        handle.remove()
        edit = StorePatch("mix", store, "mix/outputs").for_batch(order)
        assert isinstance(edit, PatchAt)
        with torch.no_grad(), ModelIOCatcher(model, "cpu")(outputs=["mix"], edits=[edit]) as buf:
            assert torch.equal(model(corrupted[order]), truth), order
        assert torch.equal(buf["mix"]["outputs"][0], by_hand[0])
    four = StorePatch("mix", store, "mix/outputs").for_batch([2, 0, 4, 3])
    session = ModelIOCatcher(model, "cpu")(edits=[four])
    with pytest.raises(ValueError, match=r"PatchAt patches \[4, seq, ...\] values"), session:
        model(corrupted[:2])
    with pytest.raises(StoreError, match="holds no sample of dataset index 5"):
        StorePatch("mix", store, "mix/outputs").for_batch([5])
    # its positions count from the first real token: a left-padded batch is refused
    left = {"input_ids": ids.flip(1), "attention_mask": mask.flip(1)}
    with pytest.raises(CaptureError, match="padded on the left"):
        refuse_left_padding([StorePatch("mix", store, "mix/outputs")], left)
    refuse_left_padding([StorePatch("mix", store, "mix/outputs")], {"attention_mask": mask})


def test_a_running_mean_is_numpys_float64_mean_of_the_values_seen_so_far() -> None:
    model = net()
    catcher = ModelIOCatcher(model, "cpu")
    edit = RunningMean("1")  # its estimate lasts across sessions
    seen: list[np.ndarray] = []
    for size in (3, 5, 1, 4):
        x = torch.randn(size, 4)
        with torch.no_grad():
            seen.append(model[:2](x).numpy())
        mean = torch.from_numpy(np.concatenate(seen).astype(np.float64).mean(0))
        truth = patched_by_hand(model, x, mean.float().expand(size, 8).clone())
        with torch.no_grad(), catcher(edits=[edit]):
            assert torch.equal(model(x), truth), size
    assert edit.count == 13 and edit.mean is not None and edit.mean.dtype == torch.float64
    assert "_total" not in edit.describe()  # what changes as it runs is not what it is
    edit.reset()
    assert edit.count == 0 and edit.mean is None


def test_a_running_mean_over_chosen_tokens_and_its_refusals() -> None:
    model = Tokens()
    edit = RunningMean("mix")
    places: list[np.ndarray] = []
    for seq in (4, 6):  # the sequence length varies: the mean is over tokens, [6]
        ids = torch.randint(0, 20, (3, seq))
        where = torch.rand(3, seq) > 0.4
        with torch.no_grad():
            hidden = model.mix(model.embed(ids))
            places.append(hidden[where].numpy())
            mean = torch.from_numpy(np.concatenate(places).astype(np.float64).mean(0)).float()
            value = torch.where(where[..., None], mean, hidden)
            truth = model.out(torch.tanh(value + value.cumsum(1)))
        edit.positions = where  # this batch's tokens to ablate
        with torch.no_grad(), ModelIOCatcher(model, "cpu")(edits=[edit]):
            assert torch.equal(model(ids), truth), seq
    assert edit.count == sum(len(p) for p in places)
    rows = RunningMean("1")
    rows.apply(torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"a mean of shape \(8,\) so far"):
        rows.apply(torch.randn(2, 3, 8))
    from torch.utils.checkpoint import checkpoint

    block = net()
    with ModelIOCatcher(block, "cpu")(edits=[RunningMean("1")]):
        loss = checkpoint(block, torch.randn(3, 4), use_reentrant=False).sum()
        with pytest.raises(CaptureError, match="a RunningMean would add its values"):
            loss.backward()


def test_for_batch_is_the_edit_itself_for_edits_that_do_not_depend_on_samples() -> None:
    for edit in (Zero("1"), Mean("1", torch.zeros(8)), RunningMean("1")):
        assert edit.for_batch([0, 1]) is edit and edit.for_batch(None) is edit
