"""How many threads a coded read decodes on: every CPU it may use in a process of its own,
its torch threads in a DataLoader worker (the workers are the parallelism there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_iocatch.store.backends import decode_pool


def test_a_dataloader_worker_decodes_on_its_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_pool.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert decode_pool.threads() == decode_pool.MAX_THREADS
    worker = SimpleNamespace(id=0, num_workers=2)
    monkeypatch.setattr(decode_pool, "get_worker_info", lambda: worker)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as the DataLoader sets them in a worker
        assert decode_pool.threads() == 1
        items = list(range(40))
        assert decode_pool.parallel_map(lambda i: i * i, items, nbytes=1 << 30) == [
            i * i for i in items
        ]
    finally:
        torch.set_num_threads(threads)
