"""A prefix on object storage, reached through its URL's fsspec filesystem, the errors of
its requests, and the store's objects there: listed, written and deleted by exact name.

:class:`ObjectLocation` names the objects of a store's prefix and makes the filesystem
(a new one in each process: fsspec's asynchronous filesystems, s3fs and gcsfs, cannot be
used after a ``fork``; it pickles without it). :func:`remote_request` and
:func:`remote_error` turn what a failed request raises into one
:class:`~lightning_iocatch.StoreError` that says what to fix. All remote I/O goes through
fsspec; no protocol code is written here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import is_own_object
from lightning_iocatch.store.progress import Advance

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "ObjectLocation",
    "delete_objects",
    "is_missing_bucket",
    "is_remote_failure",
    "list_objects",
    "remote_error",
    "remote_request",
    "write_object",
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


# The store's objects: listed, written and deleted by exact name


def list_objects(location: ObjectLocation) -> dict[str, int]:
    """Every object under the store's prefix: name relative to it -> size in bytes."""
    fs = location.fs
    with remote_request("list", location.url):
        fs.invalidate_cache(location.root)  # another process may have written since
        found = fs.find(location.root, detail=True)
    prefix = location.root + "/"
    return {
        name: int(info.get("size") or 0)
        for path, info in dict(found).items()
        if path.startswith(prefix)
        and info.get("type", "file") == "file"
        and not _is_folder_marker(name := path[len(prefix) :], info)
    }


def _is_folder_marker(name: str, info: dict[str, Any]) -> bool:
    """The empty object named ``folder/`` that the S3 console makes for a folder (or the
    prefix's own, listed as ``""``): it is no object of a store, nor anyone's data."""
    return (not name or name.endswith("/")) and not int(info.get("size") or 0)


def write_object(location: ObjectLocation, name: str, data: bytes) -> None:
    """Write the store's small object ``name`` in one request."""
    with remote_request("write", location.url_of(name)):
        location.fs.pipe_file(location.path(name), data)


def delete_objects(
    location: ObjectLocation,
    names: Iterable[str],
    *,
    verify: bool = True,
    advance: Advance | None = None,
) -> None:
    """Delete the store's own objects ``names``, then (``verify``) list the prefix to see
    them gone.

    Each object is deleted by its exact path (``rm_file``: never ``rm``, which expands the
    glob characters a prefix may hold), 16 requests at a time. A delete that fails quietly
    (S3's batch delete answers 200 and a per-key AccessDenied, which s3fs ignores) leaves
    the object listed: that raises a :class:`StoreError` naming what is left.
    ``advance(1)`` after each delete, where given (for a progress bar).
    """
    wanted = sorted({name for name in names if is_own_object(name)})
    if not wanted:
        return
    fs = location.fs

    def delete(name: str) -> None:
        gone = contextlib.suppress(FileNotFoundError)  # already gone: as asked
        with remote_request("delete", location.url_of(name)), gone:
            fs.rm_file(location.path(name))

    with ThreadPoolExecutor(min(16, len(wanted))) as pool:
        for _ in pool.map(delete, wanted):  # the first failure is raised here
            if advance is not None:
                advance(1)
    if not verify:
        return
    left = [name for name in wanted if name in list_objects(location)]
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise StoreError(
            f"objects of the store {location.url} are still there after the filesystem "
            f"reported them deleted: {shown}; the likely cause is a missing s3:DeleteObject "
            "permission (S3 answers a denied batch delete with success): grant it, or "
            "delete them yourself, and run again"
        )
