"""Object storage 20 ms away: a rank's upload throughput, and the time to open 30,000 shards.

    python benchmarks/s3_latency.py                # about 10 minutes on 2 cores
    python benchmarks/s3_latency.py --quick        # smoke test

moto's S3 server runs in a process of its own and ``benchmarks/latency_proxy.py`` in
another, in front of it, adding ``--delay-ms`` (20) to every request: moto alone answers in
about a millisecond and is CPU-bound here, which hides what a round trip costs. Prints JSON:

- ``upload``: ``ShardWriter`` writing ``--upload-mib`` of batches in shards of
  ``--shard-mib`` through the proxy with ``shards_in_flight`` 1 (one upload at a time: the
  writer before this change), 4 (the default on object storage) and 8, in interleaved
  rounds, each into a fresh prefix: MB/s, and each variant's ratio to 1 in the same round
  (median, min and max over the rounds).
- ``open``: ``FeatureStore(url)`` through the proxy on a store of ``--shards`` shards
  (written straight to moto, not through the proxy): seconds and requests with the
  manifest its writer wrote (two listings of ``commits/`` and the ledgers, never of the
  shards), and with the manifest turned back into its commit records (each fetched on its
  own: a store whose writer was killed before it closed, and every store before
  manifests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common import run_facts, spread

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
_SERVER = (
    "import sys, threading; sys.path.insert(0, sys.argv[1]);"
    "from tests.s3_server import S3Server; server = S3Server().start();"
    "print(server.endpoint.rsplit(':', 1)[1], flush=True); threading.Event().wait()"
)
REQUESTS = [0]


@contextmanager
def process(*command: str) -> Iterator[int]:
    """A child process that prints the port it serves on; killed on exit."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        yield int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()


def count_requests() -> None:
    """Count every request botocore sends from this process (s3fs's client)."""
    from aiobotocore.endpoint import AioEndpoint

    send = AioEndpoint._send

    async def counted(self: Any, request: Any) -> Any:
        REQUESTS[0] += 1
        return await send(self, request)

    AioEndpoint._send = counted  # type: ignore[method-assign]


def options(port: int) -> dict[str, Any]:
    return {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "eu-west-1"},
        "skip_instance_cache": True,
    }


def write(url: str, port: int, batches: list[torch.Tensor], **writer: Any) -> float:
    """Seconds to write ``batches`` (one row per sample) to a fresh store at ``url``."""
    from lightning_iocatch.store import ShardWriter, prepare_store

    opts = options(port)
    plan = prepare_store(url, "create", SETTINGS, storage_options=opts)
    start = time.perf_counter()
    sink = ShardWriter(url, rank=0, plan=plan, storage_options=opts, **writer)
    first = 0
    for batch in batches:
        sink.write({"h": batch}, list(range(first, first + len(batch))))
        first += len(batch)
    sink.close()
    return time.perf_counter() - start


def upload(direct: int, proxied: int, args: argparse.Namespace) -> dict[str, Any]:
    rows_per_mib = (1 << 20) // (256 * 4)
    batches = [torch.randn(rows_per_mib, 256) for _ in range(args.upload_mib)]
    variants = (1, 4, 8)
    seconds: dict[int, list[float]] = {n: [] for n in variants}
    for round_ in range(args.rounds + 1):  # the first round warms up
        order = variants if round_ % 2 else variants[::-1]
        for n in order:
            url = f"s3://bench/upload-{uuid.uuid4().hex}"
            took = write(url, proxied, batches, max_shard_bytes=args.shard_mib << 20,
                         shards_in_flight=n)  # fmt: skip
            if round_:
                seconds[n].append(took)
    mb = args.upload_mib * (1 << 20) / 1e6
    return {
        "shard_mib": args.shard_mib,
        "mib_per_round": args.upload_mib,
        **{
            f"in_flight_{n}": {
                "mb_per_s": spread([mb / s for s in seconds[n]]),
                "ratio_to_1": spread([a / b for a, b in zip(seconds[1], seconds[n], strict=True)]),
            }
            for n in variants
        },
    }


def records_instead_of_manifests(url: str, storage: dict[str, Any]) -> None:
    """Turn each manifest back into the commit records it gathered (what a dump killed
    before its writer closed leaves, and how every store was opened before manifests)."""
    from lightning_iocatch.store.backends.location import open_backend
    from lightning_iocatch.store.backends.objects import ObjectBackend
    from lightning_iocatch.store.names import commit_name, manifest_span

    backend = open_backend(url, storage)
    assert isinstance(backend, ObjectBackend)
    location = backend.location
    for name in backend.names():
        span = manifest_span(name)
        if span is not None:
            rank, first, _ = span
            lines = location.fs.cat_file(location.path(name)).splitlines(keepends=True)
            location.fs.pipe(
                {
                    location.path(commit_name(rank, seq)): line
                    for seq, line in enumerate(lines, first)
                }
            )
            location.fs.rm_file(location.path(name))


def open_store(direct: int, proxied: int, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_iocatch import FeatureStore

    url = f"s3://bench/open-{uuid.uuid4().hex}"
    batches = [torch.zeros(1, 4) for _ in range(args.shards)]
    built = write(url, direct, batches, max_shard_bytes=1, shards_in_flight=16)
    result: dict[str, Any] = {"shards": args.shards, "write_seconds_direct": round(built, 1)}
    for name in ("with_manifest", "commit_records_one_by_one"):
        if name == "commit_records_one_by_one":
            records_instead_of_manifests(url, options(direct))
        times, requests = [], []
        for _ in range(1 if name == "commit_records_one_by_one" else args.rounds):
            REQUESTS[0] = 0
            start = time.perf_counter()
            store = FeatureStore(url, storage_options=options(proxied))
            times.append(time.perf_counter() - start)
            requests.append(REQUESTS[0])
            assert len(store) == args.shards
        result[name] = {"seconds": spread(times), "requests": statistics.median(requests)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--upload-mib", type=int, default=48)
    parser.add_argument("--shard-mib", type=int, default=1)
    parser.add_argument("--shards", type=int, default=30_000)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.upload_mib, args.shards = 1, 8, 300
    count_requests()
    with (
        process(sys.executable, "-c", _SERVER, str(ROOT)) as direct,
        process(
            sys.executable, str(HERE / "latency_proxy.py"), str(direct), str(args.delay_ms)
        ) as proxied,  # fmt: skip
    ):
        import s3fs

        s3fs.S3FileSystem(**options(direct)).mkdir("bench")
        REQUESTS[0] = 0
        start = time.perf_counter()
        s3fs.S3FileSystem(**options(proxied)).ls("bench")
        round_trip = time.perf_counter() - start
        report = run_facts(delay_ms=args.delay_ms, one_listing_s=round(round_trip, 4))
        report["upload"] = upload(direct, proxied, args)
        report["open"] = open_store(direct, proxied, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
