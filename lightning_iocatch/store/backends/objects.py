"""A store on object storage: a shard object, then its commit record object.

Object stores (S3, GCS, Azure Blob, fsspec's ``memory://``) have no rename and no append,
so the POSIX protocol of :mod:`~lightning_iocatch.store.backends.local` (temporary name,
rename, an appended ledger line) cannot be used there. :class:`ObjectBackend` implements
the store's one interface (:mod:`~lightning_iocatch.store.backends.base`) with its own
protocol instead. A store at a prefix holds::

    store.json                          as on disk, written once (by rank 0, before any shard)
    shard-r{rank:03d}-{seq:06d}.safetensors   as on disk
    commits/r{rank:03d}-{seq:06d}.json        the commit record of that shard: exactly the
                                              JSON a ledger line holds (with its record_crc32)

The protocol, with every request made through the URL's fsspec filesystem:

1. **Write the shard object completely.** It is uploaded as plain fsspec writes upload
   (for S3: one PUT, or a multipart upload for a shard over s3fs's block size, so it
   appears whole or not at all); on any failure the upload is discarded.
2. **Then write its commit record**, one small object in one request (a PUT is atomic on
   S3, GCS and Azure). The commit record is the commit point: a shard object without one
   does not exist. It names the shard, its size and CRC-32, its batches and keys.
3. **Readers list** ``commits/`` and never count a shard without a commit record. A commit
   record whose shard object is missing or of another size is damage, an error naming both.
4. ``mode="resume"`` deletes the shard objects without a commit record (debris of a killed
   run) and continues each rank at the sequence number after its last commit;
   ``mode="overwrite"`` deletes ``store.json``, every shard object and every commit record.
   Both touch only the names above: any other object under the prefix is kept. Each object
   is deleted by its exact name (never a glob), and the prefix is listed again afterwards:
   an object still there is an error (S3 answers a batch delete without permission with
   success).

A store written on disk and copied to object storage (``aws s3 sync``) commits its shards
with ledgers (``ledger-r000.jsonl``) instead; a store downloaded from object storage keeps
its ``commits/`` folder. Both commit points are read wherever the store lives
(:func:`read_commit_entries` here; the local backend reads ``commits/``): a shard named by
either counts, and resume deletes neither.

Not protected against: two runs writing one prefix at once, and an object store whose
listing does not show an object written before it (S3 and GCS list strongly consistently).
A multipart upload killed with its process is invisible, but the store keeps its parts
until a lifecycle rule (``AbortIncompleteMultipartUpload``) removes them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Committed, Shard, StoreBackend, Write
from lightning_iocatch.store.backends.manifests import (
    check_against_records,
    manifest,
    read_manifest,
    runs,
)
from lightning_iocatch.store.backends.object_location import (
    ObjectLocation,
    is_missing_bucket,
    is_remote_failure,
    remote_error,
    remote_request,
)
from lightning_iocatch.store.backends.ranged_reads import open_remote_shards
from lightning_iocatch.store.commits import (
    LedgerEntry,
    read_commit_record,
    record_line,
    scan_ledger,
)
from lightning_iocatch.store.names import (
    STORE_FILE,
    check_store_json,
    commit_name,
    commit_rank_and_seq,
    is_commit_point,
    is_own_object,
    ledger_rank,
    manifest_span,
    shard_rank_and_seq,
)
from lightning_iocatch.store.records import ShardRecord, format_version

__all__ = [
    "ObjectBackend",
    "commit_shard",
    "delete_objects",
    "list_objects",
    "read_commit_entries",
    "read_store_info",
    "write_object",
    "write_shard_object",
]


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


def delete_objects(location: ObjectLocation, names: Iterable[str]) -> None:
    """Delete the store's own objects ``names``, then list the prefix to see them gone.

    Each object is deleted by its exact path (``rm_file``: never ``rm``, which expands the
    glob characters a prefix may hold), 16 requests at a time. A delete that fails quietly
    (S3's batch delete answers 200 and a per-key AccessDenied, which s3fs ignores) leaves
    the object listed: that raises a :class:`StoreError` naming what is left.
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
        list(pool.map(delete, wanted))  # the first failure is raised here
    left = [name for name in wanted if name in list_objects(location)]
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise StoreError(
            f"objects of the store {location.url} are still there after the filesystem "
            f"reported them deleted: {shown}; the likely cause is a missing s3:DeleteObject "
            "permission (S3 answers a denied batch delete with success): grant it, or "
            "delete them yourself, and run again"
        )


def write_shard_object(location: ObjectLocation, name: str, write: Write) -> tuple[int, int]:
    """Upload the shard object ``name`` with ``write(handle)``, as plain fsspec writes do.

    The upload is completed when the handle closes (for S3, one PUT, or a multipart upload
    for shards over the filesystem's block size); on any failure, ``write`` raising
    included, it is discarded instead (for S3: the multipart upload is aborted, and the
    handle is marked closed so that nothing completes it later) and the error is raised,
    an ``OSError`` as a :class:`StoreError` naming the object. A filesystem that shows an
    object while it is written (``memory://``) leaves one without a commit record, which
    counts for nothing and which resume deletes.
    """
    from fsspec.spec import AbstractBufferedFile

    with remote_request("write", location.url_of(name)):
        handle = location.fs.open(location.path(name), "wb")
    try:
        result = write(handle)
        handle.close()
    except BaseException as error:
        with contextlib.suppress(Exception):
            handle.discard()
        if isinstance(handle, AbstractBufferedFile):
            handle.closed = True  # never flushed nor completed by ``close`` or ``__del__``
        if isinstance(error, Exception) and is_remote_failure(error):
            raise remote_error("write", location.url_of(name), error) from error
        raise
    return result


def commit_shard(location: ObjectLocation, record: ShardRecord) -> None:
    """Write the commit record of ``record``'s shard: the shard counts from here on."""
    named = shard_rank_and_seq(record.file)
    if named is None:
        raise StoreError(f"{record.file!r} is not a shard name")
    write_object(location, commit_name(*named), record_line(record))


def read_commit_entries(
    location: ObjectLocation, listing: dict[str, int], *, store_format: str
) -> list[LedgerEntry]:
    """The record of every committed shard, by rank then sequence number: from a manifest
    (see :mod:`~.manifests`), its commit record, or its line in a ledger object (a store
    written on disk and copied here).

    ``listing`` is :func:`list_objects`' answer, ``store_format`` that of ``store.json``
    (ledger lines of format ``/1`` carry no checksum); every object is fetched by its exact
    name, concurrently where the filesystem can, and a commit record a manifest holds is
    not fetched. Damage raises a :class:`StoreError` naming the object (and the line).
    """
    manifests = sorted((span, name) for name in listing if (span := manifest_span(name)))
    held: dict[tuple[int, int], str] = {}
    for (rank, first, last), name in manifests:
        held.update(dict.fromkeys(((rank, seq) for seq in range(first, last + 1)), name))
    commits = sorted(
        (n, name)
        for name in listing
        if (n := commit_rank_and_seq(name)) is not None and n not in held
    )
    ledgers = sorted(name for name in listing if ledger_rank(name) is not None)
    names = [name for _, name in manifests] + [name for _, name in commits] + ledgers
    fetched = iter(_fetch_whole(location, names))
    version = format_version(store_format)
    entries: dict[tuple[int, int], LedgerEntry] = {}
    for span, name in manifests:
        where = location.url_of(name)
        lines = read_manifest(where, span, next(fetched), version)
        check_against_records(lines, listing, location.url_of)
        for entry, _ in lines:
            named = (span[0], entry.line - 1 + span[1])
            if named in entries and entries[named].record != entry.record:
                raise StoreError(f"{entries[named].where} and {entry.where} disagree: damaged")
            entries[named] = entry
    for named, name in commits:
        entries[named] = read_commit_record(location.url_of(name), named, next(fetched), version)
    every = list(entries.values())
    for name in ledgers:
        data = next(fetched)
        path = Path(location.path(name))  # the scan names it in messages: give the URL
        try:
            scanned = scan_ledger(path, data, version=version).entries
        except StoreError as error:
            raise StoreError(str(error).replace(str(path), location.url_of(name), 1)) from error
        every += [LedgerEntry(location.url_of(name), e.line, e.record) for e in scanned]
    return sorted(every, key=lambda entry: entry.commit_order)


def _fetch_whole(location: ObjectLocation, names: list[str]) -> list[bytes]:
    """The bytes of each object ``names``, concurrently where the filesystem can."""
    if not names:
        return []
    paths = [location.path(name) for name in names]
    with remote_request("read commit records in", location.url):
        fetched = location.fs.cat_ranges(
            paths, [None] * len(paths), [None] * len(paths), on_error="return"
        )
    for name, data in zip(names, fetched, strict=True):
        if not isinstance(data, bytes):
            failure = data if isinstance(data, BaseException) else OSError(repr(data))
            raise remote_error("read", location.url_of(name), failure)
    return list(fetched)


def write_manifests(location: ObjectLocation, records: Iterable[ShardRecord]) -> None:
    """Gather ``records`` (committed, by their commit records) into manifests, one per run
    of consecutive shards of a rank (see :mod:`~.manifests`)."""
    by_rank: dict[int, dict[int, ShardRecord]] = {}
    for record in records:
        named = shard_rank_and_seq(record.file)
        if named is not None:
            by_rank.setdefault(named[0], {})[named[1]] = record
    for rank, mine in sorted(by_rank.items()):
        for run in runs(sorted(mine)):
            name, data = manifest(rank, [mine[seq] for seq in run])
            write_object(location, name, data)


def read_store_info(location: ObjectLocation) -> dict[str, Any]:
    """The store's ``store.json``, checked."""
    where = location.url_of(STORE_FILE)
    try:
        raw = location.fs.cat_file(location.path(STORE_FILE))
    except FileNotFoundError as error:
        if is_missing_bucket(error):
            raise remote_error("read", where, error) from error
        raise StoreError(
            f"{location.url} is not a feature store: it has no {STORE_FILE} (stores are "
            "written by lightning_iocatch.FeatureWriter)"
        ) from error
    except Exception as error:
        if not is_remote_failure(error):
            raise
        raise remote_error("read", where, error) from error
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as error:
        raise StoreError(f"cannot read {where}: {error}") from error
    return check_store_json(data, where)


class ObjectBackend(StoreBackend):
    """A store at a prefix on object storage (see the module docstring)."""

    place = "under the prefix"
    commit_point = "commit record"
    shards_in_flight = 4  # a request waits on the network: keep several uploads going

    def __init__(self, location: ObjectLocation) -> None:
        self.location = location

    @property
    def path(self) -> ObjectLocation:
        return self.location

    def __str__(self) -> str:
        return self.location.url

    def __repr__(self) -> str:
        return f"ObjectBackend({self.location.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectBackend) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)

    def has_info(self) -> bool:
        return STORE_FILE in list_objects(self.location)

    def read_info(self) -> dict[str, Any]:
        return read_store_info(self.location)

    def write_info(self, info: Mapping[str, Any]) -> None:
        write_object(self.location, STORE_FILE, json.dumps(info, indent=2, sort_keys=True).encode())

    def names(self) -> dict[str, int]:
        return list_objects(self.location)

    def committed(self, store_format: str) -> Committed:
        """One listing gives the commit records and the shards' sizes."""
        listing = list_objects(self.location)
        entries = read_commit_entries(self.location, listing, store_format=store_format)
        return Committed(entries, listing)

    def open_shards(self, committed: Committed) -> dict[str, Shard]:
        sizes = committed.sizes if committed.sizes is not None else list_objects(self.location)
        return open_remote_shards(self.location, committed.entries, sizes)

    def write_shard(self, name: str, write: Write, *, durable: bool) -> tuple[int, int]:
        """A completed upload is durable: ``durable`` changes nothing here."""
        return write_shard_object(self.location, name, write)

    def commit(self, record: ShardRecord, *, durable: bool) -> None:
        commit_shard(self.location, record)

    def clear(self, names: Mapping[str, int]) -> None:
        """``store.json`` first (a store cut short here is no store at all), then every commit
        point (then no shard counts), then the shards."""
        points = {name for name in names if is_commit_point(name)}
        delete_objects(self.location, [name for name in names if name == STORE_FILE])
        delete_objects(self.location, points)
        delete_objects(self.location, [n for n in names if n != STORE_FILE and n not in points])

    def compact(self, records: Sequence[ShardRecord]) -> None:
        """Manifests of ``records``, one per run of a rank's consecutive shards."""
        write_manifests(self.location, records)

    def clean_for_resume(self, store_format: str) -> Committed:
        """Delete shard objects without a commit record (or ledger line: a store copied from
        disk); gather the commit records no manifest holds (those of a killed run) into
        manifests."""
        committed = self.committed(store_format)
        write_manifests(self.location, [e.record for e in committed.entries if e.line == 0])
        listing = dict(committed.sizes or {})
        kept = {entry.record.file for entry in committed.entries}
        uncommitted = [
            name
            for name in listing
            if shard_rank_and_seq(name.removesuffix(".tmp")) is not None and name not in kept
        ]
        delete_objects(self.location, uncommitted)
        for name in uncommitted:
            del listing[name]
        return Committed(committed.entries, listing)  # manifests are not shards: sizes hold
