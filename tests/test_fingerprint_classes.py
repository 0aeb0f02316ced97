"""``fingerprint.py`` on classes of your own: what their code and data compute is recorded.

Before, a class of your own was described by its methods' code only: a class attribute,
a property, the helper a method calls, a callable dataclass's code, a non-persistent
buffer and a plain tensor attribute of a module were not seen, so two versions of a user
file that compute differently got the same record and a resume mixed their rows. The
ground truth is what each version computes on ``torch.ones(2)``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest
import torch
from torch import nn

from lightning_iocatch.fingerprint import describe_function
from tests.scripts import described_classes

ROOT = Path(__file__).resolve().parents[1]
LOG = logging.getLogger("tests.fingerprint_classes")
T = TypeVar("T")


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    described_classes.write(first, 0)
    described_classes.write(second, 1)
    return first, second


@pytest.mark.parametrize("case", sorted(described_classes.CASES))
def test_versions_that_compute_differently_are_recorded_differently(
    versions: tuple[Path, Path], case: str
) -> None:
    (record, output), (other, other_output) = (
        described_classes.records(directory)[case] for directory in versions
    )
    assert output != other_output  # they compute differently
    assert "blake2b" in record and "blake2b" in other
    assert record["function"] == other["function"]  # under the same name
    assert record != other


def test_each_version_is_recorded_alike_in_another_process(versions: tuple[Path, Path]) -> None:
    here = [described_classes.records(directory) for directory in versions]
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # another than ours
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-m", "tests.scripts.described_classes", *map(str, versions)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert json.loads(done.stdout) == json.loads(json.dumps(here))


def defined(source: str) -> dict[str, Any]:
    """Code run by ``exec`` (a notebook cell, say): its classes' module is ``builtins``."""
    namespace: dict[str, Any] = {"nn": nn, "dataclasses": dataclasses}
    exec(source, namespace)
    return namespace


def test_classes_defined_by_exec_are_described_by_their_code() -> None:
    two, three = (
        defined(f"class C:\n    k = {k}\ndef f(h):\n    return h * C.k\n") for k in (2, 3)
    )
    assert two["C"].__module__ == "builtins"
    assert describe_function(two["f"]) != describe_function(three["f"])


class Base(abc.ABC, Generic[T]):
    """An abstract generic base: its machinery (``_abc_impl``...) is no computation."""

    @abc.abstractmethod
    def scale(self) -> float: ...


class Kind(enum.Enum):
    DOUBLE = 2.0
    TRIPLE = 3.0


@dataclasses.dataclass
class Scaler(Base[float]):
    kind: Kind = Kind.DOUBLE
    names: list[str] = dataclasses.field(default_factory=list)

    def scale(self) -> float:
        return float(self.kind.value)

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale()


class Logged(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        LOG.info("forward")  # a global logger read by a method: as by a function
        return h


def test_common_classes_stay_decidable_and_alike_and_a_method_is_read_as_a_function() -> None:
    record = describe_function(Scaler())
    assert "blake2b" in record and record == describe_function(Scaler())
    assert record != describe_function(Scaler(Kind.TRIPLE))
    assert "Logger" in describe_function(Logged())["undecidable"]
    linear = nn.Linear(2, 2)
    assert "blake2b" in describe_function(linear)  # a library's class: by name and version
