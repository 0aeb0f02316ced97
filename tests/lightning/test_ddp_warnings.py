"""Under 2-process DDP the library's logging and gathers warn about nothing of their own.

Two warnings used to come out of every multi-process run: Lightning's
``PossibleUserWarning`` "It is recommended to use `self.log(..., sync_dist=True)`", one for
each value the probes and ``InterventionEffects`` log (values already the same on every
process), and torch's ``FutureWarning`` about ``torch.distributed.nn.functional.all_gather``,
which Lightning's ``strategy.all_gather`` calls (``InterventionEffects``,
``ActivationMonitor``). One launch validates with the probes and the effects, then fits one
step with the monitor, each process recording every warning; the values each process logs
are those the library computed, and those of the same runs on one device. The model's own
``val_loss`` (logged without ``sync_dist``) still gets its warning.

    python tests/lightning/test_ddp_warnings.py OUT_DIR
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_iocatch import ActivationMonitor, IOCaptureCallback
from lightning_iocatch.capture import Zero
from lightning_iocatch.lightning.effects import InterventionEffects
from lightning_iocatch.probes import ActivationStats
from tests.ddp_scenarios import ranks_of
from tests.lightning.test_probe_ddp import read_ranks, same
from tests.lightning_models import TinyModule, loader, trainer

SPEC = "outputs[model.layers.*]"
SYNC_DIST = "It is recommended to use `self.log("
GATHER = "torch.distributed.nn.functional.all_gather is deprecated"


def squared_error(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """One loss term a sample."""
    return (output.squeeze(-1) - batch[1]).double().pow(2)


def run(devices: int) -> dict[str, dict[str, float]]:
    """The values the library computed and those Lightning holds as logged, of a validate
    with the probes and the effects, and the monitor's of a 1-step fit (without a
    distributed sampler every process's step takes samples 0-3: the statistics merged
    over 2 processes are those of one)."""
    parallel: dict[str, Any] = {"devices": devices, "strategy": "ddp" if devices > 1 else "auto"}
    torch.manual_seed(0)
    probes = IOCaptureCallback(SPEC, probes=[ActivationStats()])
    effects = InterventionEffects({"zero": [Zero("model.layers.1")]}, loss=squared_error)
    validate = trainer([probes, effects], **parallel)
    validate.validate(TinyModule(), loader(16, 4, seed=7), verbose=False)
    assert probes.probes is not None
    monitor = ActivationMonitor(SPEC, every_n_steps=1, tokens=None)
    fit = trainer([monitor], max_steps=1, use_distributed_sampler=False, **parallel)
    torch.manual_seed(1)
    fit.fit(TinyModule(), loader(16, 4, seed=3))
    return {
        "computed": {**probes.probes.last_values, **effects.last_values},
        "logged": {name: float(value) for name, value in validate.callback_metrics.items()},
        "monitor": dict(monitor.last_values),
    }


def main(out: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result: dict[str, Any] = run(devices=2)
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


@pytest.mark.slow
def test_no_warning_of_the_library_and_the_logged_values_kept(ddp_scenarios: Path) -> None:
    ranks = read_ranks(ranks_of(ddp_scenarios, "ddp_warnings"))
    single = run(devices=1)

    computed = single["computed"]
    assert len(computed) == 3 * 6 + 3  # 3 layers x 6 statistics; clean, zero loss, zero kl
    for rank, found in enumerate(ranks):
        caught = found["warnings"]
        assert not [w for w in caught if GATHER in w], rank
        ours = [w for w in caught if SYNC_DIST in w and "'val_loss'" not in w]
        assert not ours, (rank, ours)
        # each value as logged on each process is the one the library computed there,
        # rounded to the dtype Lightning keeps it in (float32 for a Python float)
        logged = found["logged"]
        for name, value in found["computed"].items():
            kept = value if name.startswith("effects/") else float(torch.tensor(value).float())
            assert logged[name] == kept, (rank, name)
        for part in ("computed", "monitor"):
            expected = single[part]
            assert found[part].keys() == expected.keys(), (rank, part)
            wrong = {k: (found[part][k], v) for k, v in expected.items()}
            assert not {k: v for k, v in wrong.items() if not same(*v)}, (rank, part, wrong)
    # the user's own warning is left alone: only the library's values are exempt
    assert any(SYNC_DIST + "'val_loss'" in w for w in ranks[0]["warnings"])
