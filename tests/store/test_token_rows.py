"""Token rows: a padded batch of a real Hugging Face decoder stored one row per token.

The ground truth is Hugging Face's ``output_hidden_states`` selected token by token in
Python loops (and NumPy float64 for means), never the library's own selection.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_iocatch.capture.snapshots as snapshots_module
from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreRows, TokenRows
from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.names import POSITION_KEY, TOKEN_ID_KEY
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.ddp_scenarios import ranks_of
from tests.lightning_models import tiny_llama, trainer

LAYER = "model.model.layers.1"
KEY = f"{LAYER}/outputs"
BOS, EOS, PAD = 1, 2, 0
HIDDEN = 16


class Sentences(Dataset[dict[str, torch.Tensor]]):
    """Token ids of varying length: BOS, words, sometimes EOS (special tokens 0..2)."""

    def __init__(self, count: int = 11) -> None:
        generator = torch.Generator().manual_seed(3)
        self.items = []
        for i in range(count):
            length = int(torch.randint(1, 8, (1,), generator=generator))
            words = torch.randint(3, 64, (length,), generator=generator)
            tail = [EOS] if i % 3 == 0 else []
            self.items.append(torch.tensor([BOS, *words.tolist(), *tail]))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def pad(side: str = "right") -> Any:
    """A collate function padding to the batch's longest sequence, like a tokenizer's."""

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), width), PAD)
        mask = torch.zeros(len(items), width, dtype=torch.int64)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            span = slice(0, n) if side == "right" else slice(width - n, width)
            ids[row, span], mask[row, span] = item["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask}

    return collate


class Decoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama(num_hidden_layers=3, hidden_size=HIDDEN, intermediate_size=32)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.model(**batch).logits


def hidden_states(module: Decoder, loader: DataLoader[Any]) -> list[tuple[Any, torch.Tensor]]:
    """Per batch of ``loader``: the batch and Hugging Face's output of layer 1."""
    with torch.no_grad():
        return [(b, module.model(**b, output_hidden_states=True).hidden_states[2]) for b in loader]


def first_real(mask: torch.Tensor) -> int:
    """The column of a row's first real token (after left padding)."""
    return next((p for p in range(len(mask)) if mask[p]), 0)


def expected_tokens(
    batches: list[tuple[Any, torch.Tensor]], drop: set[int], drop_first: bool = True
) -> dict[str, Any]:
    """Token by token: rows, dataset indices, positions (left padding not counted) and token
    ids, without each sequence's first real token when ``drop_first``."""
    rows, index, position, token = [], [], [], []
    start = 0
    for batch, hidden in batches:
        for i in range(len(hidden)):
            begin = first_real(batch["attention_mask"][i])
            for p in range(hidden.shape[1]):
                tok = int(batch["input_ids"][i, p])
                if not batch["attention_mask"][i, p] or tok in drop:
                    continue
                if drop_first and p == begin:
                    continue
                rows.append(hidden[i, p])
                index.append(start + i)
                position.append(p - begin)
                token.append(tok)
        start += len(hidden)
    return {"rows": torch.stack(rows), "index": index, "position": position, "token": token}


def dump(path: Path | str, tokens: TokenRows, loader: DataLoader[Any], **writer: Any) -> None:
    callback = IOCaptureCallback(
        f"outputs[{LAYER}]", early_exit=True, writer=FeatureWriter(path, tokens=tokens, **writer)
    )
    trainer([callback]).predict(Decoder(), loader, return_predictions=False)


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_rows_are_hugging_face_hidden_states_of_the_selected_tokens(
    tmp_path: Path, side: str
) -> None:
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad(side))
    tokens = TokenRows(drop_first=True, drop_token_ids={EOS})
    dump(tmp_path, tokens, loader)

    truth = expected_tokens(hidden_states(Decoder(), loader), drop={EOS})
    store = FeatureStore(tmp_path)
    assert store.indices.tolist() == truth["index"]
    assert torch.equal(store[KEY], truth["rows"])
    assert store[POSITION_KEY].tolist() == truth["position"]
    assert store[TOKEN_ID_KEY].tolist() == truth["token"]
    assert store.metadata["tokens"]["drop_token_ids"] == [EOS]


def test_a_dump_of_token_rows_holds_the_selected_bytes_plus_coordinates(tmp_path: Path) -> None:
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad())
    dump(tmp_path, TokenRows(), loader, max_shard_bytes=1 << 30)
    (record,) = read_ledgers(tmp_path)
    shard = tmp_path / record.file
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    batches = [batch for _, batch in enumerate(loader)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    coordinates = tokens * (8 + 4 + 8)  # dataset index int64, position int32, token id int64
    assert shard.stat().st_size - header == tokens * HIDDEN * 4 + coordinates
    assert tokens < 0.8 * padded  # padding, stored by a sequence-level dump, is left out


def test_tokens_are_selected_before_the_copy_off_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied: list[tuple[int, ...]] = []
    real = snapshots_module._copy_tensor

    def spy(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        copied.append(tuple(tensor.shape))
        return real(tensor, *args)

    monkeypatch.setattr(snapshots_module, "_copy_tensor", spy)
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad())
    dump(tmp_path, TokenRows(), loader)
    selected = [int(b["attention_mask"].sum()) for b in loader]
    assert copied == [(n, HIDDEN) for n in selected]


@pytest.mark.parametrize("reduce", ["mean", "first", "last"])
def test_per_sample_reductions_equal_numpy_over_the_selected_tokens(
    tmp_path: Path, reduce: str
) -> None:
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad("left"))
    dump(tmp_path, TokenRows(drop_first=True, reduce=reduce), loader)  # type: ignore[arg-type]
    store = FeatureStore(tmp_path)
    rows, start = [], 0
    for batch, hidden in hidden_states(Decoder(), loader):
        for i in range(len(hidden)):
            mask = batch["attention_mask"][i]
            begin = first_real(mask)
            keep = [p for p in range(hidden.shape[1]) if mask[p] and p != begin]
            values = hidden[i].double().numpy()
            if not keep:
                rows.append((start + i, np.full(HIDDEN, np.nan), -1, -1))
                continue
            p = keep[0] if reduce == "first" else keep[-1]
            row = values[keep].mean(0) if reduce == "mean" else values[p]
            rows.append((start + i, row, p - begin, int(batch["input_ids"][i, p])))
        start += len(hidden)
    assert store.indices.tolist() == [r[0] for r in rows]
    got = store[KEY].double().numpy()
    np.testing.assert_allclose(got, np.stack([r[1] for r in rows]), rtol=1e-6, atol=1e-7)
    if reduce == "mean":
        assert POSITION_KEY not in store and TOKEN_ID_KEY not in store
    else:
        assert store[POSITION_KEY].tolist() == [r[2] for r in rows]
        assert store[TOKEN_ID_KEY].tolist() == [r[3] for r in rows]


def test_a_resume_with_another_batch_size_stores_every_token_once(tmp_path: Path) -> None:
    data, tokens = Sentences(), TokenRows(drop_first=True)
    first = DataLoader(data, batch_size=4, collate_fn=pad("left"))
    callback = IOCaptureCallback(f"outputs[{LAYER}]", writer=FeatureWriter(tmp_path, tokens=tokens))
    trainer([callback], limit_predict_batches=1).predict(Decoder(), first)  # samples 0..3
    again = DataLoader(data, batch_size=3, collate_fn=pad("left"))  # 0..2, 3..5: straddles
    dump(tmp_path, tokens, again, mode="resume")

    truth = expected_tokens(hidden_states(Decoder(), again), drop=set())
    store = FeatureStore(tmp_path)
    assert store.duplicated_indices() == [] and store.missing_indices() == []
    assert store.indices.tolist() == truth["index"]
    assert store[POSITION_KEY].tolist() == truth["position"]
    torch.testing.assert_close(store[KEY], truth["rows"], rtol=1e-5, atol=1e-6)  # other padding


def test_token_rows_stream_into_training_with_their_coordinates(tmp_path: Path) -> None:
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad())
    dump(tmp_path, TokenRows(), loader)
    store = FeatureStore(tmp_path)
    data = StoreRows(tmp_path, [KEY, POSITION_KEY], batch_size=5, with_indices=True)
    read = list(DataLoader(data, batch_size=None))
    got = sorted(
        (int(i), int(p), tuple(r.tolist()))
        for b in read
        for i, p, r in zip(b["index"], b[POSITION_KEY], b[KEY], strict=True)
    )
    want = sorted(
        (int(i), int(p), tuple(r.tolist()))
        for i, p, r in zip(store.indices, store[POSITION_KEY], store[KEY], strict=True)
    )
    assert got == want and len(got) == len(store)


def test_a_resume_with_another_token_selection_is_refused(tmp_path: Path) -> None:
    loader = DataLoader(Sentences(4), batch_size=4, collate_fn=pad())
    dump(tmp_path, TokenRows(), loader)
    with pytest.raises(StoreError, match="tokens"):
        dump(tmp_path, TokenRows(drop_first=True), loader, mode="resume")


def test_a_batch_without_a_mask_is_refused_naming_the_fix() -> None:
    ids = torch.ones(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="without one; pass `mask=`"):
        TokenRows().select((ids,))
    with pytest.raises(ValueError, match="needs the token ids"):
        TokenRows(mask=lambda batch: batch[0] > 0, drop_token_ids=[0]).select((ids,))
    with pytest.raises(ValueError, match=r"must be a \(batch, seq\) tensor"):
        TokenRows(mask=lambda batch: batch[0][0]).select((ids,))
    with pytest.raises(ValueError, match="reduce"):
        TokenRows(reduce="max")  # type: ignore[arg-type]


def test_writers_of_one_callback_must_select_the_same_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same `tokens`"):
        IOCaptureCallback(
            "outputs[x]",
            writer=FeatureWriter(tmp_path / "a", tokens=TokenRows()),
            sinks=[FeatureWriter(tmp_path / "b")],
        )


def test_a_sample_in_two_commits_is_duplicated_and_read_once_from_the_first(
    tmp_path: Path,
) -> None:
    tokens = TokenRows()
    settings = {"spec": None, "stage": "predict", "dtype": None, "tokens": tokens.settings()}
    plan = prepare_store(tmp_path, "create", settings)
    batch = {"input_ids": torch.tensor([[1, 5, 6], [1, 7, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}  # fmt: skip
    for rank, indices in ((0, [0, 1]), (1, [1, 2])):  # sample 1 on both ranks
        writer, selection = ShardWriter(tmp_path, rank=rank, plan=plan), tokens.select(batch)
        hidden = selection.capture(torch.arange(18.0).view(2, 3, 3) + 100 * rank)
        assert hidden is not None
        writer.write(
            {"m/outputs": hidden}, indices=indices, tokens=selection, token_keys={"m/outputs"}
        )
        writer.close()
    with pytest.raises(StoreError, match=r"holds 1 dataset indices more than once, e\.g\. \[1\]"):
        FeatureStore(tmp_path)
    store = FeatureStore(tmp_path, on_duplicate="first")
    assert store.duplicated_indices() == [1]
    assert store.indices.tolist() == [0, 0, 0, 1, 1, 2, 2]  # sample 1's tokens from rank 0
    assert store[POSITION_KEY].tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert store["m/outputs"][:, 0].tolist() == [0, 3, 6, 9, 12, 109, 112]

    from datasets import load_from_disk

    from lightning_iocatch.cli import main

    out = tmp_path.parent / f"{tmp_path.name}-hf"
    assert main(["export", str(tmp_path), str(out)]) == 2  # refused, as FeatureStore does
    assert main(["export", str(tmp_path), str(out), "--on-duplicate", "first"]) == 0
    exported = load_from_disk(str(out)).with_format("torch")[:]
    assert exported["index"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert exported["m/outputs"][:, 0].tolist() == [0, 3, 6, 9, 12, 109, 112]


def test_token_rows_export_to_hugging_face_datasets_row_for_row(tmp_path: Path) -> None:
    from datasets import load_from_disk

    from lightning_iocatch.store.export import export_dataset

    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad())
    dump(tmp_path / "store", TokenRows(drop_first=True), loader)
    export_dataset(tmp_path / "store", tmp_path / "hf")
    exported = load_from_disk(str(tmp_path / "hf")).with_format("torch")[:]
    truth = expected_tokens(hidden_states(Decoder(), loader), drop=set())  # in commit order
    assert exported["index"].tolist() == truth["index"]
    assert exported[POSITION_KEY].tolist() == truth["position"]
    assert exported[TOKEN_ID_KEY].tolist() == truth["token"]
    assert torch.equal(exported[KEY], truth["rows"])


@pytest.mark.slow
def test_a_two_process_ddp_dump_equals_one_process_token_for_token(ddp_scenarios: Path) -> None:
    store_path = ranks_of(ddp_scenarios, "dump_tokens")
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad())
    truth = expected_tokens(hidden_states(Decoder(), loader), drop={EOS})
    store = FeatureStore(store_path)
    assert store.metadata["ranks"] == [0, 1] and store.duplicated_indices() == []
    assert (store_path / "rows-seen-by-rank-0").read_text() == str(len(truth["index"]))
    assert store.indices.tolist() == truth["index"]
    assert store[POSITION_KEY].tolist() == truth["position"]
    assert store[TOKEN_ID_KEY].tolist() == truth["token"]
    torch.testing.assert_close(store[KEY], truth["rows"], rtol=1e-5, atol=1e-6)  # other padding


def test_inspect_counts_samples_not_token_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_iocatch.cli import main

    loader = DataLoader(Sentences(5), batch_size=2, collate_fn=pad())
    dump(tmp_path, TokenRows(drop_first=True), loader)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = len(FeatureStore(tmp_path))
    assert f"rows       {rows} token rows of 5 samples" in out
    assert "drop_first=True" in out
    assert "each of 0..4 present in exactly one commit" in out


def test_the_saelens_layout_refuses_token_rows_naming_the_columns_layout(tmp_path: Path) -> None:
    from lightning_iocatch.store.export import ExportError, export_dataset

    dump(tmp_path / "store", TokenRows(), DataLoader(Sentences(4), batch_size=4, collate_fn=pad()))
    with pytest.raises(ExportError, match="holds token rows.*layout='columns'"):
        export_dataset(tmp_path / "store", tmp_path / "hf", layout="saelens")


def test_a_batch_of_one_does_not_store_a_selected_rotary_table_as_its_per_batch_value(
    tmp_path: Path,
) -> None:
    loader = DataLoader(Sentences(5), batch_size=2, collate_fn=pad())  # the last batch has 1
    writer = FeatureWriter(tmp_path, tokens=TokenRows())
    trainer([IOCaptureCallback(f"inputs[{LAYER}]", writer=writer)]).predict(Decoder(), loader)
    rotary = f"{LAYER}/inputs/kwargs/position_embeddings/0"
    store = FeatureStore(tmp_path)
    assert store.metadata["per_batch"][rotary] == 2  # the batches of two, not the last one
    assert "made it token rows in a batch" in store.metadata["skipped"][rotary]
    for indices, table in store.batches(rotary):
        assert len(indices) == 2 and table.shape[0] == 1  # the batch's samples, once each
    truth = expected_tokens(
        [(b, h) for b, h in zip(loader, inputs_of_layer(loader), strict=True)], set(), False
    )
    assert torch.equal(store[f"{LAYER}/inputs/args/0"], truth["rows"])


def inputs_of_layer(loader: DataLoader[Any]) -> list[torch.Tensor]:
    """Hugging Face's input of layer 1 (the output of layer 0), batch by batch."""
    module = Decoder()
    with torch.no_grad():
        return [module.model(**b, output_hidden_states=True).hidden_states[1] for b in loader]


def test_generate_stores_the_prompt_as_token_rows_and_decoding_steps_per_batch(
    tmp_path: Path,
) -> None:
    class Generator(Decoder):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return self.model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)

    loader = DataLoader(Sentences(4), batch_size=4, collate_fn=pad("left"))
    writer = FeatureWriter(tmp_path, tokens=TokenRows(drop_first=True))
    trainer([IOCaptureCallback(f"outputs[{LAYER}]", writer=writer)]).predict(Generator(), loader)
    store = FeatureStore(tmp_path)
    assert store.metadata["per_batch"] == {f"{KEY}@1": 1, f"{KEY}@2": 1}  # 3 new tokens
    (batch,) = list(loader)
    position_ids = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)  # as generate() does
    with torch.no_grad():
        prompt = Decoder().model(**batch, position_ids=position_ids, output_hidden_states=True)
    truth = expected_tokens([(batch, prompt.hidden_states[2])], set())
    assert store[POSITION_KEY].tolist() == truth["position"]
    torch.testing.assert_close(store[KEY], truth["rows"], rtol=1e-5, atol=1e-6)


def test_first_and_last_of_empty_sequences_are_nan() -> None:
    from lightning_iocatch.store.tokens import TokenSelection

    selection = TokenSelection(torch.ones(2, 0, dtype=torch.bool), None, "first")
    out = selection.capture(torch.ones(2, 0, 3))
    assert out is not None and out.shape == (2, 3) and bool(out.isnan().all())


def test_two_mask_lambdas_are_told_apart_for_a_resume() -> None:
    first = TokenRows(mask=lambda batch: batch["attention_mask"])
    second = TokenRows(mask=lambda batch: batch["input_ids"] == 6)
    assert first.settings()["mask"] != second.settings()["mask"]
    assert TokenRows(drop_token_ids=np.array([2, 0])).settings()["drop_token_ids"] == [0, 2]
    # the same function written again (a resume edits the line it stands on) is the same
    again = TokenRows(mask=lambda batch: batch["attention_mask"], drop_first=False)
    assert again.settings() == first.settings()
    keep = functools.partial(torch.ne, other=0)
    assert (
        TokenRows(mask=keep).settings()
        == TokenRows(mask=functools.partial(torch.ne, other=0)).settings()
    )


def test_token_rows_on_object_storage_equal_the_local_dump(tmp_path: Path) -> None:
    loader = DataLoader(Sentences(), batch_size=4, collate_fn=pad("left"))
    url = f"memory://token-rows/{tmp_path.name}"
    dump(tmp_path, TokenRows(drop_first=True), loader, max_shard_bytes=2048)
    dump(url, TokenRows(drop_first=True), loader, max_shard_bytes=2048)
    local, remote = FeatureStore(tmp_path), FeatureStore(url)
    assert len(remote.metadata["shards"]) > 1
    assert torch.equal(remote.indices, local.indices)
    for key in (KEY, POSITION_KEY, TOKEN_ID_KEY):
        assert torch.equal(remote[key], local[key]), key


class WithEmpty(Sentences):
    """Sample 2 is a BOS alone: no token is left once the first is dropped."""

    def __init__(self) -> None:
        super().__init__(5)
        self.items[2] = torch.tensor([BOS])


def test_a_sample_without_a_selected_token_counts_as_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_iocatch.cli import main

    loader = DataLoader(WithEmpty(), batch_size=1, collate_fn=pad())  # batch 2: no row at all
    dump(tmp_path, TokenRows(drop_first=True), loader)
    store = FeatureStore(tmp_path)
    assert 2 not in store.indices.tolist() and store.samples.tolist() == [0, 1, 2, 3, 4]
    assert store.missing_indices() == [] and store.missing_indices(6) == [5]
    assert main(["inspect", str(tmp_path)]) == 0
    assert "each of 0..4 present in exactly one commit" in capsys.readouterr().out
    truth = expected_tokens(hidden_states(Decoder(), loader), drop=set())
    assert torch.equal(store[KEY], truth["rows"])

    class Counting(Decoder):
        steps = 0

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            Counting.steps += 1
            return super().predict_step(batch, batch_idx, dataloader_idx)

    writer = FeatureWriter(tmp_path, tokens=TokenRows(drop_first=True), mode="resume")
    trainer([IOCaptureCallback(f"outputs[{LAYER}]", writer=writer)]).predict(Counting(), loader)
    assert Counting.steps == 0  # every sample, the empty one too, is committed
    assert torch.equal(FeatureStore(tmp_path)[KEY], truth["rows"])


def test_a_ledger_record_keeps_the_samples_without_rows() -> None:
    from lightning_iocatch.store.records import BatchRecord, ShardRecord

    record = ShardRecord(
        file="shard-r000-000000.safetensors",
        rank=0,
        bytes=10,
        crc32=1,
        batches=(BatchRecord(0, 3, 0, (7, 9)), BatchRecord(0, 4, 5)),
        keys={"k": "float32"},
        shapes={"k": [2]},
    )
    line = record.to_json()
    assert '"without_rows":[7,9]' in line and line.count("without_rows") == 1
    assert ShardRecord.from_json(line, version=2) == record  # format /2: no index summaries
    for bad in ("[]", "[-1]", '"7"'):
        damaged = json.loads(line)
        damaged["batches"][1]["without_rows"] = json.loads(bad)
        del damaged["record_crc32"]
        with pytest.raises(ValueError, match="without_rows"):
            ShardRecord.from_json(json.dumps(damaged), version=1)


def test_drop_first_in_a_batch_without_attention_mask_takes_the_padding_it_is_given() -> None:
    """A left-padded tuple batch, selected by ``mask=``: before, the first real token was
    looked for in ``batch["attention_mask"]`` only, so column 0 (padding) was dropped, the
    BOS kept, and positions counted the padding (2, 3, 4 instead of 1, 2). Now ``padding=``
    says where the sequences start, and without it ``drop_first`` is refused."""
    ids = torch.tensor([[0, 0, 1, 5, 6], [1, 7, 8, 9, 4]])
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batch = (ids, padding)
    answer = lambda batch: batch[1] == 1  # noqa: E731
    with pytest.raises(ValueError, match=r"without an 'attention_mask' .* pass `padding=`"):
        TokenRows(mask=answer, drop_first=True).select(batch)
    selection = TokenRows(
        mask=answer, token_ids=lambda b: b[0], drop_first=True, padding=lambda b: b[1]
    ).select(batch)
    # by hand: sample 0's real tokens are columns 2..4 (BOS at 2), sample 1's columns 0..4
    assert selection.sample.tolist() == [0, 0, 1, 1, 1, 1]
    assert selection.position is not None and selection.token_id is not None
    assert selection.position.tolist() == [1, 2, 1, 2, 3, 4]
    assert selection.token_id.tolist() == [5, 6, 7, 8, 9, 4]
    with_mask = TokenRows(drop_first=True).select({"input_ids": ids, "attention_mask": padding})
    assert with_mask.position is not None and with_mask.token_id is not None
    assert with_mask.position.tolist() == selection.position.tolist()  # the same rule
    assert with_mask.token_id.tolist() == selection.token_id.tolist()


def test_positions_count_from_the_first_real_token_not_the_first_selected_one() -> None:
    """A mask that selects only some tokens (an answer after its prompt): positions stay
    positions in the sequence; without a padding mask they are columns, as before."""
    ids = torch.tensor([[0, 1, 5, 6, 7]])
    padding = torch.tensor([[0, 1, 1, 1, 1]])
    answer = lambda batch: torch.tensor([[False, False, False, True, True]])  # noqa: E731
    given = TokenRows(mask=answer, padding=lambda b: b[1]).select((ids, padding))
    plain = TokenRows(mask=answer).select((ids, padding))
    assert given.position is not None and plain.position is not None
    assert given.position.tolist() == [2, 3] and plain.position.tolist() == [3, 4]
    assert "padding" not in TokenRows().settings()  # stores written before it still resume
