"""Tiny named models shared by the tests, running a script in its own process, and moto's S3
server on 127.0.0.1 (started once; tests that use it skip where it cannot start)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.s3_server import S3Server, s3_available


def _threads_per_test_process() -> None:
    """Under ``pytest -n N`` each worker gets its share of the cores, for torch here and
    (through ``OMP_NUM_THREADS``) for every process a test starts. With torch's default of
    one OpenMP thread per core in each of two workers on two cores, the spinning threads
    made every computation several times slower (a GPT-2 training step 1.6 s instead of
    0.07 s) and the whole suite with it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_threads_per_test_process()

# Modules are compiled to bytecode once, when first imported, and cached, in this process
# and every process a test starts: `make venv` installs without compiling them, and an
# environment asking Python not to write bytecode would recompile torch and Lightning in
# each of them (the machine this suite was written on sets PYTHONDONTWRITEBYTECODE=1).
sys.dont_write_bytecode = False
os.environ["PYTHONDONTWRITEBYTECODE"] = ""

_SEED = 0


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same random state (torch, NumPy's global one, Python's
    ``random``), so a test that draws numbers without a generator of its own gives the same
    result in any order and under ``-n``: CI does not go red by luck. A test should still
    pass for its data, not for this seed."""
    random.seed(_SEED)
    np.random.seed(_SEED)
    torch.manual_seed(_SEED)


@pytest.fixture(autouse=True)
def _ctrl_c_as_python_has_it() -> Iterator[None]:
    """Every test starts with Python's own Ctrl-C handler, and a test that leaves another
    (Lightning ignores SIGINT once it has handled a KeyboardInterrupt) is named and undone:
    a test that presses Ctrl-C failed once, in one worker of one run, with its signal
    ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not SIG_IGN, e.g. under `&`
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"the test left SIGINT's handler {left!r}; put back", stacklevel=1)


class RowLinear(nn.Linear):
    """``nn.Linear`` whose output row for a sample does not depend on the rest of its batch.

    On CPUs with AVX-512, MKL's matrix product rounds differently for different batch
    sizes (rows of a batch of 5 differ from the same rows in a batch of 20 by ~1e-7), which
    would make a dump of batches of 5 unequal to a truth computed in one batch. These tests
    check which rows are captured and stored, not MKL: each row is a reduction of its own.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x.unsqueeze(-1) * self.weight.t()).sum(-2)
        return out + self.bias if self.bias is not None else out


class Counter(nn.Module):
    """Identity that counts its calls: shows which modules a forward actually ran."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


class Blocks(nn.Module):
    """``layers.{i}`` Linear+ReLU blocks followed by a counting ``tail``; ``model.layers.i``."""

    def __init__(self, width: int = 8, depth: int = 4, inplace: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(RowLinear(width, width), nn.ReLU(inplace=inplace)) for _ in range(depth)
        )
        self.tail = Counter()

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * scale
        return self.tail(x)


@pytest.fixture
def blocks() -> Blocks:
    torch.manual_seed(0)
    return Blocks()


def hook_count(model: nn.Module) -> int:
    """Forward hooks and pre-hooks registered anywhere in ``model``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


ROOT = Path(__file__).resolve().parents[1]


def run_script(script: Path | str, *args: str, timeout: float = 300) -> None:
    """Run ``python script args...`` from the project root (importable as ``tests.``); fail
    the test with the script's stderr if it fails."""
    result = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def start_script(script: Path | str, *args: str) -> subprocess.Popen[str]:
    """Start ``python script args...`` as :func:`run_script` does, without waiting, in a
    session of its own (a script that SIGKILLs its process group kills only itself); its
    stderr is kept for the test to read."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="session")
def server() -> Iterator[S3Server]:
    reason = s3_available()
    if reason is not None:
        pytest.skip(reason)
    try:
        running = S3Server().start()
    except Exception as error:  # any failure to start is a reason to skip, not to fail
        pytest.skip(f"the local S3 server cannot start: {type(error).__name__}: {error}")
    yield running
    running.stop()


@pytest.fixture
def bucket(server: S3Server) -> str:
    name = f"iocatch-{uuid.uuid4().hex[:12]}"
    server.make_bucket(name)
    return name


@pytest.fixture
def url() -> Iterator[str]:
    """A fresh store URL on ``memory://``, its prefix removed afterwards."""
    import fsspec

    prefix = f"iocatch-tests/{uuid.uuid4().hex}"
    yield f"memory://{prefix}/run"
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


@pytest.fixture(scope="session")
def ddp_scenarios(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The folder of the one 2-process launch of tests/ddp_scenarios.py, shared by every
    pytest-xdist worker of the session: the first to ask launches it, under a lock the
    others wait on."""
    from filelock import FileLock

    from tests.ddp_scenarios import DONE, FAILED, launch

    shared = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # a pytest-xdist worker: its base folder
        shared = shared.parent  # lies in the session's
    out = shared / "ddp-scenarios"
    with FileLock(str(shared / "ddp-scenarios.lock")):
        if not (out / DONE).exists() and not (out / FAILED).exists():
            out.mkdir(exist_ok=True)
            launch(out)
    return out
