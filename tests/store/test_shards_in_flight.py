"""Several shards in flight on object storage: uploads overlap, memory stays bounded, a
failed upload is raised and loses nothing committed.

The uploads are held at a gate (``ObjectBackend.write_shard`` waits for a test's word), so
what overlaps and what the writer holds meanwhile is seen, not timed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_iocatch import FeatureStore, StoreError
from lightning_iocatch.store import ShardWriter, prepare_store
from lightning_iocatch.store.backends.objects import ObjectBackend

SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
BATCHES = 10


class Gate:
    """Holds every upload until opened; counts the uploads running at once."""

    def __init__(self, fail_shard: str | None = None) -> None:
        self.open = threading.Event()
        self.running = self.most = self.started = 0
        self.lock = threading.Lock()
        self.fail_shard = fail_shard

    def wrap(self, write_shard: Any) -> Any:
        def gated(backend: ObjectBackend, name: str, write: Any, *, durable: bool) -> Any:
            with self.lock:
                self.running += 1
                self.started += 1
                self.most = max(self.most, self.running)
            try:
                assert self.open.wait(30)
                if name == self.fail_shard:
                    raise OSError("connection reset by peer")
                return write_shard(backend, name, write, durable=durable)
            finally:
                with self.lock:
                    self.running -= 1

        return gated


@pytest.fixture
def url() -> Iterator[str]:
    yield f"memory://in-flight-{uuid.uuid4().hex}/store"


def gated(monkeypatch: pytest.MonkeyPatch, **options: Any) -> Gate:
    gate = Gate(**options)
    monkeypatch.setattr(ObjectBackend, "write_shard", gate.wrap(ObjectBackend.write_shard))
    return gate


def feed(writer: ShardWriter, accepted: list[int]) -> threading.Thread:
    """Write :data:`BATCHES` batches of 4 rows from a thread, noting each accepted one."""

    def run() -> None:
        for batch in range(BATCHES):
            rows = torch.arange(batch * 4, batch * 4 + 4)
            writer.write({"h": rows[:, None].float()}, rows.tolist(), batch_idx=batch)
            accepted.append(batch)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def settled(read: Any, seconds: float = 1.0) -> Any:
    """``read()`` once it has not changed for ``seconds``."""
    value, since = read(), time.monotonic()
    while time.monotonic() - since < seconds:
        time.sleep(0.05)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


def test_uploads_overlap_and_the_writer_holds_what_its_bound_says(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 shards in flight, a queue of 2, a shard per batch: while every upload waits, the
    writer has taken 3 (uploading) + 1 (waiting for room) + 2 (queued) = 6 batches, and
    the 7th ``write`` blocks; once the uploads go on, every row is committed once."""
    gate = gated(monkeypatch)
    plan = prepare_store(url, "create", SETTINGS)
    writer = ShardWriter(url, rank=0, plan=plan, max_shard_bytes=1, queue_size=2,
                         shards_in_flight=3)  # fmt: skip
    accepted: list[int] = []
    thread = feed(writer, accepted)
    assert settled(lambda: (len(accepted), gate.running)) == (6, 3)
    gate.open.set()
    thread.join(30)
    writer.close()
    assert gate.most == 3 and gate.started == BATCHES
    store = FeatureStore(url)
    assert store.indices.tolist() == list(range(4 * BATCHES))
    assert torch.equal(store["h"], torch.arange(4.0 * BATCHES)[:, None])


def test_a_failed_upload_is_raised_and_a_resume_writes_what_it_lost(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gated(monkeypatch, fail_shard="shard-r000-000001.safetensors")
    plan = prepare_store(url, "create", SETTINGS)
    writer = ShardWriter(url, rank=0, plan=plan, max_shard_bytes=1, shards_in_flight=3)
    gate.open.set()
    with pytest.raises(StoreError, match="connection reset by peer"):
        for batch in range(BATCHES):
            rows = torch.arange(batch * 4, batch * 4 + 4)
            writer.write({"h": rows[:, None].float()}, rows.tolist(), batch_idx=batch)
        writer.close()
    writer.abort()
    committed = FeatureStore(url).indices.tolist()
    assert 4 not in committed and len(committed) < 4 * BATCHES  # shard 1 held rows 4..7
    resumed = ShardWriter(url, rank=0, plan=prepare_store(url, "resume", SETTINGS))
    gate.fail_shard = None
    for batch in range(BATCHES):
        rows = torch.arange(batch * 4, batch * 4 + 4)
        resumed.write({"h": rows[:, None].float()}, rows.tolist(), batch_idx=batch)
    resumed.close()
    store = FeatureStore(url)
    assert store.indices.tolist() == list(range(4 * BATCHES))
    assert torch.equal(store["h"], torch.arange(4.0 * BATCHES)[:, None])


def test_object_storage_keeps_four_uploads_going_and_a_disk_one(tmp_path: Any) -> None:
    url = f"memory://in-flight-{uuid.uuid4().hex}/s"
    remote = ShardWriter(url, rank=0, plan=prepare_store(url, "create", SETTINGS))
    local = ShardWriter(tmp_path, rank=0, plan=prepare_store(tmp_path, "create", SETTINGS))
    assert (remote.shards_in_flight, local.shards_in_flight) == (4, 1)
    with pytest.raises(ValueError, match="shards_in_flight"):
        ShardWriter(tmp_path, rank=0, plan=prepare_store(tmp_path, "resume", SETTINGS),
                    shards_in_flight=0)  # fmt: skip
