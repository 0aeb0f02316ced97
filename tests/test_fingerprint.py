"""``fingerprint.py``: what can and cannot be read from a function, and the user's word."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch

from lightning_iocatch.fingerprint import describe_function, undecidable_functions
from tests.scripts import described_edits


@dataclasses.dataclass
class Config:
    """A config a function reads: its fields describe it."""

    k: int


LOG = logging.getLogger("tests.fingerprint")
TABLE = np.arange(3.0)


def logged(h: torch.Tensor) -> torch.Tensor:
    LOG.info("edited")  # reads a global logger: what it computes cannot be decided
    return h


def looked_up(h: torch.Tensor) -> torch.Tensor:
    return h * float(TABLE.sum())


def countdown(n: int) -> int:
    return n if n <= 0 else countdown(n - 1)  # itself, among the globals it reads


def test_what_cannot_be_read_is_undecidable_and_named() -> None:
    lock = threading.Lock()
    assert describe_function(lambda h: h if lock.locked() else -h)["undecidable"].startswith(
        "a lock"
    )
    assert "Logger" in describe_function(logged)["undecidable"]
    record = {"edits": [{"function": describe_function(logged)}]}
    assert list(undecidable_functions(record)) == [
        f"{__name__}.logged (a Logger object (give it a `__fingerprint__` string))"
    ]
    assert list(undecidable_functions({"f": describe_function(looked_up)})) == []


def test_the_users_fingerprint_is_recorded_instead_and_must_be_a_str() -> None:
    def edit(h: torch.Tensor) -> torch.Tensor:
        return h

    edit.__fingerprint__ = "v1"  # type: ignore[attr-defined]
    assert describe_function(edit) == {
        "function": f"{__name__}.{edit.__qualname__}",
        "fingerprint": "v1",
    }
    edit.__fingerprint__ = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="`__fingerprint__` of .*edit must be a str"):
        describe_function(edit)


def test_globals_arrays_recursion_and_libraries() -> None:
    global TABLE
    before = describe_function(looked_up)
    TABLE = np.arange(4.0)
    try:
        assert describe_function(looked_up) != before
    finally:
        TABLE = np.arange(3.0)
    assert describe_function(looked_up) == before
    assert "blake2b" in describe_function(countdown)  # a cycle ends
    relu = describe_function(torch.nn.functional.relu)  # a library's: by name and version
    assert relu["function"] == "torch.nn.functional.relu" and "blake2b" in relu
    scaled = describe_function(lambda h: h * described_edits.SCALE)  # a module of our own
    saved, described_edits.SCALE = described_edits.SCALE, torch.zeros(4)
    try:
        assert describe_function(lambda h: h * described_edits.SCALE) != scaled
    finally:
        described_edits.SCALE = saved
    two, three = Config(2), Config(3)
    assert describe_function(lambda h: h * two.k) == describe_function(lambda h: h * two.k)
    assert describe_function(lambda h: h * two.k) != describe_function(lambda h: h * three.k)
    tensor = torch.ones(2)
    assert describe_function(tensor.add) != describe_function(torch.zeros(2).add)


def test_modules_by_class_weights_and_plain_attributes() -> None:
    class TopK(torch.nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.k = k
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, h: torch.Tensor) -> Any:
            return (h * self.weight).topk(self.k).values

    assert describe_function(TopK(1)) != describe_function(TopK(2))
    assert describe_function(TopK(1)) == describe_function(TopK(1))
    assert describe_function(TopK(1)) != describe_function(TopK(1).eval())
