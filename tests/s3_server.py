"""A real S3-protocol server on the loopback address for the tests and benchmarks/s3.py.

moto's S3 server (the one s3fs's own test suite runs), started in a thread of this process
on ``127.0.0.1`` and a free port, with every request it answers logged (method, path,
query, range), so that a test can count requests. Other processes (a SIGKILLed dump, DDP
ranks) reach it over the loopback address with :meth:`S3Server.storage_options`.

    with S3Server() as server:
        server.make_bucket("bucket")
        FeatureWriter("s3://bucket/run", storage_options=server.storage_options())
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Request", "S3Server", "s3_available"]


def s3_available() -> str | None:
    """``None`` when moto's server and s3fs can be imported, else why not."""
    try:
        import moto.moto_server.werkzeug_app  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as error:
        return f"moto[server] and s3fs are needed ({error}): pip install -e '.[test]'"
    return None


@dataclass(frozen=True)
class Request:
    """One request the server answered."""

    method: str
    path: str
    query: str
    range: str | None


class S3Server:
    """moto's S3 server on ``127.0.0.1`` (a free port) in a daemon thread, with a request log.

    Credentials are not checked unless :meth:`deny_unknown_credentials` is on.
    """

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        app = DomainDispatcherApplication(create_backend_app)

        def logged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            request = Request(
                environ["REQUEST_METHOD"],
                environ.get("PATH_INFO", ""),
                environ.get("QUERY_STRING", ""),
                environ.get("HTTP_RANGE"),
            )
            with self._lock:
                self.requests.append(request)
            return app(environ, start_response)  # type: ignore[no-any-return]

        self._server = make_server(
            "127.0.0.1", 0, logged, threaded=True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def storage_options(self, key: str = "testing", secret: str = "testing") -> dict[str, Any]:
        """s3fs options that reach this server (fresh instances: no cache across tests)."""
        return {
            "endpoint_url": self.endpoint,
            "key": key,
            "secret": secret,
            "client_kwargs": {"region_name": "eu-west-1"},
            "skip_instance_cache": True,
        }

    def make_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(**self.storage_options()).mkdir(name)

    def taken(self) -> list[Request]:
        """The requests answered since the last call (and forget them)."""
        with self._lock:
            taken, self.requests = self.requests, []
        return taken

    @staticmethod
    def deny_unknown_credentials(deny: bool) -> None:
        """Make moto check credentials (unknown keys get 403) or accept any (the default)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        ActionAuthenticatorMixin.request_count = 0
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0 if deny else float("inf")
