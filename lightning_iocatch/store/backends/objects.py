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
    commits/r{rank:03d}-{first}-{last}.jsonl  a manifest: the commit records of a rank's
                                              shards first..last, one per line

The protocol, with every request made through the URL's fsspec filesystem:

1. **Write the shard object completely.** It is uploaded as plain fsspec writes upload
   (for S3: one PUT, or a multipart upload for a shard over s3fs's block size, so it
   appears whole or not at all); on any failure the upload is discarded.
2. **Then write its commit record**, one small object in one request (a PUT is atomic on
   S3, GCS and Azure). The commit record is the commit point: a shard object without one
   does not exist. It names the shard, its size and CRC-32, its batches and keys.
3. **Manifests.** A writer that closes having committed every shard, and a resume, gather
   the commit records into manifests (:mod:`~.manifests`), then delete the records they
   hold: a manifest's line is then the shard's commit point. A kill before those deletes
   leaves records a manifest holds: the next resume deletes each, once it has checked
   that the manifest's line is the same record (never one a manifest does not hold).
4. **Readers list** ``commits/`` and the ledgers only (never the shards: a store of
   30,000 shards opens in a few requests) and never count a shard without a commit record
   or manifest line. A committed shard object that is missing or of another size is
   damage, an error naming both, raised when the shard is first read (a resume, which
   lists the whole prefix, checks them all at once).
5. ``mode="resume"`` deletes the shard objects without a commit record (debris of a killed
   run) and continues each rank at the sequence number after its last commit;
   ``mode="overwrite"`` deletes ``store.json``, every commit record and manifest, then
   every shard object.
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
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.base import Committed, Shard, StoreBackend, Write
from lightning_iocatch.store.backends.object_location import (
    ObjectLocation,
    delete_objects,
    is_missing_bucket,
    is_remote_failure,
    list_objects,
    remote_error,
    remote_request,
    write_object,
)
from lightning_iocatch.store.backends.object_records import (
    commit_shard,
    delete_held_records,
    list_commit_points,
    read_commit_entries,
    write_manifests,
)
from lightning_iocatch.store.backends.ranged_reads import open_remote_shards
from lightning_iocatch.store.names import (
    STORE_FILE,
    check_store_json,
    is_commit_point,
    is_own_object,
    shard_rank_and_seq,
)
from lightning_iocatch.store.progress import progress_bar
from lightning_iocatch.store.records import ShardRecord

__all__ = ["ObjectBackend", "read_store_info", "write_shard_object"]


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

    def committed(self, store_format: str, *, progress: bool = False) -> Committed:
        """The records, from listings of ``commits/`` and of the ledgers alone: the shards
        are not listed (a store of 30,000 shards would take 30 more pages), so their sizes
        are checked when each is first read."""
        listing = list_commit_points(self.location)
        entries = read_commit_entries(
            self.location, listing, store_format=store_format, progress=progress
        )
        return Committed(entries)

    def open_shards(self, committed: Committed) -> dict[str, Shard]:
        return open_remote_shards(self.location, committed.entries, committed.sizes)

    def write_shard(self, name: str, write: Write, *, durable: bool) -> tuple[int, int]:
        """A completed upload is durable: ``durable`` changes nothing here."""
        return write_shard_object(self.location, name, write)

    def commit(self, record: ShardRecord, *, durable: bool) -> None:
        commit_shard(self.location, record)

    def clear(self, names: Mapping[str, int], *, progress: bool = False) -> None:
        """``store.json`` first (a store cut short here is no store at all), then every commit
        point (then no shard counts), then the shards."""
        points = {name for name in names if is_commit_point(name)}
        own = sum(is_own_object(name) for name in names)
        with progress_bar(progress, "delete the old store", total=own, unit="obj") as advance:
            delete_objects(self.location, [n for n in names if n == STORE_FILE], advance=advance)
            delete_objects(self.location, points, advance=advance)
            rest = [n for n in names if n != STORE_FILE and n not in points]
            delete_objects(self.location, rest, advance=advance)

    def compact(self, records: Sequence[ShardRecord]) -> None:
        """Manifests of ``records``, one per run of a rank's consecutive shards; the commit
        records they hold are then deleted."""
        write_manifests(self.location, records)

    def clean_for_resume(self, store_format: str, *, progress: bool = False) -> Committed:
        """Delete shard objects without a commit record (or ledger line: a store copied from
        disk) and the commit records a manifest already holds (left by a kill before their
        deletes; each checked against its manifest's line); gather the commit records no
        manifest holds (those of a killed run) into manifests. One listing of the whole
        prefix gives the shards' sizes too."""
        listing = list_objects(self.location)
        entries = read_commit_entries(
            self.location, listing, store_format=store_format, progress=progress
        )
        for name in delete_held_records(
            self.location, listing, entries, store_format=store_format, progress=progress
        ):
            del listing[name]
        write_manifests(self.location, [e.record for e in entries if e.line == 0])
        kept = {entry.record.file for entry in entries}
        uncommitted = [
            name
            for name in listing
            if shard_rank_and_seq(name.removesuffix(".tmp")) is not None and name not in kept
        ]
        own = sum(is_own_object(name) for name in uncommitted)
        with progress_bar(progress, "delete uncommitted shards", total=own, unit="obj") as advance:
            delete_objects(self.location, uncommitted, advance=advance)
        for name in uncommitted:
            del listing[name]
        return Committed(entries, listing)
