"""The store's names: its files and objects, its reserved keys, its format, ``store.json``.

A store is a directory (or a prefix on object storage)::

    store.json                      what was captured, how, with which library versions
    shard-r{rank}-{seq}.safetensors captured tensors: "b{j}/{key}" and "b{j}/__index__"
    ledger-r{rank}.jsonl            one JSON line per complete shard, appended after it (on disk)
    commits/r{rank}-{seq}.json      the record of one complete shard (on object storage)
    commits/r{rank}-{first}-{last}.jsonl  the records of a rank's shards first..last, one
                                    per line (on object storage: read in one request)

A shard counts only once its record is written: a ledger line (see
:mod:`lightning_iocatch.store.commits`) or a commit record. Anything else (a ``.tmp`` file, a
shard without a record) is debris of an interrupted run.

A store reads and writes only its own files, directly inside its directory: ``store.json``,
``ledger-r{rank:03d}.jsonl`` and ``shard-r{rank:03d}-{seq:06d}.safetensors`` (plus ``.tmp``
while being written). A ledger record naming anything else (``../x``, an absolute path, a
name that is not a shard of the ledger's own rank) is damage. A symbolic link is read only
where it resolves to a file directly inside the directory, and never written through.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning_iocatch.errors import StoreError

__all__ = [
    "COMMITS",
    "FORMAT",
    "INDEX_KEY",
    "POSITION_KEY",
    "RESERVED_KEYS",
    "TOKEN_ID_KEY",
    "READABLE_FORMATS",
    "STORE_FILE",
    "check_store_json",
    "commit_name",
    "commit_rank_and_seq",
    "is_commit_point",
    "is_own_object",
    "is_serializer_temp",
    "is_store_file",
    "ledger_name",
    "ledger_rank",
    "manifest_name",
    "manifest_span",
    "shard_name",
    "shard_rank_and_seq",
]

FORMAT = "lightning-iocatch-store/3"
READABLE_FORMATS = ("lightning-iocatch-store/1", "lightning-iocatch-store/2", FORMAT)
STORE_FILE = "store.json"
INDEX_KEY = "__index__"
# The coordinates of token rows (see lightning_iocatch.store.tokens), stored as ordinary keys
POSITION_KEY = "__position__"
TOKEN_ID_KEY = "__token_id__"
RESERVED_KEYS = (INDEX_KEY, POSITION_KEY, TOKEN_ID_KEY)
_SHARD = re.compile(r"shard-r([0-9]{3,})-([0-9]{6,})\.safetensors(\.tmp)?", re.ASCII)
_LEDGER = re.compile(r"ledger-r([0-9]{3,})\.jsonl", re.ASCII)
_SERIALIZER_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}", re.ASCII)  # safetensors' save_file


def shard_name(rank: int, seq: int) -> str:
    """The file name of a rank's ``seq``-th shard."""
    return f"shard-r{rank:03d}-{seq:06d}.safetensors"


def ledger_name(rank: int) -> str:
    """The file name of a rank's ledger."""
    return f"ledger-r{rank:03d}.jsonl"


def shard_rank_and_seq(name: str) -> tuple[int, int] | None:
    """``(rank, seq)`` of a finished shard's file name, else ``None``.

    Only the names :func:`shard_name` writes count (``shard-r0-1.safetensors`` does not).
    """
    match = _SHARD.fullmatch(name)
    if match is None or match.group(3):
        return None
    rank, seq = int(match.group(1)), int(match.group(2))
    return (rank, seq) if shard_name(rank, seq) == name else None


def ledger_rank(name: str) -> int | None:
    """The rank of a ledger's file name, else ``None``."""
    match = _LEDGER.fullmatch(name)
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if ledger_name(rank) == name else None


def is_store_file(name: str) -> bool:
    """True for every name a store writes (its own files, finished or not)."""
    if name in (STORE_FILE, STORE_FILE + ".tmp"):
        return True
    return (
        shard_rank_and_seq(name.removesuffix(".tmp")) is not None or ledger_rank(name) is not None
    )


def is_serializer_temp(name: str) -> bool:
    """True for the temporary names safetensors' ``save_file`` writes next to its target.

    ``save_file`` (safetensors 0.8) writes ``.tmp`` and six letters or digits, mode 0600,
    then renames it; a process killed meanwhile leaves it behind.
    """
    return _SERIALIZER_TEMP.fullmatch(name) is not None


COMMITS = "commits"


_COMMIT = re.compile(r"commits/r([0-9]{3,})-([0-9]{6,})\.json", re.ASCII)


def commit_name(rank: int, seq: int) -> str:
    """The name of the commit record of a rank's ``seq``-th shard."""
    return f"{COMMITS}/r{rank:03d}-{seq:06d}.json"


def commit_rank_and_seq(name: str) -> tuple[int, int] | None:
    """``(rank, seq)`` of a commit record's name, else ``None``."""
    match = _COMMIT.fullmatch(name)
    if match is None:
        return None
    rank, seq = int(match.group(1)), int(match.group(2))
    return (rank, seq) if commit_name(rank, seq) == name else None


_MANIFEST = re.compile(r"commits/r([0-9]{3,})-([0-9]{6,})-([0-9]{6,})\.jsonl", re.ASCII)


def manifest_name(rank: int, first: int, last: int) -> str:
    """The name of the manifest of a rank's shards ``first`` to ``last``: their commit
    records, one per line, so that a reader gets them in one request."""
    return f"{COMMITS}/r{rank:03d}-{first:06d}-{last:06d}.jsonl"


def manifest_span(name: str) -> tuple[int, int, int] | None:
    """``(rank, first, last)`` of a manifest's name, else ``None``."""
    match = _MANIFEST.fullmatch(name)
    if match is None:
        return None
    rank, first, last = (int(group) for group in match.groups())
    ok = first <= last and manifest_name(rank, first, last) == name
    return (rank, first, last) if ok else None


def is_commit_point(name: str) -> bool:
    """True for a ledger, a commit record or a manifest: what makes a shard count."""
    return (
        commit_rank_and_seq(name) is not None
        or manifest_span(name) is not None
        or ledger_rank(name) is not None
    )


def is_own_object(name: str) -> bool:
    """True for every name a store writes on object storage (relative to its prefix)."""
    return (
        name == STORE_FILE
        or shard_rank_and_seq(name.removesuffix(".tmp")) is not None
        or is_commit_point(name)
    )


def check_store_json(data: Any, path: Path | str) -> dict[str, Any]:
    """``data`` read from ``store.json`` at ``path``, once it is a store's metadata this
    library reads; a :class:`StoreError` naming ``path`` and the problem otherwise."""
    if not isinstance(data, dict):
        raise StoreError(f"{path} is damaged: a JSON {type(data).__name__}, not an object")
    if data.get("format") not in READABLE_FORMATS:
        raise StoreError(
            f"{path} has format {data.get('format')!r}; this library reads {READABLE_FORMATS}"
        )
    expected = {"spec": (str, type(None)), "stage": (str,), "dtype": (str, type(None))}
    for name, types in expected.items():
        if name in data and not isinstance(data[name], types):
            raise StoreError(f"{path} is damaged: `{name}` is {data[name]!r}")
    libraries = data.get("libraries", {})
    if not isinstance(libraries, dict) or not all(isinstance(v, str) for v in libraries.values()):
        raise StoreError(f"{path} is damaged: `libraries` is {libraries!r}")
    world_size = data.get("world_size", 0)
    if type(world_size) is not int or world_size < 0:
        raise StoreError(f"{path} is damaged: `world_size` is {world_size!r}")
    return data
