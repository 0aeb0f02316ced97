"""Edits whose functions a store must record the same in every process and run.

Imported by tests/capture/test_edits_described.py, and run in fresh interpreters (other
hash seeds) by it: ``python -c "from tests.scripts.described_edits import main; main()"``
prints their descriptions as JSON.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import nn

from lightning_iocatch.capture import Replace

SCALE = torch.arange(4, dtype=torch.float32)
NAMES = frozenset({"a", "b", "c"})


def helper(h: torch.Tensor, kind: str = "a") -> torch.Tensor:
    return h * 2.0 if kind in {"a", "b", "c"} else h  # a frozenset constant


def edits() -> list[Any]:
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    return [
        Replace("0", lambda h: helper(h) * SCALE),
        Replace("0", functools.partial(helper, kind="b")),
        Replace("0", module.forward, baseline=module),
        Replace("0", lambda h: h if "a" in NAMES else -h),
    ]


def main() -> None:
    print(json.dumps([edit.describe() for edit in edits()]))
