"""What a store records of an edit: a function by what it computes, a tensor by its bytes.

Before, a function was recorded by its name only: two lambdas, two partials of one function,
two closures over other values were recorded alike, so a resume under the other was
accepted. The truth for tensors is a digest of their bytes taken here with hashlib.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_iocatch.capture.edits import Mean, Patch, PatchWithin, Replace, Steer, Zero
from tests.scripts import described_edits

ROOT = Path(__file__).resolve().parents[2]
OFFSET = torch.zeros(3)


def recorded(function: Any) -> Any:
    return Replace("m", function).describe()["function"]


def closure(factor: float) -> Any:
    return lambda h: h * factor


def with_default(factor: float) -> Any:
    def scaled(h: torch.Tensor, factor: float = factor) -> torch.Tensor:
        return h * factor

    return scaled


def shifted(h: torch.Tensor) -> torch.Tensor:
    return h + OFFSET


def twice(h: torch.Tensor) -> torch.Tensor:
    return shifted(shifted(h))  # a function of our own it calls: described too


def test_functions_that_compute_differently_are_recorded_differently() -> None:
    global OFFSET
    assert recorded(lambda h: h * 2) != recorded(lambda h: h * 3)
    assert recorded(functools.partial(torch.mul, other=2.0)) != recorded(
        functools.partial(torch.mul, other=3.0)
    )
    assert recorded(closure(2.0)) != recorded(closure(3.0))
    assert recorded(with_default(2.0)) != recorded(with_default(3.0))
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    assert recorded(first.forward) != recorded(second.forward)
    before, calls = recorded(shifted), recorded(twice)
    saved, OFFSET = OFFSET, torch.ones(3)  # a global tensor the function reads
    try:
        assert recorded(shifted) != before and recorded(twice) != calls
    finally:
        OFFSET = saved
    assert recorded(shifted) == before


def test_the_same_function_written_again_is_recorded_alike() -> None:
    one = recorded(lambda h: h * 2)

    assert recorded(lambda h: h * 2) == one  # another line, another object: the same
    assert recorded(closure(2.0)) == recorded(closure(2.0))
    assert recorded(functools.partial(torch.mul, other=2.0)) == recorded(
        functools.partial(torch.mul, other=2.0)
    )
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.load_state_dict(first.state_dict())
    assert recorded(first.forward) == recorded(second.forward)
    assert json.loads(json.dumps(one)) == one  # what a store reads back


def test_a_record_is_the_same_in_other_processes_with_other_hash_seeds() -> None:
    here = [edit.describe() for edit in described_edits.edits()]
    code = "from tests.scripts.described_edits import main; main()"
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # another than ours
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == here
    assert len({json.dumps(record) for record in here}) == len(here)


def blake2b(tensor: torch.Tensor) -> dict[str, Any]:
    digest = hashlib.blake2b(tensor.numpy().tobytes(), digest_size=16).hexdigest()
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype)[6:], "blake2b": digest}


@pytest.mark.parametrize("kind", ["Zero", "Mean", "Steer", "Patch", "PatchWithin"])
def test_edits_without_functions_are_recorded_as_they_were(kind: str) -> None:
    vector, mask = torch.randn(4), torch.tensor([True, False])
    where = {"kind": "outputs", "call": None, "argument": None, "positions": None}
    made: dict[str, tuple[Any, dict[str, Any]]] = {
        "Zero": (Zero("m"), {}),
        "Mean": (Mean("m", vector, positions=mask), {"mean": blake2b(vector)}),
        "Steer": (Steer("m", vector, alpha=0.5), {"vector": blake2b(vector), "alpha": 0.5}),
        "Patch": (Patch("m", vector), {"source": blake2b(vector)}),
        "PatchWithin": (PatchWithin("m", [1, 0]), {"pairing": blake2b(torch.tensor([1, 0]))}),
    }
    edit, own = made[kind]
    if kind == "Mean":
        where = {**where, "positions": blake2b(mask)}
    assert edit.describe() == {"edit": kind, "module": "m", **where, **own}
