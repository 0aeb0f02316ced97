"""A local store's own files: only those, directly inside its directory, opened safely.

A store reads and writes only its own files (:func:`~lightning_iocatch.store.names.is_store_file`)
directly inside its directory. A symbolic link is read only where it resolves to a file
directly inside the directory, and never written through; new files get the permissions
of the process's umask; a file that must survive a crash is fsynced with its directory.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Literal

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.names import (
    STORE_FILE,
    check_store_json,
    is_store_file,
    ledger_name,
    shard_name,
)
from lightning_iocatch.store.shard_file import write_all

__all__ = [
    "check_own_path",
    "fsync_dir",
    "open_own_file",
    "read_store_json",
    "write_json_atomic",
]


def check_own_path(root: Path, name: str, *, for_writing: bool = False) -> Path:
    """``root / name`` once it is sure to be one of the store's own files inside ``root``.

    ``name`` must be a name the store writes (:func:`is_store_file`): a plain file name,
    never a path. For reading, a symbolic link is accepted only where it resolves to a file
    directly inside ``root``; for writing (and truncating, deleting), a symbolic link is
    refused outright. Raises :class:`StoreError` naming the path otherwise.

    This checks the directory as it is now: it does not protect against another process
    swapping files in it between this check and the use (:func:`open_own_file` closes that
    gap for writing with ``O_NOFOLLOW``).
    """
    if not isinstance(name, str) or not is_store_file(name):
        raise StoreError(
            f"{name!r} is not a file name of a feature store ({STORE_FILE}, "
            f"{ledger_name(0)}, {shard_name(0, 0)}); a store touches only its own files "
            f"inside {root}"
        )
    path = root / name
    if not path.is_symlink():
        return path
    if for_writing:
        raise StoreError(
            f"{path} is a symbolic link; a feature store never writes through one: remove it"
        )
    target = path.resolve()
    if target.parent != root.resolve():
        raise StoreError(
            f"{path} is a symbolic link to {target}, outside the store; a feature store reads "
            "only its own files inside its directory"
        )
    return path


_MODES: dict[str, int] = {
    "rb": os.O_RDONLY,
    "r+b": os.O_RDWR,
    "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def open_own_file(root: Path, name: str, mode: Literal["rb", "r+b", "ab", "xb"]) -> IO[bytes]:
    """Open one of the store's own files (see :func:`check_own_path`), unbuffered.

    Modes other than ``"rb"`` never follow a symbolic link (``O_NOFOLLOW``), and new files
    get ``0o666`` less the process's umask, like any file ``open`` creates.
    """
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {sorted(_MODES)}, got {mode!r}")
    writing = mode != "rb"
    path = check_own_path(root, name, for_writing=writing)
    flags = _MODES[mode] | os.O_CLOEXEC | (os.O_NOFOLLOW if writing else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if os.path.islink(path):
            raise StoreError(
                f"{path} is a symbolic link; a feature store never writes through one: remove it"
            ) from error
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{path} is not a regular file")
        return os.fdopen(fd, "wb" if mode == "xb" else mode, buffering=0)
    except BaseException:
        os.close(fd)
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path``: a temporary file, fsync, rename.

    ``path`` must be one of the store's own names (see :func:`check_own_path`); the file
    gets the permissions of the process's umask.
    """
    root, tmp = path.parent, path.name + ".tmp"
    check_own_path(root, path.name, for_writing=True)
    (root / tmp).unlink(missing_ok=True)  # debris of a killed run (a link is removed, not followed)
    with open_own_file(root, tmp, "xb") as handle:
        write_all(handle, json.dumps(data, indent=2, sort_keys=True).encode())
        os.fsync(handle.fileno())
    os.replace(root / tmp, path)
    fsync_dir(root)


def read_store_json(root: Path) -> dict[str, Any]:
    """The store's ``store.json``; a clear error when ``root`` is not a store or it is damaged."""
    path = root / STORE_FILE
    if not root.is_dir() or not (path.is_file() or path.is_symlink()):
        raise StoreError(
            f"{root} is not a feature store: it has no {STORE_FILE} (stores are written by "
            "lightning_iocatch.FeatureWriter)"
        )
    try:
        with open_own_file(root, STORE_FILE, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        raise StoreError(f"cannot read {path}: {error}") from error
    return check_store_json(data, path)
