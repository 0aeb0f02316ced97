"""Commit records a manifest already holds, left on object storage by a kill between the
manifest's write and the deletes of the records it gathers (issue 28, item 8a).

The kill is simulated deterministically: the delete step raises a ``BaseException`` as a
kill would end the process there. The ground truth is the same batches dumped without a
kill, to a local directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_iocatch.store.backends.object_records as object_records
from lightning_iocatch import FeatureStore, StoreError
from lightning_iocatch.store.backends.manifests import manifest
from lightning_iocatch.store.backends.object_location import ObjectLocation
from lightning_iocatch.store.commits import read_commit_record
from lightning_iocatch.store.names import FORMAT, commit_name, commit_rank_and_seq, manifest_span
from lightning_iocatch.store.records import format_version
from tests.store.test_object_store import N, batches, dump, object_location, objects


class Killed(BaseException):
    """What the process's end looks like to the code it interrupts."""


def kill_at_record_deletes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the deletes of the records a manifest gathers end the run, once the manifest
    is written."""

    def killed(location: ObjectLocation, names: Iterable[str], **kw: Any) -> None:
        raise Killed

    monkeypatch.setattr(object_records, "delete_objects", killed)


def left_records(url: str) -> list[str]:
    return sorted(name for name in objects(url) if commit_rank_and_seq(name) is not None)


def held_by_a_manifest(url: str, name: str) -> bool:
    """Whether a manifest of the store at ``url`` now holds the commit record ``name`` as
    it is stored (its line, parsed, is the same record)."""
    stored = objects(url)
    rank, seq = commit_rank_and_seq(name) or (-1, -1)
    version = format_version(FORMAT)
    record = read_commit_record(name, (rank, seq), stored[name], version).record
    for other, data in stored.items():
        span = manifest_span(other)
        if span is not None and span[0] == rank and span[1] <= seq <= span[2]:
            line = data.split(b"\n")[seq - span[1]]
            if read_commit_record(other, (rank, seq), line, version).record == record:
                return True
    return False


def assert_equal_to_an_uninterrupted_dump(url: str, tmp_path: Path) -> None:
    data = batches()
    dump(tmp_path / "whole", data)
    store, whole = FeatureStore(url, verify=True), FeatureStore(tmp_path / "whole")
    assert store.indices.tolist() == list(range(N)) and store.duplicated_indices() == []
    for key in ("h/outputs", "h/inputs/args/0"):
        assert torch.equal(store[key], whole[key]), key
        assert torch.equal(store[key], torch.cat([t[key] for _, t in data])), key


def test_a_resume_deletes_the_records_a_manifest_holds_and_only_those(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the records stayed through any number of resumes (2 here, 46 on moto in
    the issue); the store read right, but ``commits/`` grew with every kill."""
    with monkeypatch.context() as patch:
        kill_at_record_deletes(patch)
        with pytest.raises(StoreError, match="Killed"):
            dump(url, batches()[:4])  # shards 0 and 1, then the manifest of both
    stored = objects(url)
    assert "commits/r000-000000-000001.jsonl" in stored
    assert left_records(url) == [commit_name(0, 0), commit_name(0, 1)]
    # A record no manifest holds: the manifest is cut back to shard 0 alone
    location = object_location(url)
    version = format_version(FORMAT)
    first = read_commit_record("", (0, 0), stored[commit_name(0, 0)], version).record
    location.fs.rm_file(location.path("commits/r000-000000-000001.jsonl"))
    name, data = manifest(0, [first])
    location.fs.pipe_file(location.path(name), data)
    # Every delete of a commit record during the resume: a manifest holds it already
    deleted: list[str] = []
    delete = object_records.delete_objects

    def checked(location: ObjectLocation, names: Iterable[str], **kw: Any) -> None:
        names = list(names)
        for name in names:
            if commit_rank_and_seq(name) is not None:
                assert held_by_a_manifest(url, name), f"{name} deleted, no manifest holds it"
                deleted.append(name)
        delete(location, names, **kw)

    monkeypatch.setattr(object_records, "delete_objects", checked)
    dump(url, batches(), mode="resume")
    assert sorted(deleted) == [commit_name(0, 0), commit_name(0, 1)] + [
        commit_name(0, seq) for seq in range(2, len(deleted))
    ]
    assert left_records(url) == []
    assert_equal_to_an_uninterrupted_dump(url, tmp_path)


def test_a_resume_killed_at_its_own_deletes_is_resumed_without_leftovers(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kill can also fall in the resume that gathers a killed run's records."""
    dump(url, batches()[:4])
    location = object_location(url)
    for name, data in objects(url).items():  # a run killed before its manifest
        span = manifest_span(name)
        if span is not None:
            for seq, line in enumerate(data.splitlines(keepends=True), span[1]):
                location.fs.pipe_file(location.path(commit_name(span[0], seq)), line)
            location.fs.rm_file(location.path(name))
    with monkeypatch.context() as patch:
        kill_at_record_deletes(patch)
        with pytest.raises(Killed):
            dump(url, batches(), mode="resume")
    assert left_records(url) == [commit_name(0, 0), commit_name(0, 1)]
    assert all(held_by_a_manifest(url, name) for name in left_records(url))
    dump(url, batches(), mode="resume")
    assert left_records(url) == []
    assert_equal_to_an_uninterrupted_dump(url, tmp_path)


def test_a_record_that_differs_from_the_manifest_holding_it_is_kept_and_named(
    url: str,
) -> None:
    dump(url, batches()[:4])
    location = object_location(url)
    stored = objects(url)
    line = stored["commits/r000-000000-000001.jsonl"].split(b"\n")[0] + b"\n"
    raw = bytearray(line)
    raw[raw.index(b'"rows":') + 7] ^= 0x01  # another row count, the same size
    location.fs.pipe_file(location.path(commit_name(0, 0)), bytes(raw))
    with pytest.raises(StoreError, match=r"r000-000000.json is damaged: its record_crc32"):
        dump(url, batches(), mode="resume")
    assert left_records(url) == [commit_name(0, 0)]
    # a valid record of other batches in shard 0's place: not what the manifest holds
    dump(url + "-other", [(list(range(40, 44)), t) for _, t in batches()[:2]])
    foreign = objects(url + "-other")["commits/r000-000000-000000.jsonl"]
    location.fs.pipe_file(location.path(commit_name(0, 0)), foreign)
    differ = r"r000-000000.json and .*r000-000000-000001.jsonl line 1 record shard-r000-000000"
    with pytest.raises(StoreError, match=differ):
        dump(url, batches(), mode="resume")
    assert objects(url)[commit_name(0, 0)] == foreign  # never deleted
    assert FeatureStore(url).indices.tolist() == list(range(16))  # the manifest's
