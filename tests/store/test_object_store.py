"""The object-store commit protocol, on fsspec's ``memory://`` (fast; S3 itself: test_s3.py).

The ground truth is the same batches written to a local directory with the POSIX protocol:
a store on object storage must read exactly like it, hold the same shard bytes, and commit
the same records. A shard object counts only once its commit record exists.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, FeatureWriter, StoreError
from lightning_iocatch.cli import main
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.backends.object_location import ObjectLocation
from lightning_iocatch.store.backends.objects import ObjectBackend
from lightning_iocatch.store.names import commit_name, manifest_span
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import StoreRows
from lightning_iocatch.store.writer import ShardWriter

SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
N = 30


class CountingMemoryFileSystem(MemoryFileSystem):
    """``memory://`` that counts the bytes each read returns (``countingmemory://``)."""

    protocol = "countingmemory"
    read_bytes = 0
    reads = 0

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        data: bytes = super().cat_file(path, start=start, end=end, **kw)
        CountingMemoryFileSystem.read_bytes += len(data)
        CountingMemoryFileSystem.reads += 1
        return data


fsspec.register_implementation("countingmemory", CountingMemoryFileSystem, clobber=True)


def object_location(url: str, options: dict[str, Any] | None = None) -> ObjectLocation:
    """The prefix of the store at ``url``, for requests made by hand."""
    backend = open_backend(url, options)
    assert isinstance(backend, ObjectBackend)
    return backend.location


def batches(n: int = N, width: int = 6) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Batches of 4 with a bfloat16 key, a float32 key and a per-batch key."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for start in range(0, n, 4):
        indices = list(range(start, min(start + 4, n)))
        rows = len(indices)
        tensors = {
            "h/outputs": torch.randn(rows, width, generator=generator).to(torch.bfloat16),
            "h/inputs/args/0": torch.randn(rows, 2, 3, generator=generator),
            "rotary": torch.randn(1, 3, generator=generator),
        }
        out.append((indices, tensors))
    return out


def dump(
    path: str | Path, data: list[Any], mode: str = "create", shard: int = 300, **kw: Any
) -> None:
    plan = prepare_store(path, mode, SETTINGS)  # type: ignore[arg-type]
    writer = ShardWriter(path, rank=0, plan=plan, max_shard_bytes=shard, **kw)
    for indices, tensors in data:
        writer.write(tensors, indices)
    writer.close()


def objects(url: str) -> dict[str, bytes]:
    location = object_location(url)
    fs = location.fs
    return {path[len(location.root) + 1 :]: fs.cat_file(path) for path in fs.find(location.root)}


def test_a_store_on_object_storage_reads_like_the_same_store_on_disk(
    tmp_path: Path, url: str
) -> None:
    data = batches()
    dump(tmp_path / "local", data)
    dump(url, data)
    local, remote = FeatureStore(tmp_path / "local"), FeatureStore(url, verify=True)
    assert remote.keys() == local.keys() and torch.equal(remote.indices, torch.arange(N))
    for key in ("h/outputs", "h/inputs/args/0"):
        assert remote[key].dtype == local[key].dtype
        assert torch.equal(remote[key], local[key]), key
        assert torch.equal(remote[key], torch.cat([t[key] for _, t in data])), key
    remote_batches = list(remote.batches("rotary"))
    assert len(remote_batches) == len(data)
    for (indices, tensor), (want_indices, want) in zip(remote_batches, data, strict=True):
        assert indices.tolist() == want_indices and torch.equal(tensor, want["rotary"])
    meta_local, meta_remote = local.metadata, remote.metadata
    for field in ("keys", "per_batch", "shards", "ranks", "bytes", "rows", "format"):
        assert meta_remote[field] == meta_local[field], field
    # The same bytes: each shard object is the local shard; the manifest the writer wrote
    # as it closed holds the ledger's lines (the commit records it gathered are deleted)
    stored = objects(url)
    records = read_ledgers(tmp_path / "local")
    for record in records:
        assert stored[record.file] == (tmp_path / "local" / record.file).read_bytes()
    manifest = f"commits/r000-000000-{len(records) - 1:06d}.jsonl"
    assert stored[manifest] == (tmp_path / "local" / "ledger-r000.jsonl").read_bytes()
    assert set(stored) == {"store.json", manifest} | {r.file for r in records}
    # The training reader streams the same batches, in the same order
    local_rows = StoreRows(
        tmp_path / "local", ["h/outputs", "h/inputs/args/0"], batch_size=7, with_indices=True
    )
    remote_rows = StoreRows(url, ["h/outputs", "h/inputs/args/0"], batch_size=7, with_indices=True)
    for a, b in zip(
        DataLoader(local_rows, batch_size=None),
        DataLoader(remote_rows, batch_size=None),
        strict=True,
    ):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def download(url: str, directory: Path) -> Path:
    """Every object of the store at ``url`` as a file under ``directory``."""
    for name, raw in objects(url).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(raw)
    return directory


def killed_before_its_manifest(url: str) -> None:
    """Turn each manifest back into the commit records it gathered: what a dump killed
    before its writer closed leaves."""
    location = object_location(url)
    for name, data in objects(url).items():
        span = manifest_span(name)
        if span is not None:
            rank, first, _ = span
            for seq, line in enumerate(data.splitlines(keepends=True), first):
                location.fs.pipe_file(location.path(commit_name(rank, seq)), line)
            location.fs.rm_file(location.path(name))


def test_a_shard_without_its_commit_record_does_not_exist_and_resume_deletes_only_it(
    url: str,
) -> None:
    data = batches()
    dump(url, data[:4])  # indices 0..15, a shard (300 bytes) per two batches
    location = object_location(url)
    fs = location.fs
    killed_before_its_manifest(url)
    last = sorted(name for name in objects(url) if name.startswith("commits/"))[-1]
    fs.rm(location.path(last))  # killed between the shard upload and its commit record
    fs.pipe_file(location.path("notes.txt"), b"mine")
    fs.pipe_file(location.path("commits/README"), b"mine too")
    fs.pipe_file(location.path("shard-r0-1.safetensors"), b"not a name the store writes")
    store = FeatureStore(url)
    assert store.indices.tolist() == list(range(8))  # the uncommitted shard does not count
    orphan = "shard-r000-000001.safetensors"
    assert orphan in objects(url)
    dump(url, data, mode="resume")
    left = objects(url)
    assert left["notes.txt"] == b"mine" and left["commits/README"] == b"mine too"
    assert "shard-r0-1.safetensors" in left
    store = FeatureStore(url)
    assert store.indices.tolist() == list(range(N)) and store.duplicated_indices() == []
    assert torch.equal(store["h/outputs"], torch.cat([t["h/outputs"] for _, t in data]))
    commits = sorted(name for name in left if name.startswith("commits/r"))
    shards = sorted(name for name in left if name.startswith("shard-r000"))
    # the resume gathered the killed run's records (shard 0) into a manifest, the resumed
    # writer its own (1..): one record per shard, and no commit record left on its own
    assert commits == [
        "commits/r000-000000-000000.jsonl",
        f"commits/r000-000001-{len(shards) - 1:06d}.jsonl",
    ]


def test_opening_reads_headers_and_a_key_reads_only_its_tensors() -> None:
    url = f"countingmemory://iocatch-tests/{uuid.uuid4().hex}/run"
    data = batches(n=64, width=4096)  # bfloat16 rows of 8 KiB next to small float32 ones
    dump(url, data, shard=200_000)  # about 3 shards of 200 KB
    total = sum(len(v) for k, v in objects(url).items() if k.startswith("shard-"))
    CountingMemoryFileSystem.read_bytes = 0
    store = FeatureStore(url)
    opened = CountingMemoryFileSystem.read_bytes
    assert opened < 0.05 * total, (opened, total)  # headers, indices and commit records
    CountingMemoryFileSystem.read_bytes = 0
    small = store["h/inputs/args/0"]
    assert CountingMemoryFileSystem.read_bytes <= small.numel() * 4 + 64 << 10
    CountingMemoryFileSystem.read_bytes = 0
    big = store["h/outputs"]
    assert big.numel() * 2 <= CountingMemoryFileSystem.read_bytes < 1.1 * big.numel() * 2
    assert torch.equal(big, torch.cat([t["h/outputs"] for _, t in data]))
    location = object_location(url)
    location.fs.rm(location.fs.find(location.root))


def test_feature_writer_inspect_and_export_take_urls(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump(url, batches())
    assert main(["inspect", url, "--verify", "--expected", str(N)]) == 0
    printed = capsys.readouterr().out
    assert f"rows       {N}" in printed and "under the prefix" in printed
    assert "every commit record and every shard match their CRC-32" in printed
    assert main(["inspect", url + "-missing"]) == 2
    assert "is not a feature store: it has no store.json" in capsys.readouterr().err
    prepare_store(url + "-empty", "create", SETTINGS)
    assert main(["inspect", url + "-empty"]) == 0
    assert "indices    none: nothing is committed yet" in capsys.readouterr().out
    options = json.dumps({"skip_instance_cache": True})
    out = tmp_path / "exported"
    args = ["export", url, str(out), "--keys", "h/outputs", "--storage-options", options]
    assert main(args) == 0
    from datasets import load_from_disk

    exported = load_from_disk(str(out)).with_format("torch")[:]
    want = torch.cat([t["h/outputs"] for _, t in batches()]).float()
    assert torch.equal(exported["h/outputs"], want[exported["index"]])
    assert sorted(exported["index"].tolist()) == list(range(N))
    # file:// is a local path: the POSIX protocol, a ledger
    writer = FeatureWriter(f"file://{tmp_path}/local")
    assert str(writer.path) == str(tmp_path / "local")


@pytest.mark.parametrize(
    ("path", "options", "error", "match"),
    [
        ("nosuchprotocol://b/run", None, StoreError, "cannot open nosuchprotocol://b/run"),
        ("memory://", None, StoreError, r"names no bucket; write memory://BUCKET/PREFIX, e\.g\."),
        ("memory://b/", None, StoreError, r"names a bucket but no prefix .* memory://b/features$"),
        ("s3:/b/run", None, StoreError, r"did you mean s3://b/run\?"),
        ("features/", {"key": "k"}, ValueError, "`storage_options` apply to fsspec URLs"),
        ("memory://b/run", ["key"], TypeError, "`storage_options` must be a dict"),
    ],
)
def test_bad_locations_are_refused_with_one_clear_error(
    path: str, options: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        FeatureStore(path, storage_options=options)
    with pytest.raises(error, match=match):
        FeatureWriter(path, storage_options=options)


def test_an_object_location_pickles_without_its_filesystem(url: str) -> None:
    import pickle

    location = object_location(url, {"skip_instance_cache": True})
    copy = pickle.loads(pickle.dumps(location))
    assert copy == location and copy.options == {"skip_instance_cache": True}
    assert "_fs" not in json.dumps(location.__getstate__())


class QuietDeleteFileSystem(MemoryFileSystem):
    """``memory://`` whose deletes report success and do nothing, as S3's batch delete does
    for keys it denies (``quietdelete://``, the same objects as ``memory://``)."""

    protocol = "quietdelete"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(super()._strip_protocol(path.removeprefix("quietdelete://")))

    def rm_file(self, path: str) -> None:
        pass


fsspec.register_implementation("quietdelete", QuietDeleteFileSystem, clobber=True)


def test_objects_a_delete_left_behind_are_an_error_not_an_old_store(url: str) -> None:
    quiet = url.replace("memory://", "quietdelete://")
    dump(url, batches()[:4])  # 16 indices in 2 shards
    location = object_location(url)
    before = objects(url)
    left = "are still there after the filesystem reported them deleted: store.json;"
    with pytest.raises(StoreError, match=rf"{left} .*missing s3:DeleteObject permission"):
        dump(quiet, batches()[:1], mode="overwrite")
    assert objects(url) == before  # nothing written over the old store
    killed_before_its_manifest(url)
    location.fs.rm_file(location.path("commits/r000-000001.json"))  # its shard: uncommitted
    with pytest.raises(StoreError, match=r"still there .*: shard-r000-000001.safetensors;"):
        dump(quiet, batches(), mode="resume")
    assert FeatureStore(url).indices.tolist() == list(range(8))


def test_a_store_copied_between_disk_and_object_storage_reads_and_resumes(
    tmp_path: Path, url: str
) -> None:
    data, local = batches(), tmp_path / "local"
    want = torch.cat([t["h/outputs"] for _, t in data])
    dump(local, data[:4])  # 16 indices, in ledger-r000.jsonl
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    for file in local.iterdir():  # as `aws s3 sync` copies it
        fs.pipe_file(f"{root}/{file.name}", file.read_bytes())
    copied = objects(url)
    store = FeatureStore(url, verify=True)
    assert store.indices.tolist() == list(range(16)) and torch.equal(store["h/outputs"], want[:16])
    dump(url, data, mode="resume")  # the ledger's shards are committed: kept, not rewritten
    after = objects(url)
    assert all(after[name] == copied[name] for name in copied)
    store = FeatureStore(url)
    assert store.indices.tolist() == list(range(N)) and torch.equal(store["h/outputs"], want)
    # ... and a store on object storage downloaded to disk keeps its commits/ folder: the
    # ledger copied there, the resumed writer's manifest, or a killed run's commit records
    with_manifests = download(url, tmp_path / "with-manifests")
    assert [p.name for p in with_manifests.glob("commits/*")] == ["r000-000002-000003.jsonl"]
    assert FeatureStore(with_manifests, verify=True).indices.tolist() == list(range(N))
    killed_before_its_manifest(url)
    down = download(url, tmp_path / "down")
    store = FeatureStore(down, verify=True)
    assert store.indices.tolist() == list(range(N)) and torch.equal(store["h/outputs"], want)
    max(down.glob("commits/r*.json")).unlink()  # the last shard: uncommitted
    dump(down, data, mode="resume")
    assert torch.equal(FeatureStore(down)["h/outputs"], want)
    # overwrite deletes either layout's commit points
    dump(down, data[:1], mode="overwrite")
    dump(url, data[:1], mode="overwrite")
    assert not (down / "commits").exists() and "ledger-r000.jsonl" not in objects(url)
    assert FeatureStore(down).indices.tolist() == FeatureStore(url).indices.tolist() == [0, 1, 2, 3]


def test_a_prefix_with_glob_characters_touches_only_its_own_objects(url: str) -> None:
    data = batches()
    neighbours = {name: url.replace("/run", name) for name in ("/br1", "/run-2", "/rux")}
    for neighbour in neighbours.values():
        dump(neighbour, data[:2])
    kept = {name: objects(neighbour) for name, neighbour in neighbours.items()}
    for name in ("/br[1]", "/run*", "/ru?"):
        prefix = url.replace("/run", name)
        dump(prefix, data[2:4])
        store = FeatureStore(prefix)
        assert store.indices.tolist() == list(range(8, 16))
        dump(prefix, data[:1], mode="overwrite")
        location = object_location(prefix)
        location.fs.pipe_file(location.path("shard-r000-000003.safetensors"), b"debris")
        dump(prefix, data[:2], mode="resume")
        assert FeatureStore(prefix).indices.tolist() == list(range(8))
    assert {name: objects(neighbour) for name, neighbour in neighbours.items()} == kept


def test_a_url_holding_the_word_bucket_without_a_store_is_not_a_store() -> None:
    """Before: "create the bucket first", chosen by the word "bucket" in the message."""
    url = f"memory://my-bucket-{uuid.uuid4().hex[:8]}/bucket-runs/a"
    with pytest.raises(StoreError, match=rf"^{url} is not a feature store: it has no store"):
        FeatureStore(url)


def test_a_manifest_is_a_commit_point_checked_like_a_record(url: str) -> None:
    """A writer that closes gathers its commit records into a manifest and deletes them; a
    reader fetches the manifest alone. Its lines carry their own checksums; a record a kill
    left next to it is skipped; two manifests must agree; a shard it names that is gone is
    named when it is first read (opening lists no shard)."""
    dump(url, batches()[:4])
    location = object_location(url)
    manifest = next(name for name in objects(url) if name.endswith(".jsonl"))
    assert not [name for name in objects(url) if name.endswith(".json") and "commits/" in name]
    data = location.fs.cat_file(location.path(manifest))
    first_line = data.splitlines(keepends=True)[0]
    location.fs.pipe_file(location.path(commit_name(0, 0)), first_line)  # left by a kill
    assert FeatureStore(url).indices.tolist() == list(range(16))
    location.fs.pipe_file(location.path("commits/r000-000000-000000.jsonl"), first_line)
    assert FeatureStore(url).indices.tolist() == list(range(16))  # two that agree
    raw = bytearray(data)
    raw[raw.index(b'"rows":') + 7] ^= 0x01  # a digit of the first batch's rows
    location.fs.pipe_file(location.path(manifest), bytes(raw))
    with pytest.raises(StoreError, match=rf"{manifest} line 1 is damaged: its record_crc32"):
        FeatureStore(url)
    location.fs.pipe_file(location.path(manifest), data)
    location.fs.rm_file(location.path("shard-r000-000001.safetensors"))
    store = FeatureStore(url)
    missing = rf"shard-r000-000001.safetensors is committed \(.*{manifest} line 2\) but missing"
    with pytest.raises(StoreError, match=missing):
        store.rows("h/outputs")
