"""Manifests: a rank's commit records gathered in one object, so a reader needs one request.

On object storage each shard is committed by its own commit record object
(:mod:`~lightning_iocatch.store.backends.objects`): a store of 30,000 shards takes 30,000
requests to open. A manifest ``commits/r{rank}-{first}-{last}.jsonl`` holds the commit
records of a rank's shards ``first`` to ``last``, byte for byte, one per line; it is
written once those records are (by a writer that closes cleanly, for the shards it wrote;
by a resume, for the records no manifest holds yet), and the records it holds are then
deleted: from there on the manifest's line is the shard's commit point, checked like a
record (its own ``record_crc32``, the shard it names, one line per shard in order). A
manifest written in one request is there whole or not at all; a kill between it and the
deletes leaves records it repeats, which readers skip.

Examples:
    >>> runs([3, 4, 5, 9, 10])
    [[3, 4, 5], [9, 10]]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_iocatch.errors import StoreError
from lightning_iocatch.store.commits import LedgerEntry, read_commit_record, record_line
from lightning_iocatch.store.names import manifest_name, shard_rank_and_seq
from lightning_iocatch.store.records import ShardRecord

__all__ = ["held_by_manifests", "manifest", "merge_entries", "read_manifest", "runs"]


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
) -> list[LedgerEntry]:
    """The entries of the manifest ``data`` of ``span`` ``(rank, first, last)`` read at
    ``where``; damage is a :class:`StoreError` naming it and the line."""
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
        out.append(LedgerEntry(where, number, entry.record))
    return out


def held_by_manifests(manifests: Iterable[tuple[int, int, int]]) -> set[tuple[int, int]]:
    """``(rank, seq)`` of every shard the manifests of these spans hold."""
    return {(rank, seq) for rank, first, last in manifests for seq in range(first, last + 1)}


def merge_entries(
    manifests: Sequence[tuple[tuple[int, int, int], str, bytes]],
    records: Sequence[tuple[tuple[int, int], str, bytes]],
    version: int,
) -> list[LedgerEntry]:
    """The entries of ``manifests`` (span, where, bytes) and of the commit ``records``
    (``(rank, seq)``, where, bytes) no manifest holds; two manifests holding one shard
    must agree."""
    entries: dict[tuple[int, int], LedgerEntry] = {}
    for span, where, data in manifests:
        for entry in read_manifest(where, span, data, version):
            named = (span[0], span[1] + entry.line - 1)
            if named in entries and entries[named].record != entry.record:
                raise StoreError(
                    f"{entries[named].where} and {entry.where} record {entry.record.file} "
                    "differently: the store is damaged"
                )
            entries[named] = entry
    for named, where, data in records:
        if named not in entries:
            entries[named] = read_commit_record(where, named, data, version)
    return list(entries.values())


def _seq(record: ShardRecord) -> int:
    named = shard_rank_and_seq(record.file)
    assert named is not None  # a parsed record names a shard
    return named[1]
