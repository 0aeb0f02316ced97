"""Where a store lives: a local directory, or a prefix on object storage reached by fsspec.

:func:`resolve_location` turns what a user passes (a path, or an fsspec URL with its
``storage_options``) into one of two places, each with its own commit protocol:

- a :class:`~pathlib.Path` for a local directory (a plain path or a ``file://`` URL): the
  POSIX protocol of :mod:`lightning_iocatch.store.names` and :mod:`lightning_iocatch.store.ledger`
  (temporary name, fsync, rename, an appended ledger line), exactly as before URLs existed;
- an :class:`ObjectLocation` for every other fsspec URL (``s3://``, ``gs://``, ``az://``,
  ``memory://``, ...): no rename and no append, the object protocol of
  :mod:`lightning_iocatch.store.backends.objects` (a shard object, then its commit record object).

All remote I/O goes through the fsspec filesystem of the URL; this module only names the
objects and turns the filesystem's errors into one :class:`~lightning_iocatch.StoreError`
that says what to fix. fsspec's asynchronous filesystems (s3fs, gcsfs) cannot be used
after a ``fork``: :attr:`ObjectLocation.fs` makes a new one in each process, and an
``ObjectLocation`` pickles without it (DataLoader workers, DDP ranks).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_iocatch.errors import StoreError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "ObjectLocation",
    "StoreLocation",
    "is_missing_bucket",
    "is_remote_failure",
    "remote_error",
    "remote_request",
    "resolve_location",
]


class ObjectLocation:
    """A store's prefix on an fsspec filesystem without rename or append (object storage).

    Args:
        url: the URL as the user gave it (``s3://bucket/run``), used in every message.
        options: the ``storage_options`` passed to fsspec (credentials, endpoint, ...).
        root: the filesystem path of the prefix (``bucket/run``), without a trailing ``/``.
        fs: the filesystem, if already made (in this process).
    """

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any],
        root: str,
        fs: AbstractFileSystem | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.options = dict(options)
        self.root = root.rstrip("/")
        self._fs = fs
        self._pid = os.getpid()

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem, made anew in a process other than the one that made it."""
        if self._fs is None or self._pid != os.getpid():
            import fsspec.core

            self._fs, _ = fsspec.core.url_to_fs(self.url, **self.options)
            self._pid = os.getpid()
        return self._fs

    def path(self, name: str) -> str:
        """The filesystem path of the store's object ``name`` (``commits/r000-000000.json``)."""
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        """The URL of the store's object ``name``, for messages."""
        return f"{self.url}/{name}"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["options"], state["root"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectLocation) and (self.url, self.options) == (
            other.url,
            other.options,
        )

    def __hash__(self) -> int:
        return hash(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectLocation({self.url!r})"


StoreLocation = Path | ObjectLocation
"""A local directory (POSIX protocol) or a prefix on object storage (object protocol)."""


def resolve_location(
    path: str | os.PathLike[str] | ObjectLocation,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | ObjectLocation:
    """Where a store lives: a local :class:`Path`, or an :class:`ObjectLocation` for a URL.

    ``path`` is a local path, a ``file://`` URL (both local), or any other fsspec URL;
    ``storage_options`` go to fsspec as they are, and are refused for a local path.

    Raises:
        TypeError: ``path`` or ``storage_options`` of the wrong type.
        ValueError: ``storage_options`` given for a local path.
        StoreError: a URL fsspec cannot open (an unknown protocol, a missing package),
            naming the URL and the fix.

    Example:
        >>> resolve_location("features/")
        PosixPath('features')
        >>> resolve_location("memory://bucket/run")
        ObjectLocation('memory://bucket/run')
    """
    if isinstance(path, ObjectLocation):
        return path
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"`path` must be a str or os.PathLike, got {type(path).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"`storage_options` must be a dict of fsspec options or None, got "
            f"{type(storage_options).__name__}"
        )
    text = os.fspath(path)
    if not isinstance(text, str) or "://" not in text:
        _refuse_a_url_with_one_slash(text)
        if storage_options:
            raise ValueError(
                f"`storage_options` apply to fsspec URLs (s3://..., gs://...), but {text!r} is "
                "a local path; drop them, or write the URL"
            )
        return Path(path)
    import fsspec.core
    from fsspec.implementations.local import LocalFileSystem

    options = dict(storage_options or {})
    protocol = text.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except ImportError as error:
        raise StoreError(
            f"cannot open {text}: fsspec needs a package for {protocol}:// ({error}); for "
            "S3, pip install 'lightning-iocatch[s3]'"
        ) from error
    except (ValueError, TypeError) as error:  # TypeError: an option the filesystem refuses
        raise StoreError(f"cannot open {text}: {error}") from error
    if isinstance(fs, LocalFileSystem):
        if options:
            raise ValueError(
                f"`storage_options` do not apply to the local path {text!r}; drop them"
            )
        return Path(root)
    parts = root.strip("/").split("/")
    if not parts[0]:
        raise StoreError(
            f"{text} names no bucket; write {protocol}://BUCKET/PREFIX, e.g. "
            f"{protocol}://my-bucket/features"
        )
    if len(parts) == 1:
        raise StoreError(
            f"{text} names a bucket but no prefix inside it; a store needs a prefix of its "
            f"own (resume and overwrite list all of it), e.g. {text.rstrip('/')}/features"
        )
    return ObjectLocation(text, options, root, fs)


def _refuse_a_url_with_one_slash(text: str) -> None:
    """``s3:/bucket/run`` is a mistyped URL, not a local directory named ``s3:``."""
    protocol, colon, rest = text.partition(":")
    if colon and len(protocol) > 1 and rest.startswith("/") and protocol.isidentifier():
        import fsspec

        if protocol in fsspec.available_protocols() and protocol not in ("file", "local"):
            raise StoreError(
                f"{text!r} is neither a local path nor a URL; did you mean "
                f"{protocol}://{rest.lstrip('/')}?"
            )


_CLIENT_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "azure")


def is_remote_failure(error: BaseException) -> bool:
    """True for what a failed request to object storage raises: an ``OSError`` (s3fs
    translates S3's error codes into them), an exception of the filesystem's client library
    (botocore's ``EndpointConnectionError``, ``NoCredentialsError``, ...), or the
    ``TypeError`` a client raises for a storage option it does not take."""
    if isinstance(error, OSError):
        return True
    if isinstance(error, TypeError):  # only where a client library raised it
        return "unexpected keyword argument" in str(error) and _raised_in_a_client(error)
    return type(error).__module__.split(".")[0] in _CLIENT_PACKAGES


def _raised_in_a_client(error: BaseException) -> bool:
    frame = error.__traceback__
    while frame is not None:
        module = str(frame.tb_frame.f_globals.get("__name__", ""))
        if module.split(".")[0] in _CLIENT_PACKAGES:
            return True
        frame = frame.tb_next
    return False


def is_missing_bucket(error: BaseException) -> bool:
    """True when the client says the bucket does not exist (S3's ``NoSuchBucket``, as s3fs
    passes it on in the error's cause), decided by the error code, never by the message:
    a URL may hold the word "bucket" where the bucket exists and the key does not."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@contextlib.contextmanager
def remote_request(doing: str, where: str) -> Iterator[None]:
    """Turn a failed request in the block into :func:`remote_error`'s one clear error."""
    try:
        yield
    except Exception as error:
        if not is_remote_failure(error):
            raise
        raise remote_error(doing, where, error) from error


def remote_error(doing: str, where: str, error: BaseException) -> StoreError:
    """One clear :class:`StoreError` for a failed request to object storage.

    ``doing`` says what failed (``"read"``, ``"list"``, ``"write"``), ``where`` the URL.
    """
    kind = type(error).__name__
    if isinstance(error, PermissionError):
        return StoreError(
            f"access denied to {where} ({doing}): {error}; check the credentials in "
            "`storage_options` (or the environment the filesystem reads them from) and "
            "their permissions on the bucket"
        )
    if is_missing_bucket(error):
        return StoreError(
            f"cannot {doing} {where}: {error}; create the bucket first, or fix the URL"
        )
    if isinstance(error, TypeError):
        return StoreError(
            f"cannot {doing} {where}: `storage_options` holds an option the filesystem does "
            f"not take ({error}); fix its name (s3fs takes endpoint_url, key, secret, token, "
            "profile, anon, client_kwargs, config_kwargs, ...)"
        )
    if "Credentials" in kind:  # botocore's NoCredentialsError, PartialCredentialsError
        return StoreError(
            f"cannot {doing} {where}: no credentials ({kind}: {error}); pass `key` and "
            "`secret` (or `profile`; `anon: true` for a public bucket) in `storage_options`, "
            "or set them where the filesystem reads them (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, ~/.aws/credentials)"
        )
    if isinstance(error, (ConnectionError, TimeoutError)) or "Connect" in kind or "Timeout" in kind:
        return StoreError(
            f"cannot reach {where} ({doing}): {kind}: {error}; check the URL and "
            "`endpoint_url` in `storage_options`, and that the server is up and reachable "
            "from here"
        )
    return StoreError(f"cannot {doing} {where}: {kind}: {error}")
