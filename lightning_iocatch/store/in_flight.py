"""Shards written several at a time: the writer thread hands each to a bounded pool.

Examples:
    >>> done = []
    >>> shards = ShardsInFlight(2, "example")
    >>> for n in range(3):
    ...     shards.write(lambda n=n: done.append(n))
    >>> shards.finish()
    >>> sorted(done)
    [0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

__all__ = ["ShardsInFlight"]


class ShardsInFlight:
    """Shards written by up to ``limit`` threads at once (in the writer thread itself for
    one); a new one waits for room; the first failure is raised, and no more are started."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit, self.name = limit, name
        self._pool: ThreadPoolExecutor | None = None
        self._running: list[Future[None]] = []

    def write(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a shard's writing), here or on a thread of its own."""
        if self.limit == 1:
            job()
            return
        while len(self._running) >= self.limit:  # room for one more: wait for any to end
            wait(self._running, return_when=FIRST_COMPLETED)
            self._collect()
        self._collect()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.limit, thread_name_prefix=self.name)
        self._running.append(self._pool.submit(job))

    def _collect(self) -> None:
        """Drop the shards done; raise the first failure among them."""
        done = [future for future in self._running if future.done()]
        self._running = [future for future in self._running if not future.done()]
        for future in done:
            future.result()

    def finish(self) -> None:
        """Wait for every shard in flight; raise the first failure."""
        try:
            wait(self._running)
            running, self._running = self._running, []
            for future in running:
                future.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
