"""A coded store refuses hostile blocks before allocating them, and reads only the blocks asked.

The ground truths: frames made by zstd itself (a 32 KiB frame of 1 GiB of zeros that
declares its size, and frames of a block's true content that declare no size), the peak of
Python's allocations (``tracemalloc``: zstandard allocates its output through Python), the
rows per block the writer's rule gives (``BLOCK_BYTES // row_bytes``), the compressed sizes
the shard's own metadata gives for each block, and the bytes the backend was asked for
(counted at ``LocalShard.read_ranges``, and in the HTTP ranges an S3 server, moto's, saw).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lightning_iocatch.store.shard_codec as shard_codec
from lightning_iocatch import FeatureStore, StoreError
from lightning_iocatch.store.backends.local import LocalShard
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.s3_server import S3Server

zstandard = pytest.importorskip("zstandard")

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}
ROWS, WIDTH, BLOCK = 64, 4096, 64 << 10  # float32 rows of 16 KiB: 4 rows a block, 16 blocks
GIB = 1 << 30


@pytest.fixture(autouse=True)
def blocks_of_64_kib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_codec, "BLOCK_BYTES", BLOCK)


@pytest.fixture(scope="module")
def zeros_declaring_1_gib() -> bytes:
    """A frame of 1 GiB of zeros that declares its size (about 32 KiB, made in chunks)."""
    coder = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=GIB)
    chunk = bytes(1 << 20)
    frame = b"".join([*(coder.compress(chunk) for _ in range(GIB // len(chunk))), coder.flush()])
    assert len(frame) < 64 << 10 and zstandard.frame_content_size(frame) == GIB
    return frame


def write(path: str | Path, x: torch.Tensor, **options: Any) -> None:
    plan = prepare_store(path, "create", SETTINGS, storage_options=options.get("storage_options"))
    writer = ShardWriter(path, rank=0, plan=plan, codec="zstd", **options)
    writer.write({"x": x}, list(range(ROWS)))  # one batch of 64 rows
    writer.close()


def rows() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


def shard_layout(path: Path) -> tuple[Path, int, dict[str, Any]]:
    """The store's one shard: its path, where its data starts, its safetensors header."""
    (record,) = read_ledgers(path)
    file = path / record.file
    with file.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    return file, 8 + length, header


def block_place(path: Path, tensor: str, block: int) -> tuple[Path, int, int]:
    """``(shard file, first byte, size)`` of ``block`` of ``tensor``'s compressed bytes."""
    file, data, header = shard_layout(path)
    sizes = json.loads(header["__metadata__"]["codec"])["tensors"][tensor]["sizes"]
    start = data + header[tensor]["data_offsets"][0] + sum(sizes[:block])
    return file, start, sizes[block]


def replace_block(path: Path, tensor: str, block: int, frame: bytes) -> None:
    """Put ``frame`` in place of ``block``, padded to its size with a zstd skippable frame."""
    file, start, size = block_place(path, tensor, block)
    pad = size - len(frame) - 8
    assert pad >= 0, (size, len(frame))
    skippable = (0x184D2A50).to_bytes(4, "little") + pad.to_bytes(4, "little") + bytes(pad)
    raw = file.read_bytes()
    file.write_bytes(raw[:start] + frame + skippable + raw[start + size :])


def peak_bytes(read: Callable[[], Any]) -> int:
    """The peak of Python's allocations (zstandard's output buffers included) during ``read``."""
    tracemalloc.start()
    try:
        read()
    except StoreError:
        pass  # the caller checks the refusal itself
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_frame_declaring_1_gib_in_a_block_is_refused_before_it_is_decoded(
    tmp_path: Path, zeros_declaring_1_gib: bytes
) -> None:
    write(tmp_path, rows())
    replace_block(tmp_path, "b0/x", 5, zeros_declaring_1_gib)  # a block of 64 KiB
    store = FeatureStore(tmp_path)
    declares = r"tensor 'b0/x' block 5 is damaged: its frame declares 1073741824 bytes"
    with pytest.raises(StoreError, match=declares) as refused:
        store.rows_at("x", [21])  # row 21: block 5
    assert str(refused.value).startswith(f"shard {tmp_path}/shard-"), refused.value
    assert peak_bytes(lambda: FeatureStore(tmp_path).rows_at("x", [21])) < 16 << 20


def test_a_frame_declaring_no_size_is_decoded_no_further_than_its_block(
    tmp_path: Path,
) -> None:
    x = rows()
    write(tmp_path, x)
    undeclared = zstandard.ZstdCompressor(level=1, write_content_size=False, write_checksum=True)
    coder = undeclared.compressobj()
    chunk = bytes(1 << 20)
    frame = b"".join([*(coder.compress(chunk) for _ in range(GIB // len(chunk))), coder.flush()])
    replace_block(tmp_path, "b0/x", 5, frame)  # 1 GiB of zeros, its size not declared
    with pytest.raises(StoreError, match=rf"block 5 is damaged: it decodes to more than {BLOCK}"):
        FeatureStore(tmp_path).rows_at("x", [21])
    assert peak_bytes(lambda: FeatureStore(tmp_path).rows_at("x", [21])) < 16 << 20
    # the block's own content without a declared size still reads, bit for bit (level 19:
    # smaller than the block's frame, to leave room for the padding)
    shuffled = x[20:24].numpy().view(np.uint8).reshape(-1, 4).T.copy()
    smaller = zstandard.ZstdCompressor(level=19, write_content_size=False, write_checksum=True)
    replace_block(tmp_path, "b0/x", 5, smaller.compress(shuffled.data))
    assert torch.equal(FeatureStore(tmp_path).rows_at("x", [21, 20]).rows, x[[21, 20]])


def test_a_frame_without_a_checksum_is_refused(tmp_path: Path) -> None:
    """Other bytes of the block's size in a frame without zstd's checksum would decode
    cleanly into other rows: the writer always writes one, so one without is refused."""
    x = rows()
    write(tmp_path, x)
    other = (x[20:24] + 1).numpy().view(np.uint8).reshape(-1, 4).T.copy()
    unchecked = zstandard.ZstdCompressor(level=19, write_checksum=False)
    replace_block(tmp_path, "b0/x", 5, unchecked.compress(other.data))
    with pytest.raises(StoreError, match="block 5 is damaged: its frame carries no checksum"):
        FeatureStore(tmp_path).rows_at("x", [21])
    assert torch.equal(FeatureStore(tmp_path).rows_at("x", [3]).rows, x[[3]])  # others read


def test_a_frame_asking_a_window_beyond_its_block_is_refused(tmp_path: Path) -> None:
    x = rows()
    write(tmp_path, x)
    params = zstandard.ZstdCompressionParameters.from_level(
        19, window_log=27, write_checksum=1, write_content_size=0
    )
    shuffled = x[20:24].numpy().view(np.uint8).reshape(-1, 4).T.copy()
    coder = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = coder.compress(shuffled.data) + coder.flush()  # its true content, in a wide window
    assert zstandard.get_frame_parameters(frame).window_size == 1 << 27
    replace_block(tmp_path, "b0/x", 5, frame)
    with pytest.raises(StoreError, match=r"block 5 is damaged: it cannot be decoded"):
        FeatureStore(tmp_path).rows_at("x", [21])
    assert torch.equal(FeatureStore(tmp_path).rows_at("x", [3]).rows, x[[3]])  # block 0


def rewrite_codec(path: Path, tensor: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Change ``tensor``'s entry of the codec metadata in place (the header padded with
    spaces to its length, so that no byte of data moves)."""
    file, data, header = shard_layout(path)
    codec = json.loads(header["__metadata__"]["codec"])
    change(codec["tensors"][tensor])
    header["__metadata__"]["codec"] = json.dumps(codec)
    text = json.dumps(header).encode()
    assert len(text) <= data - 8
    raw = file.read_bytes()
    file.write_bytes(raw[:8] + text.ljust(data - 8) + raw[data:])


def test_rows_a_block_beyond_the_writers_rule_are_refused_when_the_metadata_is_read(
    tmp_path: Path,
) -> None:
    write(tmp_path, rows())
    _, _, header = shard_layout(tmp_path)
    sizes = json.loads(header["__metadata__"]["codec"])["tensors"]["b0/x"]["sizes"]
    assert len(sizes) == ROWS * WIDTH * 4 // BLOCK  # 16 blocks of 4 rows: the writer's rule

    def one_block(info: dict[str, Any]) -> None:  # consistent: the 16 frames as one block
        info["rows"], info["sizes"] = ROWS, [sum(info["sizes"])]

    rewrite_codec(tmp_path, "b0/x", one_block)
    with pytest.raises(
        StoreError,
        match=r"codec metadata is damaged \('b0/x' has 64 rows a block, where the writer puts "
        r"at most 4",
    ):
        FeatureStore(tmp_path).rows_at("x", [3])


def test_a_consistently_forged_2_gib_block_is_refused_before_anything_is_allocated() -> None:
    forged = {"dtype": "F32", "shape": [1 << 17, 4096], "rows": 1 << 17, "sizes": [32794]}
    meta = {"name": "zstd", "shuffle": True, "tensors": {"b0/x": forged}}
    metadata = {"codec": json.dumps(meta)}
    with pytest.raises(StoreError, match=r"shard s3://b/s is corrupted: .*131072 rows a block"):
        shard_codec.parse_codec(metadata, "s3://b/s")
    forged |= {"rows": 4, "sizes": [100] * (1 << 15)}  # the writer's rule: it parses
    assert shard_codec.parse_codec({"codec": json.dumps(meta)}, "s")[1]["b0/x"].rows == 4


@pytest.fixture
def local_bytes_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes of each range a local shard is asked for from here on."""
    taken: list[int] = []
    read_ranges = LocalShard.read_ranges

    def counting(self: LocalShard, ranges: Any) -> Any:
        taken.extend(end - start for start, end in ranges)
        return read_ranges(self, ranges)

    monkeypatch.setattr(LocalShard, "read_ranges", counting)
    yield taken


def their_blocks(path: Path, blocks: list[int]) -> int:
    """The compressed bytes of ``blocks`` of ``b0/x`` and of the whole ``b0/__index__``."""
    _, _, header = shard_layout(path)
    tensors = json.loads(header["__metadata__"]["codec"])["tensors"]
    index = tensors["b0/__index__"]["sizes"]
    assert len(index) == 1
    return sum(tensors["b0/x"]["sizes"][b] for b in blocks) + index[0]


def test_rows_at_reads_only_the_blocks_of_its_rows(
    tmp_path: Path, local_bytes_read: list[int]
) -> None:
    x = rows()
    write(tmp_path, x)
    store = FeatureStore(tmp_path)
    local_bytes_read.clear()
    got = store.rows_at("x", [53, 9, 53])  # blocks 13 and 2 of the one batch
    assert torch.equal(got.rows, x[[53, 9, 53]])
    expected = their_blocks(tmp_path, [2, 13])
    assert expected <= sum(local_bytes_read) <= expected + 4096, (local_bytes_read, expected)
    assert sum(local_bytes_read) < 3 * BLOCK  # the 12 blocks from 2 to 13 are about 12 x


def test_a_damaged_block_between_the_rows_asked_fails_no_read_of_them(tmp_path: Path) -> None:
    x = rows()
    write(tmp_path, x)
    file, start, size = block_place(tmp_path, "b0/x", 7)
    raw = bytearray(file.read_bytes())
    raw[start + size // 2] ^= 0x10
    file.write_bytes(raw)
    store = FeatureStore(tmp_path)
    assert torch.equal(store.rows_at("x", [9, 53]).rows, x[[9, 53]])
    with pytest.raises(StoreError, match=r"tensor 'b0/x' block 7 is damaged"):
        store.rows_at("x", [9, 29, 53])


def test_rows_at_on_s3_fetches_only_the_blocks_of_its_rows(server: S3Server, bucket: str) -> None:
    url, options = f"s3://{bucket}/run", server.storage_options()
    x = rows()
    write(url, x, storage_options=options)
    store = FeatureStore(url, storage_options=options)
    store.rows_at("x", [0])  # the header and the indices, read once
    server.taken()
    assert torch.equal(store.rows_at("x", [53, 9]).rows, x[[53, 9]])
    ranges = [r.range for r in server.taken() if r.method == "GET" and r.range]
    asked = sum(int(b) - int(a) + 1 for a, b in (r.split("=")[1].split("-") for r in ranges))
    assert 0 < asked < 3 * BLOCK, ranges  # blocks 2 and 13 (~60 KiB each), not 2 to 13
