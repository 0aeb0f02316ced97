"""Dumping to an S3-protocol server: throughput against plain s3fs uploads, requests per shard.

    python benchmarks/s3.py [--quick]

Starts moto's S3 server on 127.0.0.1 in this process (tests/s3_server.py; the server runs
in a thread of this process, so it shares the 2 cores and the GIL with the client, for both
variants alike) and prints JSON with, in one run:

- ``write_throughput``: bytes per second of ``ShardWriter`` (the Trainer-free core of
  FeatureWriter: checksum, shard object upload, commit record) writing a stream of captured
  batches to ``s3://``, against plain s3fs uploads (``pipe_file``) of
  ``safetensors.torch.save`` of the same tensors in the same shard sizes; interleaved
  rounds in alternating order, each into a fresh prefix, the ratio taken per round
  (target >= 0.8; median, min and max). The store's one-off creation (``store.json``, once
  per dump whatever its size) is timed apart, as ``store_creation``;
- ``requests_per_shard``: the requests the server answered per shard, by kind, for both;
- ``open`` and ``read_key``: the requests and bytes of opening the store and reading a key
  (ranged reads: the headers, then just the key's tensors);
- ``commit_listing``: seconds to list and fetch N commit records (what a reader and a
  resume do first), for the cluster-scale estimate (docs/cluster-scale.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from common import run_facts, spread
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/s3_server.py

from lightning_iocatch import FeatureStore
from lightning_iocatch.store import ShardWriter, prepare_store
from lightning_iocatch.store.backends import ObjectBackend, open_backend
from lightning_iocatch.store.backends.object_location import list_objects
from lightning_iocatch.store.backends.object_records import read_commit_entries
from lightning_iocatch.store.names import FORMAT, commit_name
from lightning_iocatch.store.records import BatchRecord, ShardRecord
from tests.s3_server import Request, S3Server

SETTINGS = {"spec": None, "stage": "predict", "dtype": None}
KEY = "model.layers.6/outputs"


def kind(request: Request) -> str:
    """A request's S3 operation, coarsely."""
    if "list-type" in request.query:
        return "LIST"
    if request.method == "POST" and "uploads" in request.query:
        return "CreateMultipartUpload"
    if request.method == "PUT" and "partNumber" in request.query:
        return "UploadPart"
    if request.method == "POST" and "uploadId" in request.query:
        return "CompleteMultipartUpload"
    if request.method == "POST" and "delete" in request.query:
        return "DeleteObjects"
    if request.method == "GET" and request.range:
        return "GET (ranged)"
    return request.method


def per_shard(requests: list[Request], shards: int) -> dict[str, float]:
    counts: dict[str, int] = {}
    for request in requests:
        counts[kind(request)] = counts.get(kind(request), 0) + 1
    counts["total"] = len(requests)
    return {name: round(count / shards, 2) for name, count in sorted(counts.items())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shard-mib", type=int, default=16)
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    batches, rows, width = (32, 64, 1024) if args.quick else (256, 64, 1024)
    shard_bytes = args.shard_mib << 20
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(rows, width, generator=generator) for _ in range(batches)]
    per_batch = rows * width * 4
    per_shard_batches = math.ceil(shard_bytes / per_batch)
    shards = math.ceil(batches / per_shard_batches)
    total = batches * per_batch

    with S3Server() as server:
        server.make_bucket("bench")
        options = server.storage_options()
        options.pop("skip_instance_cache")  # one s3fs client for the run, as a user has

        def create(prefix: str) -> Any:
            """The store's one-off creation (store.json), timed apart from the dump."""
            return prepare_store(
                f"s3://bench/{prefix}", "create", SETTINGS, storage_options=options
            )

        def writer(prefix: str, plan: Any) -> None:
            url = f"s3://bench/{prefix}"
            core = ShardWriter(
                url, rank=0, plan=plan, max_shard_bytes=shard_bytes, storage_options=options
            )
            for i, tensor in enumerate(data):
                core.write({KEY: tensor}, range(i * rows, (i + 1) * rows))
            core.close()

        plain = open_backend("s3://bench/plain", options)
        assert isinstance(plain, ObjectBackend)
        fs = plain.location.fs

        def plain(prefix: str, plan: Any) -> None:
            for shard in range(shards):
                part = data[shard * per_shard_batches : (shard + 1) * per_shard_batches]
                tensors = {f"b{j}/{KEY}": tensor for j, tensor in enumerate(part)}
                fs.pipe_file(f"bench/{prefix}/shard-{shard:06d}.safetensors", save(tensors))

        variants = {"plain": plain, "writer": writer}
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        requests: dict[str, list[Request]] = {name: [] for name in variants}
        creation: list[float] = []
        created: list[Request] = []
        for round_ in range(rounds + 1):
            for name in variants if round_ % 2 else reversed(list(variants)):
                prefix = f"{name}-{uuid.uuid4().hex[:8]}"
                server.taken()
                start = time.perf_counter()
                plan = create(prefix) if name == "writer" else None
                made = time.perf_counter()
                made_by = server.taken()
                variants[name](prefix, plan)
                elapsed = time.perf_counter() - made
                if round_:  # round 0 warms up
                    seconds[name].append(elapsed)
                    requests[name] += server.taken()
                    if name == "writer":
                        creation.append(made - start)
                        created += made_by
        ratios = [p / w for p, w in zip(seconds["plain"], seconds["writer"], strict=True)]
        plain_mb_s = total / statistics.median(seconds["plain"]) / 1e6

        # Opening a store and reading one key of it: ranged reads only
        writer("opened", create("opened"))
        server.taken()
        start = time.perf_counter()
        store = FeatureStore("s3://bench/opened", storage_options=options)
        open_s = time.perf_counter() - start
        opened = server.taken()
        start = time.perf_counter()
        rows_read = store[KEY]
        read_s = time.perf_counter() - start
        read = server.taken()
        assert torch.equal(rows_read, torch.cat(data))
        names = fs.find("bench/opened")
        start = time.perf_counter()
        fs.cat([name for name in names if "/shard-" in name])  # whole shards, for contrast
        whole_s = time.perf_counter() - start

        # Listing and fetching N commit records (small objects, fetched concurrently)
        listing: dict[str, Any] = {}
        record = ShardRecord(
            "shard-r000-000000.safetensors",
            0,
            1,
            0,
            (BatchRecord.of(0, 0, torch.tensor([0])),),
            {KEY: "float32"},
            {KEY: [width]},
        )
        for count in (500,) if args.quick else (1000, 2000):
            backend = open_backend(f"s3://bench/commits-{count}", options)
            assert isinstance(backend, ObjectBackend)
            location = backend.location
            fs.pipe(
                {
                    location.path(commit_name(0, seq)): dataclasses.replace(
                        record, file=f"shard-r000-{seq:06d}.safetensors"
                    )
                    .to_json()
                    .encode()
                    for seq in range(count)
                }
            )
            server.taken()
            start = time.perf_counter()
            entries = read_commit_entries(location, list_objects(location), store_format=FORMAT)
            listing[str(count)] = {
                "seconds": round(time.perf_counter() - start, 3),
                "records": len(entries),
                "requests": per_shard(server.taken(), 1),
            }

    result = run_facts(
        server="moto 5 S3 server in this process, 127.0.0.1",
        bytes_per_round=total,
        shards_per_round=shards,
        shard_bytes=shard_bytes,
        rounds=rounds,
        write_throughput={
            "plain_MB_s": round(plain_mb_s, 1),
            "writer_over_plain": spread(ratios),
            "target": ">= 0.8",
        },
        requests_per_shard={name: per_shard(requests[name], shards * rounds) for name in variants},
        store_creation={
            "seconds": round(statistics.median(creation), 3),
            "requests": per_shard(created, rounds),
        },
        open={
            "seconds": round(open_s, 3),
            "requests": per_shard(opened, 1),
            "shards": shards,
        },
        read_key={
            "seconds": round(read_s, 3),
            "requests": per_shard(read, 1),
            "bytes": rows_read.numel() * 4,
            "plain_whole_shards_seconds": round(whole_s, 3),
        },
        commit_listing=listing,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
