"""ActivationMonitor in 2 DDP processes: one collective a watched step, figures of both.

The processes agree on the statistics' layout on the first watched step and after a
process saw a key the layout lacked; every other watched step costs one ``all_gather``,
counted at ``torch.distributed`` (what Lightning's strategy calls). Each process also
records its own activations with plain hooks; the truth is NumPy float64 over both
processes' arrays. The run is ``main``, in the shared 2-process launch of
tests/ddp_scenarios.py.

The model's two parameterless probes (outside the loss) make the awkward cases:
``extra`` runs on process 1 only, on steps 1 and 2 (a key the layout agreed on step 0
lacks: warned about once, agreed again on step 2); ``ragged`` is 8 wide, except on
process 1 at step 3, where it is 5 (its per-unit part is left out: dead_frac NaN), and
on both processes at step 4, where it is 5 (the misfit of step 3 makes the processes
agree again on step 4: its dead fraction is that of the 5 units, not NaN).
"""

from __future__ import annotations

import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_iocatch.lightning.health_layout import HealthLayout
from lightning_iocatch.lightning.health_monitor import ActivationMonitor
from lightning_iocatch.probes.health import (
    HEAD,
    HealthFigures,
    health_statistics,
    merge_statistics,
)
from tests.ddp_scenarios import ranks_of
from tests.lightning.health_truth import BLOCKS, Recorder, Regression, dataset, figures, trainer

SPEC = "outputs[model.layers.*|ragged|extra]|grad_outputs[model.layers.*]"
STEPS = 5
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier")


class Probed(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.ragged, self.extra = nn.Identity(), nn.Identity()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        step, rank = self.trainer.global_step, self.global_rank
        self.ragged(x[:, :5] if (rank, step) == (1, 3) or step == 4 else x)
        if rank == 1 and step in (1, 2):
            self.extra(2 * x)
        return super().training_step(batch, batch_idx)


class Counted(pl.Callback):
    """The collectives called from a batch's start to its end (after the monitor's)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.start, self.per_step = calls, 0, {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        self.start = len(self.calls)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.per_step[trainer.global_step - 1] = self.calls[self.start :]


def counting(calls: list[str]) -> dict[str, Any]:
    """Count every call of the collectives torch.distributed offers Lightning; the real
    functions, to put back."""
    reals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)
    return reals


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        data = dataset(4 * STEPS)
        return DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))


def main(out: Path) -> None:
    """One process of the 2-process run (in the shared launch of tests/ddp_scenarios.py)."""
    calls: list[str] = []
    reals = counting(calls)
    monitor = ActivationMonitor(SPEC, every_n_steps=1, tokens=None)
    recorder, counted = Recorder([*BLOCKS, "ragged", "extra"]), Counted(calls)
    run = trainer(
        [recorder, monitor, counted], devices=2, strategy="ddp", max_steps=STEPS,
        use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Probed(), train_dataloaders=Data())
    for name, real in reals.items():  # the scenarios after this one count nothing
        setattr(dist, name, real)
    rank = run.global_rank
    seen = {step: {k: v for k, v in keys.items()} for step, keys in recorder.seen.items()}
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "history": monitor.history,
                "collectives": counted.per_step,
                "warnings": [
                    str(w.message) for w in caught if "ActivationMonitor" in str(w.message)
                ],
            }
        )
    )


@pytest.mark.slow
def test_one_collective_a_watched_step_and_the_figures_of_both_processes(
    ddp_scenarios: Path,
) -> None:
    out = ranks_of(ddp_scenarios, "health_layout")
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    seen = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert json.dumps(found[0]["history"]) == json.dumps(found[1]["history"])  # (NaN != NaN)
    # 2 gathers to agree (step 0; step 2, after process 1 saw `extra`; step 4, after
    # `ragged`'s width did not fit on step 3), then 1 a step
    for one in found:
        assert one["collectives"] == {
            "0": ["all_gather"] * 3, "1": ["all_gather"], "2": ["all_gather"] * 3,
            "3": ["all_gather"], "4": ["all_gather"] * 3,
        }  # fmt: skip
    assert found[0]["warnings"] == []
    assert len(found[1]["warnings"]) == 1 and "'extra/outputs'" in found[1]["warnings"][0]
    history = found[0]["history"]
    assert [step for step, _ in history] == list(range(STEPS))
    for step, logged in history:
        keys = sorted(set(seen[0][step]) | set(seen[1][step]))
        if step == 1:
            keys.remove("extra/outputs")  # not in the layout: left out of this step
        assert set(logged) == {f"health/{k}/{n}" for k in keys for n in FIGURE_NAMES}
        for key in keys:
            arrays = seen[0][step].get(key, []) + seen[1][step].get(key, [])
            ragged = len({a.shape[-1] for a in arrays}) > 1
            truth = figures([a.reshape(-1, 1) for a in arrays]) if ragged else figures(arrays)
            if ragged:
                truth["dead_frac"] = math.nan  # left out, not wrong
            for name, value in truth.items():
                got = logged[f"health/{key}/{name}"]
                if math.isnan(value):
                    assert math.isnan(got), (step, key, name)
                else:
                    assert got == pytest.approx(value, rel=1e-9, abs=1e-15), (step, key, name)
    assert math.isnan(history[3][1]["health/ragged/outputs/dead_frac"])
    assert history[4][1]["health/ragged/outputs/dead_frac"] == 0.0  # 5 wide, agreed again
    # the figures are of both processes: process 0 alone has others
    alone = figures(seen[0][0]["model.layers.0/outputs"])
    assert alone["absmax"] != history[0][1]["health/model.layers.0/outputs/absmax"]


FIGURE_NAMES = ("mean", "rms", "absmax", "kurtosis", "dead_frac", "nonfinite")


def test_a_width_changed_on_one_process_leaves_out_only_its_dead_fraction() -> None:
    """Two processes' packs stacked as the gather would: process 1's ``a`` is 2 wide where
    the layout agreed on 3, process 0 did not see ``b``. Fast, without processes."""
    generator = torch.Generator().manual_seed(2)
    a0 = torch.relu(torch.randn(4, 3, generator=generator, dtype=torch.float64))
    a0[:, 1] = 0  # dead on process 0 only: the merged dead fraction would be wrong
    a1 = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    b1 = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    layouts = [HealthLayout(HEAD), HealthLayout(HEAD)]
    for layout in layouts:  # as agreed on an earlier step
        layout.widths = {"a": 3, "b": 4}
    packs = [
        layouts[0].pack({"a": health_statistics(a0)}),
        layouts[1].pack({"a": health_statistics(a1), "b": health_statistics(b1)}),
    ]
    gathered = torch.stack(packs)
    assert HealthLayout.any_unknown(gathered)  # the misfit: agree again on the next step
    assert [pack[-1].item() for pack in packs] == [0.0, 1.0]
    blocks = layouts[0].unpack(gathered)
    (part_a, valid_a), (part_b, valid_b) = blocks["a"], blocks["b"]
    assert (valid_a, valid_b) == (False, True)
    found_a = HealthFigures.of(merge_statistics(part_a)[:HEAD]).scalars()
    truth_a = figures([a0.numpy().reshape(-1, 1), a1.numpy().reshape(-1, 1)])
    for name in ("mean", "rms", "absmax", "kurtosis", "nonfinite"):
        assert found_a[name] == pytest.approx(truth_a[name], rel=1e-12), name
    assert math.isnan(found_a["dead_frac"])
    found_b = HealthFigures.of(merge_statistics(part_b)).scalars()  # process 0's zeros: nothing
    for name, value in figures([b1.numpy()]).items():
        assert found_b[name] == pytest.approx(value, rel=1e-12), name


def test_a_width_that_differed_at_the_agreement_is_agreed_again() -> None:
    """Widths that differed between the processes when they agreed (the layout's width 0)
    do not fit on any process: every pack counts the misfit, so the next watched step
    agrees again (the dead fraction is NaN for one step, not the rest of the fit), and no
    warning says the key is unknown."""
    layout = HealthLayout(HEAD)
    layout.widths = {"a": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = layout.pack({"a": health_statistics(torch.ones(3, 4))})
    assert packed[-1] == 1 and packed[HEAD] == 1  # counted, and its dead fraction flagged
    assert HealthLayout.any_unknown(packed[None])
    layout.widths = {"a": 4}  # as agreed again when the widths are the same
    assert layout.pack({"a": health_statistics(torch.ones(3, 4))})[-1] == 0


def test_a_key_the_layout_lacks_is_warned_about_once_and_flagged() -> None:
    layout = HealthLayout(HEAD)
    layout.widths = {"a": 2}
    vectors = {"a": health_statistics(torch.ones(2, 2)), "new": health_statistics(torch.ones(1))}
    with pytest.warns(UserWarning, match=r"'new'.*agree again on the next watched step"):
        first = layout.pack(vectors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        layout.pack(vectors)
    assert HealthLayout.any_unknown(first[None]) and first[-1] == 1
    assert len(first) == HEAD + 2 + 1 + 1  # a's block and its flag, then the count
