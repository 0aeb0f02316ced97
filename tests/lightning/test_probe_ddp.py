"""Probes under 2-process DDP equal the 1-process run, whatever each process captures.

The cases run in the shared 2-process launch (tests/ddp_scenarios.py runs `main`) and, for the
reference, in the test process on one device:

- ``even``: 48 samples, 3 layers, every probe (the data divides evenly);
- ``uneven``: 41 samples in batches of 3: the sampler pads the second process's last
  batch with a repeat of sample 0; ``LinearProbe``'s ``max_holdout`` is reached;
- ``routed``: batches of one sample, each routed by its data: sample 3 goes through
  ``expert`` twice (``expert/outputs@1``) and sample 4 through ``rare``, so each process
  captures keys the other never does; the second process's last batch is padding only;
- ``padding_only``: 1 sample: the second process sees nothing but padding;
- ``no_batch``: an iterable dataset that gives the second process no batch at all.

    python tests/lightning/test_probe_ddp.py OUT_DIR

Each rank writes ``OUT_DIR/rank{r}.json``: every case's logged values, and the
dataset indices that rank validated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_iocatch import IOCaptureCallback
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe
from lightning_iocatch.probes.linear import _unit_hash
from tests.ddp_scenarios import ranks_of
from tests.lightning_models import TinyModule, loader

ROOT = Path(__file__).resolve().parents[2]
RARE, TWICE = 4, 3  # dataset indices of the routed case that take the rare paths


class Routed(pl.LightningModule):
    """``trunk`` for every sample; ``expert`` for route 1, twice for route 2; ``rare`` for 3.

    Batches are ``(x, y, route, index)``; :attr:`seen` keeps the indices validated.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6))
        self.expert = nn.Linear(6, 6)
        self.rare = nn.Linear(6, 6)
        self.seen: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _, route, index = batch
        self.seen += [int(i) for i in index]
        h = self.trunk(x)
        for value, module, calls in ((1, self.expert, 1), (2, self.expert, 2), (3, self.rare, 1)):
            rows = route == value
            if bool(rows.any()):
                picked = h[rows]
                for _ in range(calls):
                    picked = module(picked)
                h = h.index_put((rows,), picked)


def routed_data(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, generator=generator)
    y = x[:, 0] - 2 * x[:, 1] + 0.1 * torch.randn(n, generator=generator)
    route = torch.zeros(n, dtype=torch.long)
    route[[i for i in (0, 1) if i < n]] = 1  # sample 0 is also the padding of process 1
    if n > max(RARE, TWICE):
        route[TWICE], route[RARE] = 2, 3
    return TensorDataset(x, y, route, torch.arange(n))


class FirstRankOnly(IterableDataset):
    """Every sample on process 0 (or alone), none on the others."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
            return iter(())
        return (self.data[i] for i in range(len(self.data)))


def regression_target(batch: Any) -> torch.Tensor:
    return batch[1]


def probes(max_holdout: int = 10_000) -> list[Any]:
    return [
        ActivationStats(),
        LinearProbe(regression_target, task="regression", holdout=0.3, max_holdout=max_holdout),
        LayerCKA(),
    ]


def validate(
    module: pl.LightningModule, data: Any, spec: str, probe_list: list[Any], devices: int
) -> dict[str, float]:
    callback = IOCaptureCallback(spec, probes=probe_list)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.validate(module, data, verbose=False)
    assert callback.probes is not None
    return dict(callback.probes.last_values)


ROUTED_SPEC = "outputs[trunk.0|trunk.2|expert|rare]"


def run_cases(devices: int) -> dict[str, Any]:
    """Every case's logged values, and the indices each case's module validated."""
    values, seen = {}, {}
    torch.manual_seed(0)
    tiny = TinyModule()
    classify = LinearProbe(lambda b: (b[1] > 0).long(), num_classes=2, holdout=0.3)
    values["even"] = validate(
        tiny,
        loader(48, 8, seed=7),
        "outputs[model.layers.*]",
        [ActivationStats(), classify, LayerCKA()],
        devices,
    )
    cases = {
        "uneven": (routed_data(41), 3, probes(max_holdout=4)),
        "routed": (routed_data(9), 1, probes(max_holdout=2)),
        "padding_only": (routed_data(1), 1, probes()),
        "no_batch": (FirstRankOnly(routed_data(5)), 2, probes(max_holdout=1)),
    }
    for name, (data, batch_size, probe_list) in cases.items():
        module = Routed()
        loader_ = DataLoader(data, batch_size=batch_size)
        values[name] = validate(module, loader_, ROUTED_SPEC, probe_list, devices)
        seen[name] = module.seen
    return {"values": values, "seen": seen}


def read_ranks(out: Path) -> list[dict[str, Any]]:
    """What each process of a 2-process run wrote to ``out/rank{r}.json``."""
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def same(value: float, expected: float) -> bool:
    if math.isnan(expected):
        return math.isnan(value)
    return value == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LinearProbe. no training or held-out samples")
def test_two_processes_log_the_one_process_values(ddp_scenarios: Path) -> None:

    ranks = read_ranks(ranks_of(ddp_scenarios, "probe_ddp"))
    single = run_cases(devices=1)

    # the premises: uneven shards with padding, keys only one process captures
    routed = [set(rank["seen"]["routed"]) for rank in ranks]
    assert TWICE in routed[1] - routed[0] and RARE in routed[0] - routed[1]
    assert ranks[1]["seen"]["routed"][-1] == 0  # padding: a repeat of sample 0
    assert ranks[1]["seen"]["padding_only"] == [0] and ranks[1]["seen"]["no_batch"] == []
    assert sum(_unit_hash(i) < 0.3 for i in range(41)) > 4  # max_holdout=4 is reached

    expected = single["values"]
    assert len(expected["even"]) == 3 * 7 + 3  # 3 layers x (6 stats + probe_acc) + 3 pairs
    routed_keys = {name.rsplit("/", 1)[0] for name in expected["routed"]}
    assert {"iocatch/expert/outputs@1", "iocatch/rare/outputs"} <= routed_keys
    assert "iocatch/cka/trunk.0/outputs~trunk.2/outputs" in expected["routed"]
    assert not any("expert" in name for name in expected["routed"] if "cka" in name)
    assert "iocatch/cka/trunk.0/outputs~trunk.2/outputs" in expected["uneven"]
    for rank, logged in enumerate(ranks):
        for case, values in expected.items():
            got = logged["values"][case]
            assert got.keys() == values.keys(), (rank, case)
            wrong = {name: (got[name], value) for name, value in values.items()}
            wrong = {k: v for k, v in wrong.items() if not same(*v)}
            assert not wrong, (rank, case, wrong)


def main(out: Path) -> None:
    """One process of the 2-process run (tests/ddp_scenarios.py)."""
    result = run_cases(devices=2)
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
