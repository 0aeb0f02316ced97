"""Blocks decoded in parallel: a function over items on a few threads, for the calling
thread's one read.

zstd's decoder and NumPy's copies release the GIL, so the blocks one read needs decode on
several cores at once. The calling thread works too, beside at most :data:`MAX_THREADS`
minus one threads that live for one call (:func:`parallel_map`): no thread outlives the
read that started it (nothing to shut down later, nothing left behind in a process forked
by a DataLoader). The first error of an item (in the items' order) is raised in the caller
once every thread has stopped; no item starts after an error. A read of less than
:data:`PARALLEL_BYTES` stays on the calling thread: starting threads would cost more than
they save (a 200 KB store read twice as slowly on a loaded machine).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

import torch
from torch.utils.data import get_worker_info

__all__ = ["MAX_THREADS", "PARALLEL_BYTES", "parallel_map", "threads"]

MAX_THREADS = 8
"""The most threads one read decodes on (the calling thread included)."""

PARALLEL_BYTES = 4 << 20
"""The bytes to decode from which a read decodes on several threads."""

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def threads() -> int:
    """The threads a read decodes on: the CPUs this process may run on, at most
    :data:`MAX_THREADS`; in a DataLoader worker, its torch threads (one, as the DataLoader
    sets them: the workers are the parallelism, more threads would only oversubscribe)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    if get_worker_info() is not None:
        cpus = min(cpus, torch.get_num_threads())
    return max(1, min(cpus, MAX_THREADS))


def parallel_map(
    function: Callable[[_In], _Out], items: Sequence[_In], *, nbytes: int | None = None
) -> list[_Out]:
    """``[function(item) for item in items]``, on the calling thread and up to
    :func:`threads` minus one more, each taking the next item left; on the calling thread
    alone for one item, one CPU, or ``nbytes`` (the work's size) under
    :data:`PARALLEL_BYTES`. The first item to fail (in the items' order) raises its error
    here, once every thread has stopped."""
    workers = min(len(items), threads())
    if workers < 2 or (nbytes is not None and nbytes < PARALLEL_BYTES):
        return [function(item) for item in items]
    results: list[_Out | None] = [None] * len(items)
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    taken = [0]  # the next item to take

    def work() -> None:
        while True:
            with lock:
                number = taken[0]
                if errors or number >= len(items):
                    return
                taken[0] += 1
            try:
                results[number] = function(items[number])
            except BaseException as error:  # handed to the caller below
                with lock:
                    errors[number] = error
                return

    with ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="iocatch-decode") as pool:
        helpers = [pool.submit(work) for _ in range(workers - 1)]
        try:
            work()
        except BaseException as error:  # an interrupt here: the helpers stop at their next item
            with lock:
                errors.setdefault(-1, error)
        try:
            for helper in helpers:
                helper.result()  # ``work`` raises nothing: waits for the helper to stop
        except BaseException as error:  # an interrupt while waiting: no item starts after it
            with lock:
                errors.setdefault(-1, error)
            raise
    if errors:
        raise errors[min(errors)]
    return cast("list[_Out]", results)
