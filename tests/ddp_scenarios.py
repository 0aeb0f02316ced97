"""Several tests' 2-process DDP runs in one launch: the same two processes and gloo group run
each test module's ``main(out)`` in turn, each in a folder of its own.

Every launch of a 2-process CPU run costs two interpreters importing Lightning (about 3 s of
CPU each here), a gloo rendezvous and a teardown; one launch for all of them is most of what
those tests cost in ``make test``. A test asks for its results with :func:`ranks_of`; the
launch happens once per test session, whichever pytest-xdist worker asks first (the other
waits on a lock and reads the same results).

    python tests/scripts/ddp_scenarios.py OUT   # what the fixture runs; rank 1 is Lightning's

Each scenario starts from the random state every test starts from (tests/conftest.py), and
its processes write ``OUT/<scenario>/...``. A scenario that fails fails the launch, and with
it every test that reads it, with the scenario's name and the processes' last output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# In the order run. ddp_warnings first: Lightning gives some warnings once a process (its
# WarningCache), and that test needs to see them; one that patches something process-wide
# goes last.
SCENARIOS = {
    "ddp_warnings": "tests.lightning.test_ddp_warnings",
    "ddp_capture": "tests.scripts.ddp_capture",
    "dump_tokens": "tests.scripts.dump_tokens",
    "probe_ddp": "tests.lightning.test_probe_ddp",
    "probe_tokens": "tests.lightning.test_probe_tokens",
    "unit_probe": "tests.lightning.test_unit_probe",
    "attribution_patching": "tests.lightning.test_attribution_patching",
    "effects": "tests.lightning.test_effects",
    "health_training": "tests.lightning.test_health_training",
    "health_layout": "tests.lightning.test_health_layout",
    "training_layout": "tests.store.test_training_layout",
    "sae_distributed": "tests.scripts.sae_distributed",
    "live_distributed": "tests.scripts.live_distributed",
}
TIMEOUT = 900
DONE, FAILED = "done", "failed.txt"


def launch(out: Path) -> None:
    """Run every scenario in one 2-process launch (its own session, killed whole past
    ``TIMEOUT``); leave ``out/done`` or ``out/failed.txt`` with the output."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/scripts/ddp_scenarios.py"), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the relaunched rank 1 included
    )
    start = time.monotonic()
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\nthe launch hung: killed after {TIMEOUT} s"
    if process.returncode == 0:
        (out / DONE).write_text(f"{time.monotonic() - start:.1f} s\n")
    else:
        (out / FAILED).write_text(output[-6000:])


def ranks_of(out: Path, scenario: str) -> Path:
    """The folder of ``scenario``'s results; fails the calling test if the launch failed."""
    import pytest

    if (out / FAILED).exists():
        pytest.fail(f"the 2-process launch failed:\n{(out / FAILED).read_text()}")
    return out / scenario
