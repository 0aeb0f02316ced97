"""Functions of classes of your own, written as two versions of one user file.

Each case is a source with one place that differs between its two versions, so the two
versions compute differently (``FN(torch.ones(2))`` is the ground truth) under the same
module and function names, as a resume in another process sees them. Imported by
tests/test_fingerprint_classes.py, and run in a fresh interpreter (another hash seed) by
it: ``python -m tests.scripts.described_classes DIR...`` prints, for each directory the
versions were written to, each case's record and output as JSON.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_iocatch.fingerprint import describe_function

CASES = {  # case: (source, first, second)
    "class_attribute": (
        "class C:\n    k = {}\n\n\ndef f(h):\n    return h * C.k\n\n\nFN = f\n",
        "2.0",
        "3.0",
    ),
    "dataclass_call": (
        "import dataclasses\n\n\n@dataclasses.dataclass\nclass S:\n    k: float = 2.0\n\n"
        "    def __call__(self, h):\n        return h * {}\n\n\nFN = S()\n",
        "self.k",
        "(self.k + 1)",
    ),
    "module_helper": (
        "from torch import nn\n\n\ndef helper(h):\n    return h * {}\n\n\n"
        "class M(nn.Module):\n    def forward(self, h):\n        return helper(h)\n\n\nFN = M()\n",
        "2",
        "3",
    ),
    "property": (
        "from torch import nn\n\n\nclass M(nn.Module):\n    @property\n    def k(self):\n"
        "        return {}\n\n    def forward(self, h):\n        return h * self.k\n\n\nFN = M()\n",
        "2.0",
        "3.0",
    ),
    "nonpersistent_buffer": (  # as Hugging Face's rotary inv_freq
        "import torch\nfrom torch import nn\n\n\nclass Rotary(nn.Module):\n"
        "    def __init__(self, k):\n        super().__init__()\n"
        "        self.register_buffer('inv_freq', torch.tensor(k), persistent=False)\n\n"
        "    def forward(self, h):\n        return h * self.inv_freq\n\n\nFN = Rotary({})\n",
        "2.0",
        "3.0",
    ),
    "tensor_attribute": (
        "import torch\nfrom torch import nn\n\n\nclass Scaled(nn.Module):\n"
        "    def __init__(self, k):\n        super().__init__()\n"
        "        self.scale = torch.tensor(k)\n\n"
        "    def forward(self, h):\n        return h * self.scale\n\n\nFN = Scaled({})\n",
        "2.0",
        "3.0",
    ),
    "decorated_method": (
        "import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n    @torch.no_grad()\n"
        "    def forward(self, h):\n        return h * {}\n\n\nFN = M()\n",
        "2",
        "3",
    ),
}


def write(directory: Path, version: int) -> None:
    """Each case's first (0) or second (1) version, as ``directory/userfn_{case}.py``."""
    directory.mkdir(parents=True, exist_ok=True)
    for case, (source, *versions) in CASES.items():
        (directory / f"userfn_{case}.py").write_text(source.format(versions[version]))


def records(directory: Path) -> dict[str, Any]:
    """Each case's ``[record, output]``, its file imported afresh from ``directory``."""
    found = {}
    sys.path.insert(0, str(directory))
    try:
        for case in CASES:
            name = f"userfn_{case}"
            sys.modules.pop(name, None)
            importlib.invalidate_caches()
            module = importlib.import_module(name)
            found[case] = [describe_function(module.FN), module.FN(torch.ones(2)).tolist()]
            del sys.modules[name]
    finally:
        sys.path.remove(str(directory))
    return found


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    print(json.dumps([records(Path(directory)) for directory in sys.argv[1:]]))
