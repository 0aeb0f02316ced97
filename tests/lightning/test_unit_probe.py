"""UnitActivations through a real Trainer: a random GPT-2's blocks on padded batches.

Ground truth: the blocks' outputs by a hand-written hook in a plain loop
(``test_probe_tokens.hooked_outputs``) and, per unit, a NumPy lexsort of every real
token by (value desc, dataset index, position). The same probe on a shuffled loader of
batch size 2, on 2 DDP processes with uneven shards, and offline over a dump of the
token rows gives the same examples bit for bit. The 2-process run is ``main``, in the shared
launch of tests/ddp_scenarios.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows
from lightning_iocatch.probes import UnitActivations, UnitSummary
from lightning_iocatch.reports.store_units import summarize_store
from tests.ddp_scenarios import ranks_of
from tests.lightning.test_probe_tokens import BLOCKS, SPEC, GPT2Module, hooked_outputs, samples
from tests.lightning_models import trainer as quiet_trainer
from tests.probes.test_units import numpy_top

K, WIDTH = 4, 2
# the embedding's values do not depend on the batch a sample is in, bit for bit: the
# blocks' do, at float32 rounding (other batch shapes, other summation orders)
EXACT = "model.transformer.wte"
SPEC_BOTH = f"outputs[{EXACT}|{BLOCKS[1]}]"


class Predicting(GPT2Module):
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)


def unit_probes() -> list[UnitActivations]:
    index = lambda batch: batch["index"]  # noqa: E731  (shuffled loaders need it)
    # above=None: every value may be an example (negative ones, and the step's zeros)
    step = UnitActivations(k=K, window=WIDTH, above=None, of=step_of, index=index, name="step")
    return [UnitActivations(k=K, window=WIDTH, above=None, index=index), step]


def step_of(hidden: torch.Tensor) -> torch.Tensor:
    """Units of 0 and 1 only: every example ties with others."""
    return (hidden > STEP).to(hidden.dtype)


STEP = 0.05


def trainer(devices: int = 1, **options: Any) -> pl.Trainer:
    strategy = "ddp" if devices > 1 else "auto"
    return quiet_trainer(options.pop("callbacks"), devices=devices, strategy=strategy, **options)


def validate(
    side: str, devices: int = 1, spec: str = SPEC, **loader: Any
) -> dict[str, UnitSummary]:
    callback = IOCaptureCallback(spec, stages=["validate"], probes=unit_probes())
    options = {"batch_size": 3, **loader}
    trainer(devices, callbacks=[callback]).validate(
        Predicting(), DataLoader(samples(side), **options), verbose=False
    )
    assert callback.probes is not None
    return dict(callback.probes.summaries)


def same(a: UnitSummary, b: UnitSummary, exact: bool = True) -> None:
    """Equal examples (bit for bit where ``exact``: values the batching cannot change),
    equal counts; sums up to their summation order."""
    for name in ("top_index", "top_position", "context_ids", "active", "histogram"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("top_values", "context_values"):
        if exact:
            assert torch.equal(getattr(a, name).nan_to_num(-9.0), getattr(b, name).nan_to_num(-9.0))
        else:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), equal_nan=True)
    assert a.rows == b.rows
    torch.testing.assert_close(a.active_sum, b.active_sum, rtol=1e-12 if exact else 1e-5, atol=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_examples_and_density_equal_numpy_over_the_real_tokens(side: str) -> None:
    summaries = validate(side)
    hidden, fields = hooked_outputs(side)
    real = fields["attention_mask"] == 1
    sample, column = np.nonzero(real)
    first = real.argmax(axis=1)  # left padding: positions count from the first real token
    index, position = fields["index"][sample], column - first[sample]
    for name in BLOCKS:
        for label, of in (("units", lambda x: x), ("step", lambda x: (x > STEP).astype(x.dtype))):
            values = of(hidden[name].astype(np.float32))  # the captured float32 values
            summary = summaries[f"{name}/outputs/{label}"]
            rows = values[sample, column]
            expected = numpy_top(rows, index, position, K)
            got = summary.top_values.nan_to_num(-np.inf).numpy()
            np.testing.assert_array_equal(got, expected[0])
            np.testing.assert_array_equal(summary.top_index.numpy(), expected[1])
            np.testing.assert_array_equal(summary.top_position.numpy(), expected[2])
            unit, slot = 3, 1  # one example's window: ids and values around its token
            at, row = int(expected[2, unit, slot]), int(expected[1, unit, slot])
            columns = first[row] + at + np.arange(-WIDTH, WIDTH + 1)
            inside = (columns >= 0) & (columns < real.shape[1])
            inside[inside] &= real[row, columns[inside]]
            ids = np.where(inside, fields["input_ids"][row, columns.clip(0, real.shape[1] - 1)], -1)
            assert summary.context_ids[unit, slot].tolist() == ids.tolist()
            near = values[row, columns.clip(0, real.shape[1] - 1), unit]
            np.testing.assert_array_equal(
                summary.context_values[unit, slot].numpy(), np.where(inside, near, np.nan)
            )
            assert summary.rows == len(rows)
            np.testing.assert_array_equal(summary.active.numpy(), (rows > 0).sum(0))
            sums = np.where(rows > 0, rows.astype(np.float64), 0).sum(0)
            np.testing.assert_allclose(summary.active_sum.numpy(), sums, rtol=1e-12)
    # the premise: the step units' examples are all ties, at 1 and at 0
    ties = summaries[f"{BLOCKS[1]}/outputs/step"].top_values
    assert int((ties == 1).sum()) > 10 and int((ties == 0).sum()) > 10


def test_a_shuffled_loader_of_batch_size_2_gives_the_same_examples() -> None:
    ordered = validate("left", spec=SPEC_BOTH)
    torch.manual_seed(5)
    shuffled = validate("left", spec=SPEC_BOTH, batch_size=2, shuffle=True)
    assert ordered.keys() == shuffled.keys() and len(ordered) == 4
    for name, summary in ordered.items():
        same(summary, shuffled[name], exact=name.startswith(EXACT))


def test_the_dump_of_token_rows_gives_the_validation_examples(tmp_path: Path) -> None:
    writer = FeatureWriter(tmp_path / "store", tokens=TokenRows())
    callback = IOCaptureCallback(SPEC, writer=writer)
    loader = DataLoader(samples("left"), batch_size=4)
    trainer(callbacks=[callback]).predict(Predicting(), loader, return_predictions=False)
    expected = validate("left")  # in batches of 3: other float32 roundings in the blocks
    for name in BLOCKS:
        for probe in unit_probes():
            # rows_per_step=7 cuts the stored batches between samples, never inside one
            got = summarize_store(tmp_path / "store", f"{name}/outputs", probe, rows_per_step=7)
            same(got, expected[f"{name}/outputs/{probe.name}"], exact=False)


@pytest.mark.slow
def test_two_ddp_processes_find_the_examples_of_one(ddp_scenarios: Path) -> None:
    """23 samples in batches of 3 over 2 processes: process 1's last batch repeats sample 0
    (flagged padding); each process's merged summaries equal one process's bit for bit."""
    out = ranks_of(ddp_scenarios, "unit_probe")
    expected = validate("right", spec=SPEC_BOTH)
    for rank in (0, 1):
        names = json.loads((out / f"rank{rank}.json").read_text())
        assert sorted(names) == sorted(expected)
        for number, name in enumerate(names):
            got = UnitSummary.load(out / f"rank{rank}-{number}.safetensors")
            same(got, expected[name], exact=name.startswith(EXACT))


def main(out: Path) -> None:
    summaries = validate("right", devices=2, spec=SPEC_BOTH)
    rank = torch.distributed.get_rank()
    names = sorted(summaries)
    for number, name in enumerate(names):
        summaries[name].save(out / f"rank{rank}-{number}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps(names))
