"""Two gloo processes of a test script, without Lightning: started with the environment
``torch.distributed.init_process_group`` reads, both killed past a deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

WORLD = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_pair(script: Path, out: Path, timeout: float = 300) -> None:
    """Run ``python script out`` as ranks 0 and 1 of a gloo group; fail with both logs
    unless both exit 0 within ``timeout`` seconds."""
    root = Path(__file__).resolve().parents[1]
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = []
    with ExitStack() as stack:
        for rank in range(WORLD):
            log = stack.enter_context(open(out / f"rank{rank}.log", "wb"))
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}  # fmt: skip
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(out)],
                    cwd=root,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout
        try:
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    codes = [process.returncode for process in processes]
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert codes == [0] * WORLD, f"return codes {codes}:\n{logs}"
