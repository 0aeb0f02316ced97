"""The documentation site builds strictly and documents every public name.

`mkdocs build --strict` fails on a broken link, a page missing from the navigation or a
docstring mkdocstrings cannot read; this test also fails when a public name (in the
``__all__`` of the package or of a public subpackage) has no docstring of its own or does
not appear in the API reference.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "lightning_iocatch.capture",
    "lightning_iocatch.store",
    "lightning_iocatch.lightning",
    "lightning_iocatch.probes",
    "lightning_iocatch.reports",
    "lightning_iocatch.errors",
]


def public_names() -> dict[str, object]:
    """``package.name`` -> object, for every name a public package exports."""
    found = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", []):
            found[f"{package}.{name}"] = getattr(module, name)
    return found


def test_every_public_name_has_a_docstring_of_its_own() -> None:
    undocumented = []
    for name, value in public_names().items():
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue  # constants and type aliases are described by their module
        if not (value.__doc__ or "").strip() or (
            inspect.isclass(value) and value.__doc__ == value.__mro__[1].__doc__
        ):
            undocumented.append(name)
    assert not undocumented, f"public names without a docstring: {undocumented}"


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_public_name_in_the_api_reference(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    html = "".join(page.read_text() for page in (site / "api").rglob("index.html"))
    missing = [name for name in public_names() if f'id="{name}"' not in html]
    assert not missing, f"public names missing from the API reference: {missing}"
