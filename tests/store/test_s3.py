"""Feature stores on a real S3-protocol server: moto's, started here on 127.0.0.1, with s3fs.

The ground truth is a manual forward of the same weights (``truth`` of
tests/store/test_writer_resume.py) and the same dump written to a local directory. Killed dumps
are real ``SIGKILL``s of tests/scripts/dump_features.py, and the DDP dump is two real
processes; they reach the server over the loopback address. Every test skips when moto's
server or s3fs is missing or the server cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback, StoreError
from lightning_iocatch.cli import main
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.training import StoreRows
from tests.lightning_models import trainer
from tests.s3_server import S3Server
from tests.store.test_object_store import batches, dump, object_location
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


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_weights(tmp_path_factory.mktemp("weights"))


def run_dump(url: str, options: dict[str, Any], weights: Path, *args: str) -> int:
    """tests/scripts/dump_features.py in its own process(es); its return code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DUMP_WEIGHTS": str(weights)}
    script = ROOT / "tests/scripts/dump_features.py"
    command = [sys.executable, str(script), url, "--storage-options", json.dumps(options), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode in (0, -signal.SIGKILL), result.stderr[-3000:]
    return result.returncode


def assert_truth(store: FeatureStore, weights: Path) -> None:
    assert store.indices.tolist() == list(range(N)) and store.duplicated_indices() == []
    expected = truth(weights)
    assert store.keys() == sorted(expected)
    for key, rows in expected.items():
        assert torch.equal(store[key], rows), key
    store.verify()


def test_a_trainer_dump_to_s3_reads_back_row_for_row(
    server: S3Server, bucket: str, weights: Path, tmp_path: Path
) -> None:
    url, options = f"s3://{bucket}/run", server.storage_options()
    for path, opts in ((url, options), (tmp_path / "local", None)):
        writer = FeatureWriter(path, max_shard_bytes=SHARD_BYTES, storage_options=opts)
        dump = trainer([IOCaptureCallback(SPEC, writer=writer)])
        dump.predict(Dump(weights), indexed_loader(4), return_predictions=False)
    server.taken()
    store = FeatureStore(url, storage_options=options)
    opening = server.taken()
    assert_truth(store, weights)
    local = read_ledgers(tmp_path / "local")
    assert store.metadata["shards"] == [record.file for record in local]
    # Opening: store.json, a listing of commits/ and one of the ledgers (neither pages
    # through the shards), and the manifest the writer wrote as it closed; nothing of a shard
    assert [r.path.rsplit("/", 2)[-2:] for r in opening if r.method == "GET" and not r.query] == [
        ["run", "store.json"],
        ["commits", f"r000-000000-{len(local) - 1:06d}.jsonl"],
    ]
    listings = [r.query.split("&")[1] for r in opening if "list-type=2" in r.query]
    assert listings == ["prefix=run%2Fcommits%2F", "prefix=run%2Fledger-"], opening
    assert len(opening) == 5, opening
    # The training reader streams the same batches from S3 (one worker process) as locally
    keys = sorted(truth(weights))
    remote_rows = StoreRows(url, keys, batch_size=16, with_indices=True, storage_options=options)
    local_rows = StoreRows(tmp_path / "local", keys, batch_size=16, with_indices=True)
    remote = list(DataLoader(remote_rows, batch_size=None, num_workers=1))
    for a, b in zip(remote, DataLoader(local_rows, batch_size=None), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        main(
            [
                "inspect",
                url,
                "--verify",
                "--expected",
                str(N),
                "--storage-options",
                json.dumps(options),
            ]
        )
        == 0
    )


@pytest.mark.soak  # with test_backends.py's kill on S3; on disk and in memory: `make test`
def test_a_dump_to_s3_killed_with_sigkill_resumes_with_every_sample_once(
    server: S3Server, bucket: str, weights: Path
) -> None:
    """Besides test_backends.py's kill: an upload without its commit record is not read
    and is deleted by the resume."""
    url, options = f"s3://{bucket}/run", server.storage_options()
    assert run_dump(url, options, weights, "--kill-at-batch", "9") == -signal.SIGKILL
    committed = FeatureStore(url, storage_options=options).indices.tolist()
    assert 0 < len(committed) < N and committed == list(range(len(committed)))
    # A shard whose upload completed but whose commit record was never written does not count
    import s3fs  # present: the server fixture skips otherwise

    fs = s3fs.S3FileSystem(**options)
    seq = len(FeatureStore(url, storage_options=options).metadata["shards"])
    orphan = f"{bucket}/run/shard-r000-{seq:06d}.safetensors"
    fs.pipe_file(orphan, b"uploaded, never committed")
    assert FeatureStore(url, storage_options=options).indices.tolist() == committed
    module = Dump(weights)
    writer = FeatureWriter(url, mode="resume", max_shard_bytes=SHARD_BYTES, storage_options=options)
    trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(
        module, indexed_loader(4), return_predictions=False
    )
    assert module.computed == list(range(len(committed), N))  # committed rows not recomputed
    assert_truth(FeatureStore(url, storage_options=options), weights)
    fs.invalidate_cache()
    assert fs.cat_file(orphan) != b"uploaded, never committed"  # deleted, then written anew


@pytest.mark.soak  # 2-process dumps: test_writer_resume.py; S3: the tests above
def test_a_two_process_ddp_dump_to_s3(server: S3Server, bucket: str, weights: Path) -> None:
    url, options = f"s3://{bucket}/run", server.storage_options()
    assert run_dump(url, options, weights, "--devices", "2") == 0
    store = FeatureStore(url, storage_options=options)
    assert store.metadata["ranks"] == [0, 1] and store.metadata["world_size"] == 2
    assert_truth(store, weights)


def test_a_url_holding_the_word_bucket_is_told_what_is_really_wrong(
    server: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the error was chosen by matching "bucket" in the message, so an existing
    bucket named my-bucket without a store under the prefix got "create the bucket first"."""
    options = server.storage_options()
    name = f"my-bucket-{uuid.uuid4().hex[:8]}"
    server.make_bucket(name)
    for url in (f"s3://{name}/run", f"s3://{name}/bucket-runs/a"):
        with pytest.raises(StoreError, match=rf"^{url} is not a feature store: it has no store"):
            FeatureStore(url, storage_options=options)
        assert main(["inspect", url, "--storage-options", json.dumps(options)]) == 2
        assert "create the bucket" not in capsys.readouterr().err


def test_a_prefix_holding_only_folder_markers_is_empty(server: S3Server, bucket: str) -> None:
    """The S3 console's "Create folder" makes an empty object ``run/``; before, ``create``
    refused the prefix as not empty: "(it holds '')"."""
    options = server.storage_options()
    fs = object_location(f"s3://{bucket}/run", options).fs
    fs.pipe_file(f"{bucket}/run/", b"")
    fs.pipe_file(f"{bucket}/run/notes/", b"")
    dump(open_backend(f"s3://{bucket}/run", options), batches(3))
    assert len(FeatureStore(f"s3://{bucket}/run", storage_options=options)) > 0
    fs.pipe_file(f"{bucket}/other/kept.txt", b"a user's file")
    with pytest.raises(StoreError, match=r"is not empty; .*it holds 'kept.txt'"):
        prepare_store(f"s3://{bucket}/other", "create", SETTINGS, storage_options=options)


def test_a_missing_bucket_and_denied_credentials_give_one_clear_error(
    server: S3Server, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = server.storage_options()
    missing = "s3://iocatch-no-such-bucket/run"
    fix = "create the bucket first, or fix the URL"
    with pytest.raises(StoreError, match=rf"cannot list {missing}: .*bucket does not exist; {fix}"):
        prepare_store(missing, "create", SETTINGS, storage_options=options)
    with pytest.raises(StoreError, match=rf"cannot read {missing}/store.json: .*; {fix}"):
        FeatureStore(missing, storage_options=options)
    assert main(["inspect", missing, "--storage-options", json.dumps(options)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    prepare_store(f"s3://{bucket}/run", "create", SETTINGS, storage_options=options)
    server.deny_unknown_credentials(True)
    try:
        denied = server.storage_options(key="AKIAUNKNOWN", secret="wrong")
        check = "check the credentials in `storage_options`"
        with pytest.raises(
            StoreError, match=rf"access denied to s3://{bucket}/run \(list\): .*{check}"
        ):
            prepare_store(f"s3://{bucket}/run", "overwrite", SETTINGS, storage_options=denied)
        with pytest.raises(
            StoreError, match=rf"access denied to s3://{bucket}/run/store.json \(read\)"
        ):
            FeatureStore(f"s3://{bucket}/run", storage_options=denied)
    finally:
        server.deny_unknown_credentials(False)


def test_glob_characters_empty_tensors_and_quiet_deletes_on_s3(
    server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    options = server.storage_options()
    fs = s3fs.S3FileSystem(**options)
    data = [(i, {**t, "none": t["h/outputs"][:, :0]}) for i, t in batches()]
    dump(open_backend(f"s3://{bucket}/br1", options), data)  # the neighbour
    kept = fs.find(f"{bucket}/br1", detail=True)
    url = f"s3://{bucket}/br[1]"
    dump(open_backend(url, options), data[:2])
    dump(open_backend(url, options), data, mode="overwrite", shard=10)  # a batch a shard
    store = FeatureStore(url, storage_options=options)
    assert torch.equal(store["h/outputs"], torch.cat([t["h/outputs"] for _, t in data]))
    assert store["none"].shape == (len(store), 0) and store["none"].dtype == torch.bfloat16
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/br1", detail=True) == kept  # the neighbour is untouched

    async def deny_quietly(*args: Any, **kwargs: Any) -> list[str]:  # as a denied batch delete
        return []

    monkeypatch.setattr(s3fs.S3FileSystem, "_rm_file", deny_quietly)
    monkeypatch.setattr(s3fs.S3FileSystem, "_bulk_delete", deny_quietly)
    with pytest.raises(StoreError, match=r"still there .*: store.json; .*s3:DeleteObject"):
        prepare_store(url, "overwrite", SETTINGS, storage_options=options)
    assert torch.equal(FeatureStore(url, storage_options=options).indices, store.indices)


UNREACHABLE = {"endpoint_url": "http://127.0.0.1:9", "skip_instance_cache": True}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {**UNREACHABLE, "key": "k", "secret": "s"},
            r"cannot reach s3://b/run/store.json \(read\): EndpointConnectionError: .*; check "
            "the URL and `endpoint_url`",
        ),
        (UNREACHABLE, r"s3://b/run/store.json: no credentials \(NoCredentialsError: .*`key`"),
        (
            {"endpoint": "http://127.0.0.1:9", "key": "k", "secret": "s"},
            r"s3://b/run/store.json: `storage_options` holds an option the filesystem does not "
            r"take \(.*'endpoint'\); fix its name",
        ),
    ],
)
def test_an_unreachable_endpoint_no_credentials_or_a_bad_option_give_one_clear_error(
    options: dict[str, Any],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(StoreError, match=match):
        FeatureStore("s3://b/run", storage_options=options)
    assert main(["inspect", "s3://b/run", "--storage-options", json.dumps(options)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_records_a_kill_left_beside_their_manifest_on_s3_are_deleted_by_a_resume(
    server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the records the killed writer's manifest held stayed after the resume."""
    from tests.store.test_object_leftovers import Killed, kill_at_record_deletes

    url, options = f"s3://{bucket}/run", server.storage_options()
    fs = object_location(url, options).fs
    data = batches()
    with monkeypatch.context() as patch:
        kill_at_record_deletes(patch)
        with pytest.raises(StoreError, match=Killed.__name__):
            dump(open_backend(url, options), data[:4])

    def records() -> list[str]:
        fs.invalidate_cache()
        return sorted(p for p in fs.find(f"{bucket}/run/commits") if p.endswith(".json"))

    assert len(records()) == 2  # beside the manifest that holds them
    dump(open_backend(url, options), data, mode="resume")
    assert records() == []
    store = FeatureStore(url, storage_options=options, verify=True)
    assert store.indices.tolist() == list(range(len(store))) and store.duplicated_indices() == []
    assert torch.equal(store["h/outputs"], torch.cat([t["h/outputs"] for _, t in data]))
