"""The house rule of ARCHITECTURE.md: the core imports no Lightning.

The core is the capture engine, the store (format, writer core, reader, training
reader) and the probe metrics; the Lightning adapter (callback, sinks, FeatureWriter,
ProbeSink, indices, predict_route, datamodule) sits on top of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CORE = [
    "buffer",
    "catcher",
    "checks",
    "compiled",
    "coordinator",
    "errors",
    "export",
    "host_copy",
    "keys",
    "ledger",
    "object_store",
    "pinned_ring",
    "probes",
    "records",
    "remote_shards",
    "row_buffer",
    "row_selection",
    "shard_access",
    "shard_file",
    "shard_headers",
    "shard_writer",
    "spec",
    "store",
    "store_files",
    "store_fs",
    "store_plan",
    "token_rows",
    "training_data",
    "transfer",
]


def test_the_core_imports_no_lightning() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {CORE!r}:\n"
        "    importlib.import_module('lightning_iocatch.' + name)\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "assert not roots & {'lightning', 'pytorch_lightning'}, sorted(roots)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_module_is_either_core_or_adapter() -> None:
    adapter = {"callback", "sinks", "writer", "probe_sink", "indices", "predict_route"}
    adapter |= {"datamodule", "process_group_exit", "cli", "plots", "__init__", "__main__"}
    package = Path(__file__).resolve().parents[1] / "lightning_iocatch"
    modules = {p.stem for p in package.glob("*.py")} | {p.name for p in package.glob("*/")}
    modules -= {"__pycache__"}
    assert modules == set(CORE) | adapter, "classify the new module in tests/test_architecture.py"
