"""Compact reads give the values stored, bit for bit, by every route and in every variant.

The ground truths are computed here, apart from the reader: the shard files' own bytes
(their safetensors header parsed by hand), the values of those bytes decoded by NumPy from
their bit layout in float64 (IEEE halves of float32 for bfloat16, sign, exponent and
mantissa for each 8-bit float), times each row's float32 scale in float32.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lightning_iocatch.store.backends.coded as coded_module
import lightning_iocatch.store.backends.decode_pool as decode_pool
import lightning_iocatch.store.shard_codec as shard_codec
from lightning_iocatch import FeatureStore, StoreError, StoreRows
from lightning_iocatch.store.backends.coded import CodedShard, KeptBlocks
from lightning_iocatch.store.backends.local import LocalShard
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.shard_file import dequantize
from lightning_iocatch.store.writer import ShardWriter

pytest.importorskip("zstandard")

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}
ROWS, WIDTH, BATCH, BLOCK = 310, 24, 75, 1000  # every last block short: 1000 B is no whole rows
DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
EIGHT_BIT = {  # exponent bits, mantissa bits, bias, "fn" (no infinity), "fnuz" (NaN at 0x80)
    torch.float8_e4m3fn: (4, 3, 7, "fn"),
    torch.float8_e5m2: (5, 2, 15, ""),
    torch.float8_e4m3fnuz: (4, 3, 8, "fnuz"),
    torch.float8_e5m2fnuz: (5, 2, 16, "fnuz"),
}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_codec, "BLOCK_BYTES", BLOCK)


def activations() -> torch.Tensor:
    """Rows with outlier dimensions, a NaN, an infinity and a row of zeros."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, WIDTH, generator=generator)
    x[:, [3, 17]] = x[:, [3, 17]] * 60 + 20
    x[5, 2], x[6, 9], x[7] = float("nan"), float("inf"), 0.0
    return x


def write(path: Path, x: torch.Tensor, **options: Any) -> None:
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", SETTINGS), **options)
    for first in range(0, ROWS, BATCH):  # a short last batch
        stop = min(first + BATCH, ROWS)
        writer.write({"x": x[first:stop]}, list(range(first, stop)))
    writer.close()


def shard_bytes(path: Path) -> dict[str, np.ndarray]:
    """Each tensor of the store's one shard as its raw bytes (uint8), by hand."""
    (record,) = read_ledgers(path)
    raw = (path / record.file).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    data = np.frombuffer(raw, np.uint8)[8 + length :]
    return {name: data[slice(*info["data_offsets"])] for name, info in header.items()}


def eight_bit_values(dtype: torch.dtype) -> np.ndarray:
    """The float64 value of each byte of an 8-bit float, from its bit layout."""
    exponent_bits, mantissa_bits, bias, kind = EIGHT_BIT[dtype]
    code = np.arange(256)
    sign = np.where(code >> 7, -1.0, 1.0)
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    fraction = mantissa / (1 << mantissa_bits)
    normal = sign * 2.0 ** (exponent - bias) * (1 + fraction)
    values = np.where(exponent == 0, sign * 2.0 ** (1 - bias) * fraction, normal)
    top = exponent == (1 << exponent_bits) - 1
    if kind == "fn":  # only all ones is NaN
        values[top & (mantissa == (1 << mantissa_bits) - 1)] = np.nan
    elif kind == "fnuz":  # the negative zero's code is NaN
        values[0x80] = np.nan
    else:  # IEEE: infinities and NaNs
        values[top] = np.where(mantissa[top] == 0, sign[top] * np.inf, np.nan)
    return values


def expected_rows(path: Path, dtype: str) -> np.ndarray:
    """The float32 rows of an uncoded store of ``dtype``, by index, from its bytes."""
    tensors = shard_bytes(path)
    rows = []
    for position in range(-(-ROWS // BATCH)):
        raw = tensors[f"b{position}/x"]
        if dtype == "float32":
            rows.append(raw.view("<f4").reshape(-1, WIDTH))
        elif dtype == "bfloat16":
            rows.append((raw.view("<u2").astype(np.uint32) << 16).view("<f4").reshape(-1, WIDTH))
        else:
            table = eight_bit_values(getattr(torch, dtype)).astype(np.float32)
            scale = tensors[f"b{position}.scale/x"].view("<f4")
            rows.append(table[raw].reshape(-1, WIDTH) * scale[:, None])  # float32 product
    return np.concatenate(rows)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """The same float32 bits, or NaN at the same places (a NaN's sign and payload are
    torch's cast's, checked against torch in the dequantize test)."""
    nan = np.isnan(a)
    bits = np.where(nan, 0, a.view(np.uint32)), np.where(nan, 0, b.view(np.uint32))
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and np.array_equal(*bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant_reads_the_stored_values_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    x = activations()
    for codec in (None, "zstd"):
        write(tmp_path / f"{codec}", x, dtype=dtype, codec=codec)
    expected = expected_rows(tmp_path / "None", dtype)
    for codec in (None, "zstd"):
        path = tmp_path / f"{codec}"
        data = StoreRows(path, "x", batch_size=37, seed=1, with_indices=True, dtype="float32")
        batches = list(data)
        read = torch.cat([b["x"] for b in batches]).numpy()
        index = torch.cat([b["index"] for b in batches]).numpy()
        assert sorted(index.tolist()) == list(range(ROWS))
        assert same_bits(read, expected[index]), (dtype, codec)
        asked = np.array([309, 0, 150, 7, 150, 74, 75])  # a row twice, both ends of batches
        rows = FeatureStore(path).rows_at("x", asked.tolist()).rows
        assert same_bits(rows.float().numpy(), expected[asked]), (dtype, codec)


def coded_shard(path: Path) -> tuple[CodedShard, np.ndarray]:
    """The coded store's shard and its tensors' bytes laid out as its virtual spans say,
    taken from the same store written without a codec."""
    (record,) = read_ledgers(path / "zstd")
    shard = CodedShard(LocalShard(path / "zstd" / record.file), KeptBlocks())
    plain = shard_bytes(path / "plain")
    virtual = np.zeros(max(span.end for span in shard.spans.values()), np.uint8)
    for name, span in shard.spans.items():
        virtual[span.start : span.end] = plain[name]
    return shard, virtual


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_gather_at_any_offsets_gives_the_bytes_there(tmp_path: Path, dtype: str) -> None:
    x = activations()
    write(tmp_path / "plain", x, dtype=dtype)
    write(tmp_path / "zstd", x, dtype=dtype, codec="zstd")
    shard, virtual = coded_shard(tmp_path)
    rng = np.random.default_rng(0)
    for width in (1, 4, 7, 96, 1000, 1003):  # rows, a scale, unaligned, a block, across two
        offsets = [
            rng.integers(span.start, span.end - width + 1, 20)
            for span in shard.spans.values()
            if span.end - span.start >= width
        ]
        asked = rng.permutation(np.concatenate(offsets))
        got = shard.gather(asked, width)
        assert np.array_equal(got, np.stack([virtual[o : o + width] for o in asked.tolist()]))


def test_gather_outside_a_tensor_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "plain", activations())
    write(tmp_path / "zstd", activations(), codec="zstd")
    shard, _ = coded_shard(tmp_path)
    span = shard.spans["b0/x"]
    with pytest.raises(StoreError, match="lie outside its tensor 'b0/x'"):
        shard.gather(np.array([span.start, span.end - 2]), 4)


def test_the_blocks_of_one_read_decode_once_each_on_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_pool, "threads", lambda: 3)
    monkeypatch.setattr(decode_pool, "PARALLEL_BYTES", 0)  # blocks of 960 bytes here
    write(tmp_path / "plain", activations())
    write(tmp_path / "zstd", activations(), codec="zstd")
    shard, virtual = coded_shard(tmp_path)
    decode, seen, names = coded_module.decode_block, [], set()
    barrier = threading.Barrier(2, timeout=5)  # two decodes at once, or a BrokenBarrierError

    def counting(raw: Any, info: Any, block: int, shuffle: bool, where: str, **how: Any) -> Any:
        seen.append(where)
        names.add(threading.current_thread().name)
        if len(seen) <= 2:
            barrier.wait()
        return decode(raw, info, block, shuffle, where, **how)

    monkeypatch.setattr(coded_module, "decode_block", counting)
    span = shard.spans["b0/x"]
    offsets = np.arange(span.start, span.end, WIDTH * 4)
    for _ in range(2):  # the second read finds every block kept
        got = shard.gather(offsets[::-1], WIDTH * 4)
        assert np.array_equal(got, virtual[offsets[::-1, None] + np.arange(WIDTH * 4)])
    blocks = -(-BATCH * WIDTH * 4 // (BLOCK // (WIDTH * 4) * WIDTH * 4))
    assert len(seen) == len(set(seen)) == blocks  # each block of b0/x once
    assert len(names) >= 2 and any(name.startswith("iocatch-decode") for name in names)
    assert not [t for t in threading.enumerate() if t.name.startswith("iocatch-decode")]


def test_a_damaged_block_among_many_raises_in_the_caller_and_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_pool, "threads", lambda: 4)
    monkeypatch.setattr(decode_pool, "PARALLEL_BYTES", 0)
    write(tmp_path / "plain", activations())
    write(tmp_path / "zstd", activations(), codec="zstd")
    shard, _ = coded_shard(tmp_path)
    physical = shard.raw.spans["b1/x"]
    file = Path(str(shard.raw))
    raw = bytearray(file.read_bytes())
    raw[physical.start + 40] ^= 0xFF  # inside the first block's frame
    file.write_bytes(bytes(raw))
    span = shard.spans["b1/x"]
    with pytest.raises(StoreError, match=r"tensor 'b1/x' block 0 is damaged"):
        shard.gather(np.arange(span.start, span.end, WIDTH * 4), WIDTH * 4)
    assert not [t for t in threading.enumerate() if t.name.startswith("iocatch-decode")]


def test_parallel_map_keeps_order_bounds_threads_and_raises_the_first_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_pool, "threads", lambda: 3)
    running, most, lock = [0], [0], threading.Lock()

    def square(item: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.002)
        with lock:
            running[0] -= 1
        if item in (7, 5):
            raise ValueError(f"item {item}")
        return item * item

    assert decode_pool.parallel_map(square, [1, 2, 3, 4]) == [1, 4, 9, 16]
    with pytest.raises(ValueError, match="item 5"):  # the first in the items' order
        decode_pool.parallel_map(square, list(range(10)))
    assert most[0] <= 3 and running[0] == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("iocatch-decode")]
    most[0] = 0
    assert decode_pool.parallel_map(square, [1, 2, 3], nbytes=100) == [1, 4, 9]
    assert most[0] == 1  # a small read: on the calling thread alone


@pytest.mark.parametrize("dtype", sorted(EIGHT_BIT, key=str))
def test_dequantize_is_each_codes_value_times_its_rows_scale(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    scale = torch.tensor([1.0, 0.3, 2.5e-3, 7e30])
    read = dequantize(codes.view(dtype), scale, torch.float32).numpy()
    values = eight_bit_values(dtype).astype(np.float32).reshape(4, 64)
    assert same_bits(read, values * scale.numpy()[:, None])
    reference = codes.view(dtype).to(torch.float32) * scale[:, None]  # torch's own cast
    assert np.array_equal(read.view(np.uint32), reference.numpy().view(np.uint32))  # NaNs too
    strided = codes.view(dtype)[1:3].t()  # 64 rows of 2, not contiguous
    scales = torch.linspace(0.01, 3.0, 64)
    half = dequantize(strided, scales, torch.bfloat16)
    expected = torch.from_numpy(values[1:3].T * scales.numpy()[:, None]).bfloat16()
    assert torch.equal(half.isnan(), expected.isnan())
    assert torch.equal(half.nan_to_num(), expected.nan_to_num())
    odd = codes.reshape(-1)[:255].reshape(5, 51).view(dtype)  # an odd number of codes
    odd_scale = torch.tensor([1.0, 0.3, 2.5e-3, 7e30, 3.0])
    reference = odd.to(torch.float32) * odd_scale[:, None]
    read_odd = dequantize(odd, odd_scale, torch.float32)
    assert np.array_equal(read_odd.numpy().view(np.uint32), reference.numpy().view(np.uint32))


def test_dropped_blocks_memory_is_decoded_into_again_never_one_still_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "plain", activations())
    write(tmp_path / "zstd", activations(), codec="zstd")
    shard, virtual = coded_shard(tmp_path)
    shard.kept.resize(3 * 960)  # three float32 blocks of 10 rows
    decode, into = coded_module.decode_block, []

    def recording(raw: Any, info: Any, block: int, shuffle: bool, where: str, **how: Any) -> Any:
        into.append(how.get("into"))
        return decode(raw, info, block, shuffle, where, **how)

    monkeypatch.setattr(coded_module, "decode_block", recording)
    span = shard.spans["b0/x"]
    held = shard.gather(np.array([span.start]), 4)  # block 0 decoded, then kept
    (block_0,) = shard.kept.get_many([(shard.name, "b0/x", 0)])
    assert block_0 is not None
    kept_bytes = block_0.copy()
    for first in range(0, BATCH, 10):  # one block at a time: each drops the oldest
        rows = np.arange(first, min(first + 10, BATCH))
        offsets = span.start + rows * WIDTH * 4
        got = shard.gather(offsets, WIDTH * 4)
        assert np.array_equal(got, virtual[offsets[:, None] + np.arange(WIDTH * 4)])
    reused = [memory for memory in into if memory is not None]
    assert reused and all(memory is not block_0 for memory in reused)  # held here: never
    assert np.array_equal(block_0, kept_bytes) and held.shape == (1, 4)
