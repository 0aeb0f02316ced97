"""The writer thread: every failure reaches the main thread quickly, Ctrl-C stops a dump at
once, nothing is left running, and the memory bound holds on a disk slower than the model.

Run as a script, this file is the memory measurement that ``test_memory_bound_*`` starts
in a fresh process::

    python tests/store/test_writer_threads.py DIR
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_iocatch.capture.host_copy as host_copy
import lightning_iocatch.store.backends.local as local_backend
import lightning_iocatch.store.writer as shard_writer_module
from lightning_iocatch import (
    BatchCaptures,
    CaptureSink,
    FeatureStore,
    FeatureWriter,
    IOCaptureCallback,
    StoreError,
)
from lightning_iocatch.store.backends.local_records import read_ledgers
from tests.capture.test_pinned_ring import FakeCudaOps
from tests.conftest import hook_count
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer

ROOT = Path(__file__).resolve().parents[2]
SPEC = "outputs[model.layers.1]"
BATCH_BYTES = 4 * 8 * 4 + 4 * 8  # 4 rows of 8 float32, and their int64 indices


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A test that hangs is killed (with every thread's stack) instead of stalling the suite."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("iocatch-writer")]


def assert_committed_prefix(path: Path, module: TinyModule, rows: int) -> None:
    """The store holds exactly dataset rows ``0 .. rows-1``, equal to a manual forward."""
    store = FeatureStore(path)
    assert store.indices.tolist() == list(range(rows))
    expected = manual_outputs(module, dataset(400).tensors[0][:rows])[1]
    assert torch.equal(store["model.layers.1/outputs"], expected)
    store.verify()
    assert not list(path.glob("*.tmp"))


def failing_on_call(
    real: Callable[..., Any], call: int, error: BaseException
) -> Callable[..., Any]:
    calls = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) == call:
            time.sleep(0.3)  # meanwhile the loop fills the queue and waits for room
            raise error
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("_serialize", MemoryError(), "failed: MemoryError"),
        ("_serialize", RuntimeError("boom"), "failed: RuntimeError: boom"),
        ("_serialize", KeyError("unsupported dtype"), "failed: KeyError: 'unsupported dtype'"),
        (
            "_serialize",
            OSError(errno.ENOSPC, "No space left on device"),
            "could not write shard .*shard-r000-000001.safetensors: .*No space left",
        ),
        (
            "append_ledger",
            OSError(errno.EIO, "Input/output error"),
            "shard-r000-000001.safetensors was written but its ledger line could not be",
        ),
    ],
)
def test_a_writer_thread_failure_reaches_the_loop_within_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, error: BaseException, match: str
) -> None:
    home = local_backend if target == "append_ledger" else shard_writer_module
    real = getattr(home, target)
    monkeypatch.setattr(home, target, failing_on_call(real, 2, error))
    module = TinyModule()
    writer = FeatureWriter(tmp_path, max_shard_bytes=2 * BATCH_BYTES, queue_size=1)
    start = time.monotonic()
    with pytest.raises(StoreError, match=match):
        trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(
            module, loader(400, 4), return_predictions=False
        )
    assert time.monotonic() - start < 10
    assert not writer_threads()
    assert_committed_prefix(tmp_path, module, rows=8)  # the first shard: two batches


class FailsAt(CaptureSink):
    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.batches = 0

    def on_loop_start(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.hook == "start":
            raise RuntimeError("the other sink broke at loop start")

    def on_batch(self, batch: BatchCaptures) -> None:
        self.batches += 1
        if self.hook == "batch" and self.batches == 5:
            raise RuntimeError("the other sink broke at batch 4")


def test_another_sink_failing_at_loop_start_leaves_no_thread(tmp_path: Path) -> None:
    callback = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path), sinks=[FailsAt("start")])
    with pytest.raises(RuntimeError, match="the other sink broke at loop start"):
        trainer([callback]).predict(TinyModule(), loader(40, 4), return_predictions=False)
    assert not writer_threads() and read_ledgers(tmp_path) == []


def test_another_sink_failing_mid_loop_still_commits_the_batches_written(tmp_path: Path) -> None:
    module = TinyModule()
    callback = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path), sinks=[FailsAt("batch")])
    with pytest.raises(RuntimeError, match="the other sink broke at batch 4"):
        trainer([callback]).predict(module, loader(40, 4), return_predictions=False)
    assert not writer_threads()
    assert_committed_prefix(tmp_path, module, rows=20)  # batches 0..4 reached the writer


class FailsInALaterLayer(TinyModule):
    """Batch 3 raises in ``model.layers.2``, after ``model.layers.1`` was captured."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x = self.model.layers[1](self.model.layers[0](batch[0]))
        if batch_idx == 3:
            raise RuntimeError("CUDA out of memory (simulated) in model.layers.2")
        return self.model.layers[2](x)


class BrokenEventOps(FakeCudaOps):
    """The GPU path on CPU fakes; the copy of the 4th capture fails when it is waited for."""

    def copy_to_host(self, staging: torch.Tensor, snapshot: torch.Tensor) -> Any:
        event = super().copy_to_host(staging, snapshot)
        if len(self.events) == 4:
            event.synchronize = lambda: (_ for _ in ()).throw(
                RuntimeError("CUDA error: an illegal memory access (simulated)")
            )
        return event


@pytest.mark.parametrize("ops", [FakeCudaOps, BrokenEventOps])
def test_a_batch_failing_after_a_staged_copy_raises_its_own_error_and_commits_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ops: type[FakeCudaOps]
) -> None:
    """A predict batch that raises after an asynchronous copy was staged (the GPU path, with
    CPU fakes of the CUDA calls, under Lightning's inference mode): before, ``on_exception``
    raised the copy's error instead of the model's, so the writer committed 0 of the 12 rows
    of the complete batches, its thread stayed, and Lightning's teardown was skipped."""
    monkeypatch.setattr(host_copy, "CudaOps", ops)
    module = FailsInALaterLayer()
    callback = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path, durable=False))
    broken = ops is BrokenEventOps
    with (
        pytest.warns(RuntimeWarning, match="illegal memory access") if broken else nullcontext(),
        pytest.raises(RuntimeError, match="CUDA out of memory"),
    ):
        trainer([callback]).predict(module, loader(40, 4), return_predictions=False)
    assert not writer_threads()
    assert hook_count(module) == 0 and "predict_step" not in vars(module)  # torn down
    assert_committed_prefix(tmp_path, module, rows=12)  # batches 0..2


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> float:
    """Every fsync takes 0.3 s longer: the disk is far slower than the model."""
    delay = 0.3
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(delay)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    return delay


@pytest.mark.parametrize(
    "samples",
    [
        400,  # Ctrl-C while the loop waits for room in the queue
        48,  # 12 batches, all queued: Ctrl-C while the loop's end waits for the writer
    ],
)
def test_ctrl_c_ends_a_dump_on_a_slow_disk_promptly(
    tmp_path: Path, slow_disk: float, samples: int
) -> None:
    # One batch a shard, each shard 3 fsyncs: writing 12 queued batches would take 11 s.
    module = TinyModule()
    writer = FeatureWriter(tmp_path, max_shard_bytes=1, queue_size=16)
    fit = trainer([IOCaptureCallback(SPEC, writer=writer)])
    sent: list[float] = []

    def press_ctrl_c() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    ctrl_c = threading.Timer(1.0, press_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    ctrl_c.start()
    try:
        with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C
            fit.predict(module, loader(samples, 4), return_predictions=False)
        stopped = time.monotonic()
    finally:
        ctrl_c.join()
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    assert stopped - sent[0] < 4 * slow_disk + 2
    assert not writer_threads()
    rows = len(FeatureStore(tmp_path))
    assert 0 < rows < 32  # what was committed stays, what was queued is dropped
    assert_committed_prefix(tmp_path, module, rows=rows)


# The memory bound, measured in a fresh process


ROW_FLOATS = 1 << 18  # 1 MiB a row
BATCH = 4  # rows: a batch is 4 MiB
SHARD = 16 << 20
QUEUE = 2


def measure(directory: Path) -> dict[str, float]:
    """Peak RSS above the baseline while dumping 32 batches through a disk whose fsync
    takes 0.1 s longer, sampled every 0.5 ms; runs in a process started with
    ``MALLOC_MMAP_THRESHOLD_`` low, so that freed tensors leave RSS at once."""
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset[torch.Tensor]):
        def __init__(self, batches: int) -> None:
            self.rows = batches * BATCH

        def __len__(self) -> int:
            return self.rows

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.full((ROW_FLOATS,), float(index))

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Identity()

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.body(batch)

    def dump(path: Path, batches: int) -> None:
        writer = FeatureWriter(path, max_shard_bytes=SHARD, queue_size=QUEUE)
        callback = IOCaptureCallback("outputs[body]", writer=writer)
        loader = DataLoader(Rows(batches), batch_size=BATCH)
        trainer([callback]).predict(Net(), loader, return_predictions=False)

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    dump(directory / "warm-up", 2)
    baseline = peak = rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    real_fsync = os.fsync
    os.fsync = lambda fd: (time.sleep(0.1), real_fsync(fd))[1]  # type: ignore[assignment]
    sampler.start()
    start = time.monotonic()
    dump(directory / "measured", 32)
    seconds = time.monotonic() - start
    done.set()
    sampler.join()
    os.fsync = real_fsync
    return {"peak_above_baseline": peak - baseline, "seconds": seconds}


@pytest.mark.slow
def test_memory_bound_holds_when_the_disk_is_slower_than_the_model(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": str(256 << 10)}
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    batch_bytes = BATCH * ROW_FLOATS * 4
    # The documented bound: a shard plus the batch that fills it, queue_size + 1 batches.
    bound = SHARD + batch_bytes + (QUEUE + 1) * batch_bytes
    # Outside the writer: the step's input batch and the loader's prefetched next batch.
    step = 2 * batch_bytes
    assert figures["seconds"] > 2.0  # 8 shards of 3 slow fsyncs: the disk set the pace
    assert figures["peak_above_baseline"] <= bound + step + (4 << 20), figures


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(measure(Path(sys.argv[1]))))
