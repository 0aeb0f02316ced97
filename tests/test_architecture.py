"""The layer rules of docs/architecture.md, at run time.

import-linter checks the static imports in ``make lint`` (the contracts are in
pyproject.toml); these tests check what static imports cannot show: importing every
module of the core, however it imports (lazily included), loads no Lightning, and every
module of the package belongs to a layer.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import lightning_iocatch

ROOT = Path(__file__).resolve().parents[1]
CORE = [
    "capture",
    "store",
    "probes",
    "sae",
    "plots",
    "reports",
    "errors",
    "checks",
    "suggest",
    "fingerprint",
    "fingerprint_values",
    "token_mask",
]
ON_TOP = ["lightning", "cli", "__main__"]


def modules_of(names: list[str]) -> list[str]:
    """Every module of ``lightning_iocatch.{name}`` for each name, packages walked."""
    found = []
    for name in names:
        module = f"lightning_iocatch.{name}"
        found.append(module)
        path = Path(lightning_iocatch.__file__).parent / name
        if path.is_dir():
            found += [info.name for info in pkgutil.walk_packages([str(path)], module + ".")]
    return found


def test_the_core_imports_no_lightning() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {modules_of(CORE)!r}:\n"
        "    importlib.import_module(name)\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "assert not roots & {'lightning', 'pytorch_lightning'}, sorted(roots)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_module_belongs_to_a_layer() -> None:
    package = Path(lightning_iocatch.__file__).parent
    top = {info.name for info in pkgutil.iter_modules([str(package)])}
    assert top == set(CORE) | set(ON_TOP), "add the new module to a layer of docs/architecture.md"
    assert len(modules_of(CORE)) > 30  # the walk found the packages' modules
