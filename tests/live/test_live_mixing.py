"""LiveActivations' epochs in a 1-process Trainer: each row once per epoch, drawn from
fills of the mixing buffer, in an order fixed by the seed; forwards under inference mode that
stop after the captured module; a resumed epoch goes on where the checkpoint left it.

Truths: the rows an epoch must hold and the fills they come in are counted here from the
inputs' ``attention_mask`` (consecutive input batches until the buffer holds
``buffer_rows``), not by the library; the order of an uninterrupted run is the truth of a
resumed one; forward hooks on the model's layers count the calls and read
``torch.is_inference_mode_enabled()``; the draws of ``mixing`` are checked against
``torch.randperm`` properties (a permutation, sizes within one). Errors: ``pytest.raises``.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch import TokenRows
from lightning_iocatch.errors import SpecError
from lightning_iocatch.lightning.live import LiveActivations
from lightning_iocatch.lightning.live.mixing import fill_order, split_rows
from tests.scripts.live_distributed import (
    BATCH,
    BUFFER,
    INPUT_BATCH,
    SPEC,
    Recorder,
    live,
    texts,
    trainer,
)

COUNT = 23
# resumed Trainers without the ModelCheckpoint that saved: Lightning's advice, not a fault
pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")


def fills(count: int = COUNT) -> list[list[tuple[int, int]]]:
    """The ``(index, position)`` of each fill: whole input batches until ``BUFFER`` rows."""
    found, held = [], []
    items = texts(count)
    for first in range(0, count, INPUT_BATCH):
        for index in range(first, min(first + INPUT_BATCH, count)):
            real = int(items[index]["attention_mask"].sum())
            held += [(index, position) for position in range(real)]
        if len(held) >= BUFFER:
            found, held = [*found, held], []
    return [*found, held] if held else found


def pairs(batch: dict[str, Any]) -> list[tuple[int, int]]:
    return list(zip(batch["index"], batch["position"], strict=True))


def drawn(batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    return list(zip(batch["index"].tolist(), batch["position"].tolist(), strict=True))


def epoch(seen: list[dict[str, Any]], number: int) -> list[dict[str, Any]]:
    return [batch for batch in seen if batch["epoch"] == number]


class Hooks:
    """Forward hooks on layers 1 (captured) and 2 and on ``lm_head`` (after it)."""

    def __init__(self, lm: nn.Module) -> None:
        self.calls: Counter[str] = Counter()
        self.inference: list[bool] = []
        for name in ("model.layers.1", "model.layers.2", "lm_head"):
            lm.get_submodule(name).register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.calls[name] += 1
            self.inference.append(torch.is_inference_mode_enabled())

        return hook


@pytest.fixture(scope="module")
def fitted() -> tuple[list[dict[str, Any]], Hooks]:
    data = live(COUNT)
    hooks, recorder = Hooks(data.model), Recorder()
    trainer().fit(recorder, datamodule=data)
    return recorder.seen, hooks


def test_each_row_once_per_epoch(fitted: tuple) -> None:
    seen, _ = fitted
    every = sorted(pair for fill in fills() for pair in fill)
    assert len(every) == sum(int(item["attention_mask"].sum()) for item in texts(COUNT))
    for number in (0, 1):
        found = [pair for batch in epoch(seen, number) for pair in pairs(batch)]
        assert sorted(found) == every  # each once: no pair twice, none left out


def test_batches_are_each_fill_split_near_equally(fitted: tuple) -> None:
    seen, _ = fitted
    for number in (0, 1):
        batches = iter(epoch(seen, number))
        for fill in fills():
            count = math.ceil(len(fill) / BATCH)
            taken = [next(batches) for _ in range(count)]
            sizes = [len(batch["index"]) for batch in taken]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= BATCH, sizes
            assert sorted(pair for batch in taken for pair in pairs(batch)) == sorted(fill)
        assert next(batches, None) is None


def test_rows_are_shuffled_and_in_another_order_each_epoch(fitted: tuple) -> None:
    seen, _ = fitted
    first, second = ([pair for b in epoch(seen, n) for pair in pairs(b)] for n in (0, 1))
    assert first != sorted(first) and second != sorted(second)
    assert first != second
    inputs = {index // INPUT_BATCH for index, _ in pairs(epoch(seen, 0)[0])}
    assert len(inputs) > 1  # a batch mixes the input batches of its fill


def test_the_same_seed_draws_the_same_batches(fitted: tuple) -> None:
    seen, _ = fitted
    again, other = (list(live(COUNT, seed=seed).train_dataloader()) for seed in (0, 1))
    assert len(again) == len(epoch(seen, 0))
    for batch, truth in zip(again, epoch(seen, 0), strict=True):  # epoch 0 outside a Trainer
        assert batch["index"].tolist() == truth["index"]
        assert batch["position"].tolist() == truth["position"]
        assert torch.equal(batch["model.layers.1/outputs"], truth["rows"])
    order = [pair for batch in again for pair in drawn(batch)]
    shuffled = [pair for batch in other for pair in drawn(batch)]
    assert shuffled != order and sorted(shuffled) == sorted(order)


def test_forwards_run_under_inference_mode_and_stop_after_the_captured_layer(
    fitted: tuple,
) -> None:
    seen, hooks = fitted
    forwards = math.ceil(COUNT / INPUT_BATCH)
    assert hooks.calls == {"model.layers.1": 2 * forwards}  # layer 2, lm_head: never
    assert hooks.inference and all(hooks.inference)
    assert all(batch["grad"] and not batch["inference"] for batch in seen)  # training is not


# -- the mixing buffer's draws -----------------------------------------------------------


def test_a_fill_order_is_a_permutation_fixed_by_seed_epoch_rank_and_fill() -> None:
    settings = {"seed": 3, "epoch": 1, "rank": 0, "fill": 2}
    order = fill_order(50, **settings)
    assert sorted(order.tolist()) == list(range(50)) and order.tolist() != list(range(50))
    assert torch.equal(order, fill_order(50, **settings))
    for name in settings:
        assert not torch.equal(order, fill_order(50, **{**settings, name: settings[name] + 1}))


@pytest.mark.parametrize(("rows", "batches"), [(10, 3), (7, 7), (3, 5), (48, 2)])
def test_split_rows_draws_each_row_once_in_sizes_within_one(rows: int, batches: int) -> None:
    values = {"h": torch.arange(rows * 2.0).view(rows, 2), "index": torch.arange(rows)}
    order = fill_order(rows, seed=0, epoch=0, rank=0, fill=0)
    parts = split_rows(values, order, batches)
    sizes = [len(part["index"]) for part in parts]
    assert len(parts) == batches and sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    drawn = torch.cat([part["index"] for part in parts])
    assert drawn.tolist() == order.tolist()
    assert torch.equal(torch.cat([part["h"] for part in parts]), values["h"][order])


# -- resuming an epoch -------------------------------------------------------------------


class Crash(pl.Callback):
    """Raises after batch ``at`` of epoch 0 (after the checkpoint of that step was saved)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        if trainer.current_epoch == 0 and i == self.at:
            raise RuntimeError("crash")


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A run that saved a checkpoint every 3 steps and crashed after batch 7 of epoch 0."""
    folder = tmp_path_factory.mktemp("live-crash")
    recorder = Recorder()
    every = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=3,
                            save_top_k=-1)  # fmt: skip
    run = trainer(enable_checkpointing=True, callbacks=[Crash(7), every])
    with pytest.raises(RuntimeError, match="crash"):
        run.fit(recorder, datamodule=live(COUNT))
    return folder, recorder.seen


def test_a_resumed_epoch_draws_the_batches_the_run_had_left(fitted: tuple, crashed: tuple) -> None:
    (whole, _), (folder, before) = fitted, crashed
    assert sorted(path.name for path in folder.iterdir()) == ["step=3.ckpt", "step=6.ckpt"]
    recorder = Recorder()
    trainer().fit(recorder, datamodule=live(COUNT), ckpt_path=folder / "step=6.ckpt")
    assert [batch["batch_idx"] for batch in recorder.seen[:1]] == [6]
    joined = before[:6] + recorder.seen  # batches 6 and 7 of the crashed run do not count
    assert len(joined) == len(whole)
    for batch, truth in zip(joined, whole, strict=True):
        for name in ("epoch", "batch_idx", "index", "position"):
            assert batch[name] == truth[name], name
        assert torch.equal(batch["rows"], truth["rows"])
    for batch, truth in zip(before[6:8], whole[6:8], strict=True):  # drawn the same again
        assert batch["index"] == truth["index"] and batch["position"] == truth["position"]


@pytest.mark.parametrize(
    "change",
    [{"batch_size": 16}, {"seed": 1}, {"buffer_rows": 50}, {"inputs_batch": 3},
     {"count": COUNT - 1}, {"tokens": TokenRows(drop_first=True)}],
)  # fmt: skip
def test_a_mid_epoch_resume_with_other_settings_is_refused(
    crashed: tuple, change: dict[str, int]
) -> None:
    folder, _ = crashed
    (name,) = change
    settings = {"count": COUNT, **change}
    shown = {"inputs_batch": "inputs_batch_size", "count": "inputs"}.get(name, name)
    with pytest.raises(
        ValueError, match=rf"the checkpoint was made with .*'{shown}'.*must be the same"
    ):
        trainer().fit(Recorder(), datamodule=live(**settings), ckpt_path=folder / "step=6.ckpt")


@pytest.mark.parametrize("saved", ["epoch_end", "last_batch"])
@pytest.mark.parametrize("batch_size", [BATCH, 16])
def test_a_resume_from_the_end_of_an_epoch_runs_the_next_whole(
    fitted: tuple, tmp_path: Path, saved: str, batch_size: int
) -> None:
    """A checkpoint of a finished epoch (``ModelCheckpoint``'s default at the epoch's end,
    or every n steps landing on its last batch): the next epoch holds every row once (in
    the uninterrupted run's batches where the batch size is the same), and another batch
    size is taken (the refusal's own message says to resume there)."""
    last = sum(math.ceil(len(fill) / BATCH) for fill in fills())
    every = {"epoch_end": {}, "last_batch": {"every_n_train_steps": last, "save_top_k": -1}}
    first = trainer(max_epochs=1, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=tmp_path, **every[saved])])  # fmt: skip
    first.fit(Recorder(), datamodule=live(COUNT))
    (ckpt,) = tmp_path.iterdir()
    recorder = Recorder()
    run = trainer()
    run.fit(recorder, datamodule=live(COUNT, batch_size=batch_size), ckpt_path=ckpt)
    found = [pair for batch in epoch(recorder.seen, 1) for pair in pairs(batch)]
    assert sorted(found) == sorted(pair for fill in fills() for pair in fill)
    assert epoch(recorder.seen, 0) == []
    if batch_size == BATCH:
        truth = epoch(fitted[0], 1)
        assert [pairs(batch) for batch in epoch(recorder.seen, 1)] == [pairs(b) for b in truth]


# -- errors ------------------------------------------------------------------------------


def lm_inputs() -> DataLoader:
    return DataLoader(texts(4), batch_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"inputs": [torch.zeros(2)]}, TypeError, r"`inputs` must be a DataLoader .* got list"),
    ({"model": "gpt2"}, TypeError, r"`model` must be an nn.Module, got str"),
    ({"batch_size": 0}, ValueError, r"`batch_size` must be a positive int, got 0"),
    ({"batch_size": -3}, ValueError, r"`batch_size` must be a positive int, got -3"),
    ({"batch_size": 2.0}, ValueError, r"`batch_size` must be a positive int, got 2.0"),
    ({"batch_size": True}, ValueError, r"`batch_size` must be a positive int, got True"),
    ({"buffer_rows": 0}, ValueError, r"`buffer_rows` must be a positive int, got 0"),
    ({"buffer_rows": "64"}, ValueError, r"`buffer_rows` must be a positive int, got '64'"),
    ({"spec": "outputs[model.layers.1"}, SpecError, r"unbalanced '\['"),
    ({"spec": "output[model.layers.1]"}, SpecError, r"unknown section 'output'"),
    ({"spec": ""}, ValueError, r"the spec is empty"),
    ({"tokens": {"attention_mask"}}, TypeError, r"`tokens` must be a TokenRows, got set"),
    ({"tokens": TokenRows}, TypeError, r"`tokens` must be a TokenRows, got type"),
])  # fmt: skip
def test_bad_arguments_are_refused(options: dict[str, Any], error: type, match: str) -> None:
    from tests.scripts.live_distributed import language_model

    settings = {"model": language_model(), "spec": SPEC, "inputs": lm_inputs(),
                "batch_size": 4, "tokens": TokenRows(), **options}  # fmt: skip
    with pytest.raises(error, match=match):
        LiveActivations(**settings)


@pytest.mark.parametrize("reduce", ["mean", "first", "last"])
def test_token_rows_reduced_per_sample_are_refused_at_once(reduce: str) -> None:
    """``TokenRows(reduce=...)`` gives one row per sample, which LiveActivations does not
    draw (its rows are counted per token): refused when made, not at the first forward
    ("Could not infer dtype of NoneType", "a batch gave 5 rows where its token mask
    counts 45")."""
    from tests.scripts.live_distributed import language_model

    with pytest.raises(ValueError, match="reduce"):
        LiveActivations(language_model(), SPEC, lm_inputs(), batch_size=4,
                        tokens=TokenRows(reduce=reduce))  # type: ignore[arg-type]  # fmt: skip


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(texts(4))


@pytest.mark.parametrize(("loader", "match"), [
    (lambda: DataLoader(Stream(), batch_size=2), r"IterableDataset|map-style"),
    (lambda: DataLoader(texts(4), batch_size=None), r"batch_size"),
], ids=["iterable-dataset", "batch-size-none"])  # fmt: skip
def test_inputs_it_cannot_read_by_index_are_refused_at_once(loader: Any, match: str) -> None:
    """An ``IterableDataset`` (no index to give each row, no share per process) and a loader
    of ready-made batches (``batch_size=None``: a dataset item is a batch, not a sample) are
    refused when made, not in the first epoch with torch's "expected unspecified
    batch_sampler option" or "a batch gave 1 rows where its token mask counts 4"."""
    from tests.scripts.live_distributed import language_model

    with pytest.raises((TypeError, ValueError), match=match):
        LiveActivations(language_model(), SPEC, loader(), batch_size=4, tokens=TokenRows())


class _Boom(Recorder):
    """Raises in ``training_step`` of batch ``at`` of epoch 0 (an exception's checkpoint is
    saved during the step: Lightning runs that batch again)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.current_epoch == 0 and batch_idx == self.at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_resume_from_a_checkpoint_saved_during_a_step_runs_that_batch_again(
    fitted: tuple, tmp_path: Path
) -> None:
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    whole, _ = fitted
    first = _Boom(at=3)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(
            enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(tmp_path, "exception")]
        ).fit(first, datamodule=live(COUNT))
    second = Recorder()
    trainer().fit(second, datamodule=live(COUNT), ckpt_path=tmp_path / "exception.ckpt")
    joined = [pair for batch in first.seen + epoch(second.seen, 0) for pair in pairs(batch)]
    truth = [pair for batch in epoch(whole, 0) for pair in pairs(batch)]
    assert joined == truth  # batch 3 again, none skipped, none twice


def test_a_resume_from_a_checkpoint_saved_after_the_fit_draws_the_next_epochs_order(
    fitted: tuple, tmp_path: Path
) -> None:
    whole, _ = fitted
    run = trainer(max_epochs=1)
    run.fit(Recorder(), datamodule=live(COUNT))
    run.save_checkpoint(tmp_path / "after.ckpt")
    resumed = Recorder()
    trainer(max_epochs=2).fit(resumed, datamodule=live(COUNT), ckpt_path=tmp_path / "after.ckpt")
    assert [pairs(batch) for batch in resumed.seen] == [pairs(b) for b in epoch(whole, 1)]
