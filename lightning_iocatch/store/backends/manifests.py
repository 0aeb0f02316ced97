"""Manifests: a rank's commit records gathered in one object, so a reader needs one request.

On object storage each shard is committed by its own commit record object
(:mod:`~lightning_iocatch.store.backends.objects`): a store of 30,000 shards takes 30,000
requests to open. A manifest ``commits/r{rank}-{first}-{last}.jsonl`` holds the commit
records of a rank's shards ``first`` to ``last``, byte for byte, one per line; it is
written once those records are (by a writer that closes cleanly, for the shards it wrote;
by a resume, for the records no manifest holds yet). The records stay the commit points:
a reader takes a shard's record from a manifest only where the shard's commit record
object is listed with the size of that line (the listing gives sizes, so this costs no
request), and a manifest that disagrees with the records is damage, never read.

Example:
    >>> runs([3, 4, 5, 9, 10])
    [[3, 4, 5], [9, 10]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.commits import LedgerEntry, read_commit_record, record_line
from lightning_iocatch.store.names import commit_name, manifest_name, shard_rank_and_seq
from lightning_iocatch.store.records import ShardRecord

__all__ = ["check_against_records", "manifest", "read_manifest", "runs"]


def runs(seqs: Sequence[int]) -> list[list[int]]:
    """Ascending ``seqs`` cut into runs of consecutive numbers."""
    out: list[list[int]] = []
    for seq in seqs:
        if out and out[-1][-1] == seq - 1:
            out[-1].append(seq)
        else:
            out.append([seq])
    return out


def manifest(rank: int, records: Sequence[ShardRecord]) -> tuple[str, bytes]:
    """The name and bytes of the manifest of ``records`` (one rank's consecutive shards)."""
    first, last = _seq(records[0]), _seq(records[-1])
    if [_seq(record) for record in records] != list(range(first, last + 1)):
        raise ValueError("a manifest holds consecutive shards of one rank")
    return manifest_name(rank, first, last), b"".join(record_line(record) for record in records)


def read_manifest(
    where: str, span: tuple[int, int, int], data: bytes, version: int
) -> list[tuple[LedgerEntry, int]]:
    """The entries of the manifest ``data`` of ``span`` ``(rank, first, last)`` read at
    ``where``, each with the bytes of its line; damage is a :class:`StoreError`."""
    rank, first, last = span
    lines = data.split(b"\n")
    if lines[-1] != b"" or len(lines) - 1 != last - first + 1:
        raise StoreError(
            f"manifest {where} is damaged: it must hold {last - first + 1} lines, one per "
            f"shard {first}..{last}, each ending in a newline"
        )
    out = []
    for number, (seq, line) in enumerate(zip(range(first, last + 1), lines, strict=False), 1):
        entry = read_commit_record(f"{where} line {number}", (rank, seq), line, version)
        out.append((LedgerEntry(where, number, entry.record), len(line) + 1))
    return out


def check_against_records(
    entries: Sequence[tuple[LedgerEntry, int]],
    listing: Mapping[str, int],
    url_of: Callable[[str], str],
) -> None:
    """Every shard a manifest holds has its commit record listed, of the size of its line;
    a :class:`StoreError` naming both otherwise. ``url_of(name)``: a listed name's URL."""
    for entry, size in entries:
        name = commit_name(entry.record.rank, _seq(entry.record))
        listed = listing.get(name)
        if listed != size:
            state = "missing" if listed is None else f"{listed} bytes, the line {size}"
            raise StoreError(
                f"{entry.where} records {entry.record.file}, but its commit record "
                f"{url_of(name)} is {state}: the store is damaged"
            )


def _seq(record: ShardRecord) -> int:
    named = shard_rank_and_seq(record.file)
    assert named is not None  # a parsed record names a shard
    return named[1]
