"""Fixtures of the store's tests: moto's S3 server on 127.0.0.1, started once, with a fresh
bucket per test. Tests that use them skip when moto's server or s3fs is missing or the
server cannot start."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.s3_server import S3Server, s3_available


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
