"""The records of a store on object storage: commit records, manifests, ledger objects.

A shard on object storage counts once its commit record object is written
(:func:`commit_shard`), or once a manifest holds its record (:mod:`~.manifests`: written
when a writer closes, and by a resume, after which the records it holds are deleted, so
that ``commits/`` stays short; a kill between a manifest and those deletes leaves records
it holds, which the next resume deletes: :func:`delete_held_records`). A store written on
disk and copied here commits its shards with ledger objects instead.
:func:`read_commit_entries` reads all three; opening a store lists only ``commits/`` and
the ledgers (:func:`list_commit_points`), never the shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.backends.manifests import (
    held_by_manifests,
    manifest,
    merge_entries,
    runs,
)
from lightning_iocatch.store.backends.object_location import (
    ObjectLocation,
    delete_objects,
    remote_error,
    remote_request,
    write_object,
)
from lightning_iocatch.store.commits import (
    LedgerEntry,
    read_commit_record,
    record_line,
    scan_ledger,
)
from lightning_iocatch.store.names import (
    COMMITS,
    commit_name,
    commit_rank_and_seq,
    ledger_rank,
    manifest_span,
    shard_rank_and_seq,
)
from lightning_iocatch.store.progress import Advance, progress_bar
from lightning_iocatch.store.records import ShardRecord, format_version

__all__ = [
    "commit_shard",
    "delete_held_records",
    "list_commit_points",
    "read_commit_entries",
    "write_manifests",
]

_LEDGER_STEM = "ledger-"
_FETCH_CHUNK = 1000  # objects fetched in one concurrent request (a bar moves on per chunk)


def list_commit_points(location: ObjectLocation) -> dict[str, int]:
    """The objects of ``commits/`` and the ledger objects, by name with their size: two
    listings that never page through the shards (the filesystem filters by prefix)."""
    fs = location.fs
    found: dict[str, int] = {}
    with remote_request("list", location.url):
        fs.invalidate_cache(location.root)  # another process may have written since
        listed = dict(fs.find(location.path(COMMITS), detail=True))
        try:  # s3fs, gcsfs and adlfs filter by a prefix on the server
            listed |= dict(fs.find(location.root, prefix=_LEDGER_STEM, detail=True))
        except TypeError:  # a filesystem without: list it all
            listed |= dict(fs.find(location.root, detail=True))
    prefix = location.root + "/"
    for path, info in listed.items():
        name = path[len(prefix) :] if path.startswith(prefix) else ""
        if info.get("type", "file") == "file" and (
            name.startswith(COMMITS + "/") or ledger_rank(name) is not None
        ):
            found[name] = int(info.get("size") or 0)
    return found


def commit_shard(location: ObjectLocation, record: ShardRecord) -> None:
    """Write the commit record of ``record``'s shard: the shard counts from here on."""
    named = shard_rank_and_seq(record.file)
    if named is None:
        raise StoreError(f"{record.file!r} is not a shard name")
    write_object(location, commit_name(*named), record_line(record))


def read_commit_entries(
    location: ObjectLocation, listing: dict[str, int], *, store_format: str, progress: bool = False
) -> list[LedgerEntry]:
    """The record of every committed shard, by rank then sequence number: from a manifest
    (see :mod:`~.manifests`), its commit record, or its line in a ledger object (a store
    written on disk and copied here).

    ``listing`` names the objects (:func:`list_commit_points` or a listing of the whole
    prefix), ``store_format`` is that of ``store.json`` (ledger lines of format ``/1``
    carry no checksum); every object is fetched by its exact name, concurrently where the
    filesystem can, and a commit record a manifest holds is not fetched (a kill may leave
    it; the next resume deletes it). Damage raises a :class:`StoreError` naming the
    object (and the line). ``progress``: a bar of the objects fetched, on stderr.
    """
    manifests = sorted((span, name) for name in listing if (span := manifest_span(name)))
    held = held_by_manifests(span for span, _ in manifests)
    commits = sorted(
        (n, name)
        for name in listing
        if (n := commit_rank_and_seq(name)) is not None and n not in held
    )
    ledgers = sorted(name for name in listing if ledger_rank(name) is not None)
    names = [name for _, name in manifests] + [name for _, name in commits] + ledgers
    with progress_bar(progress, "read commit records", total=len(names), unit="obj") as advance:
        fetched = iter(_fetch_whole(location, names, advance))
    version = format_version(store_format)
    every = merge_entries(
        [(span, location.url_of(name), next(fetched)) for span, name in manifests],
        [(named, location.url_of(name), next(fetched)) for named, name in commits],
        version,
    )
    for name in ledgers:
        data = next(fetched)
        path = Path(location.path(name))  # the scan names it in messages: give the URL
        try:
            scanned = scan_ledger(path, data, version=version).entries
        except StoreError as error:
            raise StoreError(str(error).replace(str(path), location.url_of(name), 1)) from error
        every += [LedgerEntry(location.url_of(name), e.line, e.record) for e in scanned]
    return sorted(every, key=lambda entry: entry.commit_order)


def delete_held_records(
    location: ObjectLocation,
    listing: dict[str, int],
    entries: Iterable[LedgerEntry],
    *,
    store_format: str,
    progress: bool = False,
) -> list[str]:
    """Delete the commit records of ``listing`` that a manifest already holds (a kill
    between a manifest's write and the deletes of the records it gathers leaves them);
    return their names.

    ``entries`` are :func:`read_commit_entries`' of the same listing: a held shard's entry
    is its manifest's line. Each such record is fetched and deleted only where it is that
    line's record, field for field; one that is not is never deleted: a
    :class:`StoreError` names both (readers use the manifest's line). No request is made
    when no record is left.
    """
    spans = [span for name in listing if (span := manifest_span(name)) is not None]
    held = held_by_manifests(spans)
    left = sorted((named, name) for name in listing if (named := commit_rank_and_seq(name)) in held)
    if not left:
        return []
    by_shard = {shard_rank_and_seq(entry.record.file): entry for entry in entries}
    names = [name for _, name in left]
    with progress_bar(
        progress, "check left commit records", total=len(names), unit="obj"
    ) as advance:
        fetched = _fetch_whole(location, names, advance)
    version = format_version(store_format)
    for (named, name), data in zip(left, fetched, strict=True):
        entry = by_shard[named]
        record = read_commit_record(location.url_of(name), named, data, version).record
        if record != entry.record:
            raise StoreError(
                f"commit record {location.url_of(name)} and {entry.where} record "
                f"{entry.record.file} differently: the store is damaged (two runs wrote it "
                f"at once?); readers use the manifest's line: if it is right, delete "
                f"{location.url_of(name)} and resume again, else write to another path"
            )
    delete_objects(location, names)
    return names


def _fetch_whole(location: ObjectLocation, names: list[str], advance: Advance) -> list[bytes]:
    """The bytes of each object ``names``, concurrently where the filesystem can, a thousand
    at a time (``advance`` after each thousand)."""
    out: list[bytes] = []
    for start in range(0, len(names), _FETCH_CHUNK):
        chunk = names[start : start + _FETCH_CHUNK]
        paths = [location.path(name) for name in chunk]
        with remote_request("read commit records in", location.url):
            fetched = location.fs.cat_ranges(
                paths, [None] * len(paths), [None] * len(paths), on_error="return"
            )
        for name, data in zip(chunk, fetched, strict=True):
            if not isinstance(data, bytes):
                failure = data if isinstance(data, BaseException) else OSError(repr(data))
                raise remote_error("read", location.url_of(name), failure)
            out.append(data)
        advance(len(chunk))
    return out


def write_manifests(location: ObjectLocation, records: Iterable[ShardRecord]) -> None:
    """Gather ``records`` (committed, by their commit records) into manifests, one per run
    of consecutive shards of a rank (see :mod:`~.manifests`), then delete the commit
    records a manifest now holds (a delete that fails leaves a record the manifest
    repeats, which readers skip)."""
    by_rank: dict[int, dict[int, ShardRecord]] = {}
    for record in records:
        named = shard_rank_and_seq(record.file)
        if named is not None:
            by_rank.setdefault(named[0], {})[named[1]] = record
    for rank, mine in sorted(by_rank.items()):
        for run in runs(sorted(mine)):
            name, data = manifest(rank, [mine[seq] for seq in run])
            write_object(location, name, data)
            held = [commit_name(rank, seq) for seq in run]
            delete_objects(location, held, verify=False)  # one left is skipped by readers
