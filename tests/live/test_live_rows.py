"""LiveActivations yields, in one epoch, exactly the rows a dump of the same inputs holds.

Truths, none of them LiveActivations' own code:

- a dump: ``IOCaptureCallback(writer=FeatureWriter(path, tokens=TokenRows()))`` in
  ``trainer.predict`` over the same DataLoader, read back with ``FeatureStore``: the set of
  ``(index, position)`` and each row's float32 values, equal bit for bit on the CPU;
- Hugging Face's ``output_hidden_states`` of the same batches, the tokens selected in
  Python loops from ``attention_mask`` (left padding; positions from the first real token);
- per-sample rows of an ``nn.Sequential``: the dump's rows and the layers run by hand;
- under ``Trainer(precision="bf16-mixed")``: a dump under the same precision, and a hand
  run under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, TokenRows
from lightning_iocatch.lightning.live import LiveActivations
from lightning_iocatch.store.names import POSITION_KEY
from tests.conftest import RowLinear
from tests.scripts.live_distributed import (
    INPUT_BATCH,
    KEY,
    SPEC,
    Recorder,
    language_model,
    live,
    texts,
    trainer,
)

COUNT = 23  # sequences: 5 input batches of 5, the last short
DUMP_KEY = f"lm.{KEY}"


class Frozen(pl.LightningModule):
    """The language model under ``lm``, for a dump's ``trainer.predict``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.lm(**batch).logits


def inputs(count: int = COUNT) -> DataLoader:
    return DataLoader(texts(count), batch_size=INPUT_BATCH)  # type: ignore[arg-type]


def dump(path: Path, precision: str = "32-true") -> dict[tuple[int, int], torch.Tensor]:
    """The token rows a dump of ``inputs()`` holds, by ``(index, position)``."""
    writer = FeatureWriter(path, tokens=TokenRows())
    callback = IOCaptureCallback(f"outputs[lm.{KEY[: -len('/outputs')]}]", early_exit=True,
                                 writer=writer)  # fmt: skip
    run = trainer(callbacks=[callback], precision=precision)
    run.predict(Frozen(language_model()), inputs(), return_predictions=False)
    store = FeatureStore(path)
    pairs = zip(store.indices.tolist(), store[POSITION_KEY].tolist(), strict=True)
    return {pair: row for pair, row in zip(pairs, store[DUMP_KEY], strict=True)}


def by_pair(batches: list[dict[str, Any]]) -> dict[tuple[int, int], torch.Tensor]:
    """The rows of an epoch's batches by ``(index, position)``; no pair twice."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    for batch in batches:
        index, position = list(batch["index"]), list(batch["position"])
        for row, pair in enumerate(zip(map(int, index), map(int, position), strict=True)):
            assert pair not in found, f"{pair} twice in one epoch"
            found[pair] = batch[KEY][row] if KEY in batch else batch["rows"][row]
    return found


def hugging_face(
    autocast: bool = False, dtype: torch.dtype = torch.float32
) -> dict[tuple[int, int], torch.Tensor]:
    """Layer 1's output (``hidden_states[2]``) of every real token, by Python loops (the
    model in ``dtype``)."""
    lm, found, start = language_model().to(dtype), {}, 0
    for batch in inputs():
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            hidden = lm(**batch, output_hidden_states=True).hidden_states[2]
        for i in range(len(hidden)):
            mask = batch["attention_mask"][i].tolist()
            first = mask.index(1)
            for column in range(len(mask)):
                if mask[column]:
                    found[start + i, column - first] = hidden[i, column]
        start += len(hidden)
    return found


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], torch.Tensor]:
    return dump(tmp_path_factory.mktemp("live-dump"))


@pytest.fixture(scope="module")
def one_epoch() -> list[dict[str, Any]]:
    """One epoch outside a Trainer (one process, epoch 0)."""
    return list(live(COUNT).train_dataloader())


def test_token_rows_are_the_dump_rows(one_epoch: list, dumped: dict) -> None:
    found = by_pair(one_epoch)
    tokens = sum(int(item["attention_mask"].sum()) for item in texts(COUNT))
    assert len(dumped) == tokens > 0
    assert found.keys() == dumped.keys()
    for pair, row in dumped.items():
        assert found[pair].dtype == row.dtype == torch.float32
        assert torch.equal(found[pair], row), pair


def test_token_rows_are_hugging_face_hidden_states(one_epoch: list) -> None:
    found, truth = by_pair(one_epoch), hugging_face()
    assert found.keys() == truth.keys()
    for pair, row in truth.items():
        assert torch.equal(found[pair], row), pair


def test_batches_hold_the_key_index_and_position(one_epoch: list) -> None:
    for batch in one_epoch:
        assert sorted(batch) == sorted([KEY, "index", "position"])
        assert batch[KEY].shape == (len(batch["index"]), 32)
        assert batch["index"].dtype == torch.int64


class Net(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.net(batch[0])


def test_per_sample_rows_of_a_sequential_are_the_dump_rows(tmp_path: Path) -> None:
    torch.manual_seed(4)
    net = nn.Sequential(RowLinear(4, 8), nn.ReLU(), RowLinear(8, 3))
    x = torch.randn(23, 4, generator=torch.Generator().manual_seed(5))
    loader = DataLoader(TensorDataset(x), batch_size=5)
    data = LiveActivations(net, "outputs[1]", loader, batch_size=4, buffer_rows=9)
    batches = list(data.train_dataloader())
    assert all(sorted(batch) == ["1/outputs", "index"] for batch in batches)
    index = torch.cat([batch["index"] for batch in batches])
    rows = torch.cat([batch["1/outputs"] for batch in batches])
    assert sorted(index.tolist()) == list(range(23))
    assert index.tolist() != list(range(23))  # drawn, not read in order
    callback = IOCaptureCallback("outputs[net.1]", writer=FeatureWriter(tmp_path))
    trainer(callbacks=[callback]).predict(Net(net), loader, return_predictions=False)
    store = FeatureStore(tmp_path)
    assert store.indices.tolist() == list(range(23))
    by_index = rows[index.argsort()]
    assert torch.equal(by_index, store["net.1/outputs"])
    with torch.no_grad():
        hand = torch.cat([torch.relu(net[0](part)) for part in x.split(5)])
    assert torch.equal(by_index, hand)


def test_bf16_mixed_rows_are_the_autocast_rows(tmp_path: Path) -> None:
    """Under ``precision="bf16-mixed"`` the rows are those of a dump under the same
    precision and of a hand run under autocast, not the float32 forward's. (A Llama layer's
    output is float32 under autocast too: its residual stream is float32, the attention and
    MLP outputs added to it bfloat16.)"""
    recorder = Recorder()
    trainer(max_epochs=1, precision="bf16-mixed").fit(recorder, datamodule=live(COUNT))
    found = by_pair(recorder.seen)
    truth, plain = dump(tmp_path / "bf16", "bf16-mixed"), hugging_face()
    hand = hugging_face(autocast=True)
    assert {batch["dtype"] for batch in recorder.seen} == {next(iter(hand.values())).dtype}
    assert found.keys() == truth.keys() == hand.keys()
    differ = 0
    for pair, row in truth.items():
        assert torch.equal(found[pair], row.float()), pair
        assert torch.equal(found[pair], hand[pair].float()), pair
        differ += not torch.equal(found[pair], plain[pair])
    assert differ > 0.9 * len(truth)  # autocast ran: bfloat16 matmuls


def test_bf16_true_rows_are_those_of_the_model_in_bfloat16(tmp_path: Path) -> None:
    """Under ``precision="bf16-true"`` the frozen model runs in bfloat16 (Lightning's
    conversion, as a dump under that precision): its rows equal a dump under the same
    precision and Hugging Face's hidden states of the model in bfloat16."""
    recorder = Recorder()
    trainer(max_epochs=1, precision="bf16-true").fit(recorder, datamodule=live(COUNT))
    found = by_pair(recorder.seen)
    truth, hand = dump(tmp_path / "bf16-true", "bf16-true"), hugging_face(dtype=torch.bfloat16)
    assert found.keys() == truth.keys() == hand.keys()
    for pair, row in truth.items():
        assert torch.equal(found[pair], row.float()), pair
        assert torch.equal(found[pair], hand[pair].float()), pair


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")  # `plain`
def test_a_validation_loader_is_validated_on_each_epoch_of_a_live_fit() -> None:
    """``validation=``: held-out text reaches ``SAEModule(language_model=...)`` (``fit``
    takes no validation loader beside a data module); the figures logged after the fit are
    those of a separate ``validate`` of the fitted weights on that text, and none without.
    The language model, shared by the data module and the SAE module, has dropout: Lightning
    puts it in train mode for the fit, and the rows must still be those of the model in eval
    mode (Hugging Face's hidden states)."""
    from lightning_iocatch.lightning.sae import SAEModule
    from tests.lightning_models import tiny_llama

    lm = tiny_llama(num_hidden_layers=3, attention_dropout=0.5)  # language_model()'s weights
    held_out = DataLoader(texts(6, seed=1), batch_size=3)  # type: ignore[arg-type]
    data = LiveActivations(lm, SPEC, inputs(), batch_size=24, buffer_rows=60,
                           tokens=TokenRows(), validation=held_out)  # fmt: skip
    torch.manual_seed(0)
    module = SAEModule(32, 64, "topk", k=4, key=KEY, lr=3e-3, language_model=lm,
                       layer=SPEC[len("outputs[") : -1])  # fmt: skip
    validated: list[int] = []
    trained: list[dict[str, Any]] = []

    class Count(pl.Callback):
        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            validated.append(len(args[3]["input_ids"]))  # the batch

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            if trainer.current_epoch == 1:  # after a validation: Lightning's train() again
                trained.append(args[2])  # the batch

    fitted = trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=[Count()])
    fitted.fit(module, datamodule=data)
    logged = {name: float(value) for name, value in fitted.callback_metrics.items()}
    assert validated == [3, 3] * 2  # the held-out loader, whole, after each epoch
    rows, truth = by_pair(trained), hugging_face()
    assert rows.keys() == truth.keys()
    for pair, row in rows.items():
        torch.testing.assert_close(row, truth[pair], rtol=1e-5, atol=1e-5, msg=str(pair))
    assert not lm.training  # given back in its modes (SAEModule keeps them)
    again = trainer().validate(module, held_out, verbose=False)[0]
    for name in ("sae/sae/loss_recovered", "sae/sae/kl", "val/dead_fraction"):
        assert logged[name] == pytest.approx(again[name], rel=1e-6), name
    plain = trainer(max_epochs=1)
    plain.fit(SAEModule(32, 64, "topk", k=4, key=KEY), datamodule=live(COUNT))
    assert not any(name.startswith(("sae/sae/", "val/")) for name in plain.callback_metrics)
    with pytest.raises(TypeError, match="`validation` must be a DataLoader"):
        LiveActivations(lm, SPEC, inputs(), batch_size=24, validation=[1, 2])  # type: ignore[arg-type]
