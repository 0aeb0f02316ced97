"""The backends' conformance: the same cases on a local directory, ``memory://`` and moto's
S3 server, through the one interface everything above the backends uses.

Round trip, a killed dump resumed with every sample once, overwrite keeping other files,
damage named, and stores copied between the kinds of place. The ground truth is the
batches themselves (written with the Trainer-free ``ShardWriter``) and, for the killed dump,
a manual forward of the dumped model (``truth`` of test_writer_resume.py). A real
``SIGKILL`` kills the dump on disk and on S3; ``memory://`` lives in one process, so there
the kill is what it leaves behind: committed shards, a shard uploaded without its commit
record, and a dump that stopped halfway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError, StoreRows
from lightning_iocatch.cli import main
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.lightning_models import trainer
from tests.s3_server import S3Server
from tests.store.test_writer_resume import (
    SHARD_BYTES,
    SPEC,
    Dump,
    N,
    indexed_loader,
    save_weights,
    truth,
)

pytestmark = pytest.mark.filterwarnings("ignore:predict returned None")  # skipped batches

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
KINDS = ["local", "memory", "s3"]


@dataclass
class Place:
    """Where a store lives, and its raw files or objects, reached without the library."""

    kind: str
    url: str
    options: dict[str, Any] | None
    fs: Any  # an fsspec filesystem
    root: str  # the store's path on ``fs``

    def raw(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> set[str]:
        found = self.fs.find(self.root) if self.fs.exists(self.root) else []
        return {path[len(self.root) + 1 :] for path in found}

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "local":
            Path(self.raw(name)).parent.mkdir(parents=True, exist_ok=True)
        self.fs.pipe_file(self.raw(name), data)

    def read(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(self.raw(name))
        return data

    def shards(self) -> list[str]:
        return sorted(n for n in self.names() if n.endswith(".safetensors"))


def make_place(kind: str, tmp_path: Path, request: pytest.FixtureRequest, name: str) -> Place:
    if kind == "local":
        path = tmp_path / name
        return Place(kind, str(path), None, fsspec.filesystem("file"), str(path))
    if kind == "memory":
        root = f"conformance-{uuid.uuid4().hex}/{name}"
        return Place(kind, f"memory://{root}", None, fsspec.filesystem("memory"), f"/{root}")
    server: S3Server = request.getfixturevalue("server")
    bucket = request.getfixturevalue("bucket")
    options = server.storage_options()
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    return Place(kind, f"s3://{bucket}/{name}", options, fs, f"{bucket}/{name}")


@pytest.fixture(params=KINDS)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    made = make_place(request.param, tmp_path, request, "store")
    yield made
    if made.kind == "memory" and made.fs.exists(made.root):
        made.fs.rm(made.root.rsplit("/", 1)[0], recursive=True)


def batches(n: int = 30) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Batches of 4: a bfloat16 key, a float32 key of 2-D rows, a per-batch key."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for start in range(0, n, 4):
        indices = list(range(start, min(start + 4, n)))
        out.append(
            (
                indices,
                {
                    "h/outputs": torch.randn(len(indices), 6, generator=generator).bfloat16(),
                    "h/inputs/args/0": torch.randn(len(indices), 2, 3, generator=generator),
                    "rotary": torch.randn(1, 3, generator=generator),
                },
            )
        )
    return out


def write(place: Place, data: list[Any], mode: str = "create", shard: int = 300) -> None:
    plan = prepare_store(place.url, mode, SETTINGS, storage_options=place.options)  # type: ignore[arg-type]
    writer = ShardWriter(
        place.url, rank=0, plan=plan, max_shard_bytes=shard, storage_options=place.options
    )
    for indices, tensors in data:
        writer.write(tensors, indices)
    writer.close()


def assert_holds(place: Place, data: list[Any]) -> None:
    """The store at ``place`` holds exactly ``data``: every row and per-batch tensor."""
    store = FeatureStore(place.url, storage_options=place.options, verify=True)
    every = sorted(i for indices, _ in data for i in indices)
    assert store.indices.tolist() == every and store.duplicated_indices() == []
    for key in ("h/outputs", "h/inputs/args/0"):
        expected = torch.cat([tensors[key] for _, tensors in data])
        order = torch.argsort(torch.tensor([i for indices, _ in data for i in indices]))
        assert torch.equal(store[key], expected[order]), key
    rotary = {tuple(i.tolist()): t for i, t in store.batches("rotary")}
    assert {tuple(i): t for i, t in data}.keys() == rotary.keys()
    assert all(torch.equal(rotary[tuple(i)], t["rotary"]) for i, t in data)


def inspect(place: Place, *args: str) -> int:
    options = ["--storage-options", json.dumps(place.options)] if place.options else []
    return main(["inspect", place.url, *options, *args])


def test_a_round_trip_reads_every_row_as_written(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    data = batches()
    write(place, data)
    assert_holds(place, data)
    rows = StoreRows(place.url, "h/outputs", batch_size=7, with_indices=True,
                     storage_options=place.options)  # fmt: skip
    read = list(rows)  # rows gathered by byte offsets, against the reader's whole tensors
    index = torch.cat([b["index"] for b in read])
    assert sorted(index.tolist()) == list(range(30))
    store = FeatureStore(place.url, storage_options=place.options)
    assert torch.equal(
        torch.cat([b["h/outputs"] for b in read])[index.argsort()], store["h/outputs"]
    )
    source = store._sources[0]  # any offsets, adjacent or not, in any order, by every backend
    span = source.spans()["b0/h/outputs"]
    width = (span.end - span.start) // span.shape[0]
    whole = source.read(["b0/h/outputs"])["b0/h/outputs"].reshape(span.shape[0], -1)
    rows_wanted = torch.tensor([3, 0, 1, 2, 3, 2])[: span.shape[0]]
    offsets = (span.start + rows_wanted * width).numpy()
    gathered = torch.from_numpy(source.gather(offsets, width)).view(whole.dtype)
    assert torch.equal(gathered.reshape(len(rows_wanted), -1), whole[rows_wanted])
    capsys.readouterr()
    assert inspect(place, "--verify", "--expected", "30") == 0
    out = capsys.readouterr().out
    where, point = ("on disk", "ledger line") if place.kind == "local" else (
        "under the prefix", "commit record")  # fmt: skip
    assert where in out and f"every {point} and every shard match" in out


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_weights(tmp_path_factory.mktemp("weights"))


def killed_dump(place: Place, weights: Path) -> None:
    """A dump cut short at batch 9 of 15: SIGKILLed in its own process on disk and on S3;
    on ``memory://``, what a kill leaves behind (a dump that stopped there, and a shard
    uploaded without its commit record)."""
    if place.kind == "memory":
        from torch.utils.data import DataLoader, Subset

        writer = FeatureWriter(place.url, max_shard_bytes=SHARD_BYTES)
        loader = indexed_loader(4)
        first = DataLoader(Subset(loader.dataset, range(36)), batch_size=4)
        trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(
            Dump(weights), first, return_predictions=False
        )
        place.write(f"shard-r000-{len(place.shards()):06d}.safetensors", b"uploaded, no record")
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DUMP_WEIGHTS": str(weights)}
    options = ["--storage-options", json.dumps(place.options)] if place.options else []
    command = [sys.executable, "tests/scripts/dump_features.py", place.url, *options]
    result = subprocess.run(
        [*command, "--kill-at-batch", "9"], cwd=ROOT, env=env, capture_output=True, timeout=240
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]


@pytest.mark.parametrize(  # on S3 (a process killed: 9 s): in `make test-slow`
    "place", ["local", "memory", pytest.param("s3", marks=pytest.mark.soak)], indirect=True
)
def test_a_killed_dump_resumes_with_every_sample_once(place: Place, weights: Path) -> None:
    killed_dump(place, weights)
    committed = FeatureStore(place.url, storage_options=place.options).indices.tolist()
    assert 0 < len(committed) < N and committed == list(range(len(committed)))
    before = FeatureStore(place.url, storage_options=place.options).metadata["shards"]
    kept = {name: place.read(name) for name in before}  # committed: never rewritten
    module = Dump(weights)
    writer = FeatureWriter(
        place.url, mode="resume", max_shard_bytes=SHARD_BYTES, storage_options=place.options
    )
    trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(
        module,
        indexed_loader(5),
        return_predictions=False,  # another batch size
    )
    first = len(committed) // 5 * 5  # batches of 5: only those holding a new sample run
    assert module.computed == list(range(first, N))
    store = FeatureStore(place.url, storage_options=place.options, verify=True)
    assert store.indices.tolist() == list(range(N))
    for key, rows in truth(weights).items():
        assert torch.equal(store[key], rows), key
    assert all(place.read(name) == data for name, data in kept.items())
    assert not [n for n in place.names() if n.endswith(".tmp")]


def test_overwrite_deletes_the_stores_own_files_and_keeps_every_other(place: Place) -> None:
    write(place, batches())
    others = {"notes.txt": b"mine", "sub/keep.bin": b"\0\1", "commits/README": b"not a record"}
    for name, data in others.items():
        place.write(name, data)
    with pytest.raises(StoreError, match=r"is not empty; use FeatureWriter\(\.\.\., mode='resume'"):
        prepare_store(place.url, "create", SETTINGS, storage_options=place.options)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="nothing to resume in .*: it holds no store.json"):
        prepare_store(place.url + "-other", "resume", SETTINGS, storage_options=place.options)  # type: ignore[arg-type]
    data = batches(10)
    write(place, data, mode="overwrite", shard=10**6)
    assert_holds(place, data)
    assert all(place.read(name) == value for name, value in others.items())
    own = {n for n in place.names() if n not in others}
    assert len([n for n in own if n.startswith("shard-")]) == 1


def damage(place: Place, how: str) -> str:
    """Damage the store at ``place`` as ``how`` says; the message that must name it."""
    first = place.shards()[0]
    records = sorted(n for n in place.names() if n.startswith(("ledger-", "commits/r")))
    if how == "truncated shard":
        place.write(first, place.read(first)[:-10])
        return rf"shard .*{first} is \d+ bytes, its record says \d+"
    if how == "missing shard":
        place.fs.rm_file(place.raw(first))
        return rf"shard .*{first} is committed .*missing"
    if how == "changed record":
        raw = place.read(records[0])
        # the ledger, or the manifest that a reader reads instead of the commit records:
        # the last digit of its first CRC-32 (the first batch's index summary)
        digit = raw.index(b",", raw.index(b'"crc32":')) - 1
        changed = bytes([ord("0") + (raw[digit] - ord("0") + 1) % 10])
        place.write(records[0], raw[:digit] + changed + raw[digit + 1 :])
        return rf"{records[0]}.* is damaged: its record_crc32 does not match its content"
    raw = bytearray(place.read(first))  # "flipped index": bit 40 of the first row's index
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(bytes(raw[8 : 8 + length]))
    raw[8 + length + header["b0/__index__"]["data_offsets"][0] + 5] ^= 0x01
    place.write(first, bytes(raw))
    return rf"{first} batch 0: its __index__ does not match the CRC-32 its record gives"


@pytest.mark.parametrize("how", ["truncated shard", "missing shard", "changed record",
                                 "flipped index"])  # fmt: skip
def test_damage_is_an_error_naming_what_is_damaged(
    place: Place, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damage to the records or to a shard's size is found by opening and by a resume; a
    flipped index, when it is read (the records' index summaries are what open and resume
    trust, and they are right), and by ``inspect --verify``."""
    write(place, batches())
    match = damage(place, how)
    with pytest.raises(StoreError, match=match):
        _ = FeatureStore(place.url, storage_options=place.options).indices
    if how != "flipped index":
        with pytest.raises(StoreError, match=match):
            prepare_store(place.url, "resume", SETTINGS, storage_options=place.options)  # type: ignore[arg-type]
    capsys.readouterr()
    assert inspect(place, "--verify") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def copy_store(source: Place, target: Place) -> None:
    """Every file or object of ``source`` to ``target``, bytes as they are (``aws s3 sync``)."""
    for name in source.names():
        target.write(name, source.read(name))


@pytest.mark.parametrize("kind", ["memory", "s3"])
@pytest.mark.parametrize("direction", ["disk to objects", "objects to disk"])
def test_a_store_copied_between_disk_and_object_storage_reads_and_resumes(
    kind: str, direction: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    disk = make_place("local", tmp_path, request, "disk")
    objects = make_place(kind, tmp_path, request, "objects")
    source, target = (disk, objects) if direction == "disk to objects" else (objects, disk)
    data = batches()
    write(source, data[:4])
    copy_store(source, target)
    assert_holds(target, data[:4])
    write(target, data, mode="resume")  # the rest, committed in the target's own way
    assert_holds(target, data)
    points = {n.split("-")[0].split("/")[0] for n in target.names() if "-r000" in n or "/r0" in n}
    assert points >= {"ledger", "commits"}  # both commit points, each counted once
