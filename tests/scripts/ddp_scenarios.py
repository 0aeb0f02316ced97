"""Run by tests/ddp_scenarios.py: every scenario's ``main(out)`` in turn, in these two
processes (rank 1 is Lightning's relaunch of this script)::

    python tests/scripts/ddp_scenarios.py OUT
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import numpy as np
import torch

from tests.ddp_scenarios import SCENARIOS


def main(out: Path) -> None:
    for name, module in SCENARIOS.items():
        print(f"scenario {name}", file=sys.stderr, flush=True)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        importlib.import_module(module).main(folder)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
