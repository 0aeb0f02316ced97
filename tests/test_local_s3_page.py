"""docs/local-s3.md as a user runs it: `moto_server` started as a process of its own, no
bucket made beforehand, the page's block run against it; the rows read back equal the
layer's output computed by hand."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.s3_server import s3_available

PAGE = Path(__file__).resolve().parents[1] / "docs" / "local-s3.md"
MOTO = Path(sys.executable).parent / "moto_server"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def moto_server() -> Iterator[int]:
    """`moto_server -H 127.0.0.1 -p PORT` as the page starts it; its port."""
    reason = s3_available() or (None if MOTO.exists() else f"no {MOTO}")
    if reason is not None:
        pytest.skip(reason)
    port = free_port()
    process = subprocess.Popen(
        [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start on port {port}")
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_the_recipe_dumps_to_a_local_server_and_reads_the_rows_back(
    moto_server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert code.count("127.0.0.1:9000") == 1
    monkeypatch.chdir(tmp_path)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)  # the page's own credentials only
    names: dict = {}
    exec(compile(code.replace(":9000", f":{moto_server}"), str(PAGE), "exec"), names)
    store = names["store"]
    with torch.no_grad():
        expected = names["data"] @ names["net"].layer.weight.T + names["net"].layer.bias
    assert torch.equal(store.indices, torch.arange(10))
    torch.testing.assert_close(store["layer/outputs"], expected)
