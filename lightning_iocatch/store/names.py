"""The store's own files: their names, opening them safely, and ``store.json``.

A store is a directory::

    store.json                      what was captured, how, with which library versions
    shard-r{rank}-{seq}.safetensors captured tensors: "b{j}/{key}" and "b{j}/__index__"
    ledger-r{rank}.jsonl            one JSON line per complete shard, appended after it

A shard exists under its final name only once complete (written to ``.tmp``, fsynced,
renamed), and counts only once its ledger line is written (see
:mod:`lightning_iocatch.store.ledger`). Anything else in the directory (a ``.tmp`` file, a shard
without a ledger line) is debris of an interrupted run.

A store reads and writes only its own files, directly inside its directory: ``store.json``,
``ledger-r{rank:03d}.jsonl`` and ``shard-r{rank:03d}-{seq:06d}.safetensors`` (plus ``.tmp``
while being written). A ledger record naming anything else (``../x``, an absolute path, a
name that is not a shard of the ledger's own rank) is damage. A symbolic link is read only
where it resolves to a file directly inside the directory, and never written through.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import IO, Any, Literal

from lightning_iocatch.errors import StoreError

__all__ = [
    "FORMAT",
    "INDEX_KEY",
    "POSITION_KEY",
    "RESERVED_KEYS",
    "TOKEN_ID_KEY",
    "READABLE_FORMATS",
    "STORE_FILE",
    "check_own_path",
    "check_store_json",
    "fsync_dir",
    "is_serializer_temp",
    "is_store_file",
    "ledger_name",
    "ledger_rank",
    "open_own_file",
    "read_store_json",
    "shard_name",
    "shard_rank_and_seq",
    "write_all",
    "write_json_atomic",
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


# Paths: only the store's own files, directly inside its directory


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


def write_all(handle: IO[bytes], data: bytes | memoryview) -> None:
    """Write all of ``data`` to an unbuffered ``handle`` (which may write less per call)."""
    view = memoryview(data)
    while view:
        written = handle.write(view)
        view = view[written or 0 :]


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
