"""A local store's records: its ledgers, and the ``commits/`` of a store downloaded from
object storage.

Ledgers are read, appended (each line fsynced: the commit point) and repaired here, with
the one decision of :func:`~lightning_iocatch.store.commits.scan_ledger` about what a
ledger holds, so that a reader and a resumed writer never disagree about a record.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from pathlib import Path

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.local_files import (
    check_own_path,
    fsync_dir,
    open_own_file,
    read_store_json,
)
from lightning_iocatch.store.backends.manifests import held_by_manifests, merge_entries
from lightning_iocatch.store.commits import (
    LedgerEntry,
    record_line,
    scan_ledger,
)
from lightning_iocatch.store.names import (
    COMMITS,
    commit_rank_and_seq,
    is_commit_point,
    ledger_rank,
    manifest_span,
)
from lightning_iocatch.store.records import ShardRecord, format_version
from lightning_iocatch.store.shard_file import write_all

__all__ = [
    "append_ledger",
    "delete_commit_files",
    "drop_torn_tail",
    "file_crc32",
    "read_commit_files",
    "read_ledger_entries",
    "read_ledgers",
]


def append_ledger(path: Path, record: ShardRecord) -> None:
    """Append one line and make it durable before returning.

    ``path`` must be a ledger name inside the store; a symbolic link there is refused.
    """
    root = path.parent
    created = not os.path.lexists(path)
    with open_own_file(root, path.name, "ab") as handle:
        write_all(handle, record_line(record))
        os.fsync(handle.fileno())
    if created:
        fsync_dir(root)


def _version(root: Path) -> int:
    return format_version(read_store_json(root)["format"])


def _ledger_paths(root: Path) -> list[Path]:
    found = sorted(
        (rank, entry.name)
        for entry in os.scandir(root)
        if (rank := ledger_rank(entry.name)) is not None
    )
    return [check_own_path(root, name) for _, name in found]


def read_ledger_entries(root: Path, version: int | None = None) -> list[LedgerEntry]:
    """Every committed record of every rank with its ledger line, in rank then ledger order,
    in a store of format ``/{version}`` (default: as its ``store.json`` says).

    Raises :class:`StoreError` naming the ledger and line for any damage (see the module
    docstring for what counts as committed).
    """
    version = _version(root) if version is None else version
    entries: list[LedgerEntry] = []
    for path in _ledger_paths(root):
        try:
            with open_own_file(root, path.name, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise StoreError(f"cannot read ledger {path}: {error}") from error
        entries += scan_ledger(path, data, version=version).entries
    return entries


def read_ledgers(root: Path) -> list[ShardRecord]:
    """Every committed shard of every rank, in rank then ledger order.

    A torn last line (the process died while appending it) does not count; a complete last
    line without its newline does. Damage anywhere is an error naming the file and line.
    """
    return [entry.record for entry in read_ledger_entries(root)]


def drop_torn_tail(path: Path) -> None:
    """Make a ledger end in a newline before appending to it, keeping every committed line.

    A torn last line (one that :func:`read_ledgers` does not count) is cut off; a complete
    last line without its newline (which it does count) gets its newline.
    """
    root = path.parent
    if not os.path.lexists(path):
        return
    version = _version(root)
    with open_own_file(root, path.name, "r+b") as handle:
        data = handle.read()
        scan = scan_ledger(path, data, version=version)
        if scan.torn:
            handle.truncate(scan.end)
        elif scan.unterminated:
            handle.seek(len(data))
            write_all(handle, b"\n")
        else:
            return
        os.fsync(handle.fileno())


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def read_commit_files(root: Path, *, store_format: str) -> list[LedgerEntry]:
    """The commit records and manifests in ``root/commits`` of a local store (one written on
    object storage and downloaded); other files there are ignored (see :mod:`~.manifests`)."""
    folder = root / COMMITS
    if folder.is_symlink():
        raise StoreError(
            f"{folder} is a symbolic link; a feature store reads only its own files inside "
            "its directory"
        )
    if not folder.is_dir():
        return []
    names = os.listdir(folder)
    manifests = sorted((span, name) for name in names if (span := _span(name)) is not None)
    held = held_by_manifests(span for span, _ in manifests)
    records = sorted(
        (named, name)
        for name in names
        if (named := commit_rank_and_seq(f"{COMMITS}/{name}")) is not None and named not in held
    )
    version = format_version(store_format)
    return merge_entries(
        [(span, str(folder / name), _read_own(folder / name)) for span, name in manifests],
        [(named, str(folder / name), _read_own(folder / name)) for named, name in records],
        version,
    )


def _span(name: str) -> tuple[int, int, int] | None:
    return manifest_span(f"{COMMITS}/{name}")


def _read_own(path: Path) -> bytes:
    """A commit file's bytes; a symbolic link is refused, never followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise StoreError(f"cannot read commit record {path}: {error}") from error


def delete_commit_files(path: Path) -> None:
    """Delete the commit records of a store downloaded from object storage (``commits/``)."""
    folder = path / COMMITS
    if folder.is_symlink() or not folder.is_dir():
        return  # a link is never followed for writing; reading it is refused
    for name in os.listdir(folder):
        if is_commit_point(f"{COMMITS}/{name}"):  # commit records and manifests
            (folder / name).unlink()
    with contextlib.suppress(OSError):  # holding other files: kept
        folder.rmdir()
