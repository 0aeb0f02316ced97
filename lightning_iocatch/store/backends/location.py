"""Where a store lives, from what a user passes: a path, or an fsspec URL with options.

:func:`open_backend` is the one place that tells the two places apart: a plain path or a
``file://`` URL is a local directory (:class:`~.local.LocalBackend`), any other fsspec URL
(``s3://``, ``gs://``, ``az://``, ``memory://``, ...) a prefix on object storage
(:class:`~.objects.ObjectBackend`). Everything else works through the
:class:`~.base.StoreBackend` it returns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.backends.local import LocalBackend
from lightning_iocatch.store.backends.object_location import ObjectLocation
from lightning_iocatch.store.backends.objects import ObjectBackend

__all__ = ["open_backend"]


def open_backend(
    path: str | os.PathLike[str] | StoreBackend,
    storage_options: Mapping[str, Any] | None = None,
) -> StoreBackend:
    """Where a store lives: a :class:`LocalBackend` for a local path, an
    :class:`ObjectBackend` for any other fsspec URL.

    ``path`` is a local path, a ``file://`` URL (both local), or any other fsspec URL;
    ``storage_options`` go to fsspec as they are, and are refused for a local path.

    Raises:
        TypeError: ``path`` or ``storage_options`` of the wrong type.
        ValueError: ``storage_options`` given for a local path.
        StoreError: a URL fsspec cannot open (an unknown protocol, a missing package),
            naming the URL and the fix.

    Examples:
        >>> open_backend("features/")
        LocalBackend('features')
        >>> open_backend("memory://bucket/run")
        ObjectBackend('memory://bucket/run')
    """
    if isinstance(path, StoreBackend):
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
        return LocalBackend(Path(path))
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
        return LocalBackend(Path(root))
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
    return ObjectBackend(ObjectLocation(text, options, root, fs))


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
