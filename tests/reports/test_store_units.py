"""summarize_store over a store of token rows: every row once, each sample's tokens
together, the same whatever the store's batches, the steps, or the processes.

Ground truth: the stored rows read whole (``FeatureStore.rows``) and a NumPy lexsort by
(value desc, dataset index, position). Also the script of the 2-process case:

    python tests/reports/test_store_units.py STORE OUT RANK PORT
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_iocatch import FeatureStore, TokenRows
from lightning_iocatch.probes import UnitActivations, UnitSummary
from lightning_iocatch.reports.store_units import _steps, summarize_store
from lightning_iocatch.store.names import POSITION_KEY, TOKEN_ID_KEY
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter
from tests.probes.test_units import numpy_top

ROOT = Path(__file__).resolve().parents[2]
KEY, SAMPLES, SEQ, UNITS = "m/outputs", 40, 9, 6


def write_store(path: Path, batch_size: int) -> None:
    """40 left-padded samples of up to 9 tokens, each token's 6 values, in ties of 1/4."""
    tokens = TokenRows()
    settings = {"spec": None, "stage": "predict", "dtype": None, "tokens": tokens.settings()}
    writer = ShardWriter(path, rank=0, plan=prepare_store(path, "create", settings))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, SEQ + 1, (SAMPLES,), generator=generator)
    values = torch.randint(0, 8, (SAMPLES, SEQ, UNITS), generator=generator).float() / 4
    for first in range(0, SAMPLES, batch_size):
        rows = range(first, min(first + batch_size, SAMPLES))
        mask = torch.stack([torch.arange(SEQ) >= SEQ - lengths[i] for i in rows]).long()
        ids = torch.arange(SEQ)[None] + 10 * torch.tensor(list(rows))[:, None]
        selection = tokens.select({"input_ids": ids, "attention_mask": mask})
        hidden = selection.capture(values[first : first + len(rows)])
        assert hidden is not None
        writer.write({KEY: hidden}, indices=list(rows), tokens=selection, token_keys={KEY})
    writer.close()


def truth(path: Path, k: int) -> np.ndarray:
    store = FeatureStore(path)
    indices, rows = store.rows(KEY)
    positions = store.rows(POSITION_KEY)[1].long()
    return numpy_top(rows.numpy(), indices.numpy(), positions.numpy(), k)


def same(a: UnitSummary, b: UnitSummary) -> None:
    for name in ("top_values", "top_index", "top_position", "context_ids", "context_values"):
        assert torch.equal(getattr(a, name).nan_to_num(-9), getattr(b, name).nan_to_num(-9))
    assert torch.equal(a.active, b.active) and torch.equal(a.histogram, b.histogram)
    assert torch.equal(a.active_sum, b.active_sum)  # added in the rows' order: bit for bit


def test_the_store_gives_the_lexsort_whatever_its_batches_and_steps(tmp_path: Path) -> None:
    write_store(tmp_path / "a", batch_size=7)
    write_store(tmp_path / "b", batch_size=40)
    expected = truth(tmp_path / "a", k=5)
    first = summarize_store(tmp_path / "a", KEY, UnitActivations(k=5, window=3))
    np.testing.assert_array_equal(first.top_values.numpy(), expected[0])
    np.testing.assert_array_equal(first.top_index.numpy(), expected[1])
    np.testing.assert_array_equal(first.top_position.numpy(), expected[2])
    # a window: the sample's ids at the positions around, from the stored token ids
    store = FeatureStore(tmp_path / "a")
    coordinates = zip(store.indices.tolist(), store[POSITION_KEY].tolist(), strict=True)
    ids = dict(zip(coordinates, store[TOKEN_ID_KEY].tolist(), strict=True))
    sample, at = int(expected[1, 2, 0]), int(expected[2, 2, 0])
    around = [ids.get((sample, at + offset), -1) for offset in range(-3, 4)]
    assert first.context_ids[2, 0].tolist() == around
    for batches, step in (("b", 8192), ("b", 10), ("a", 1)):
        other = summarize_store(
            tmp_path / batches, KEY, UnitActivations(k=5, window=3), rows_per_step=step
        )
        same(first, other)


def test_joined_batches_of_another_width_are_refused_by_the_probe(tmp_path: Path) -> None:
    """Small stored batches are fed together; one of another width is not joined to
    them but refused, as the probe refuses it."""
    writer = ShardWriter(tmp_path, rank=0, plan=prepare_store(tmp_path, "create", {"spec": None}))
    writer.write({"h": torch.ones(2, 3)}, indices=[0, 1])
    writer.write({"h": torch.ones(2, 3)}, indices=[2, 3])
    writer.write({"h": torch.ones(2, 4)}, indices=[4, 5])
    writer.close()
    for step in (8192, 1):
        with pytest.raises(ValueError, match="this batch has 4 units, earlier ones 3"):
            summarize_store(tmp_path, "h", UnitActivations(k=1, window=0), rows_per_step=step)


def test_steps_never_cut_a_sample() -> None:
    index = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2, 3])
    assert _steps(index, 4) == [(0, 4), (4, 9), (9, 10)]
    assert _steps(index, 100) == [(0, 10)]


@pytest.mark.slow
def test_two_processes_read_half_the_batches_each_and_agree_with_one(tmp_path: Path) -> None:
    write_store(tmp_path / "store", batch_size=3)
    port = str(29_500 + os.getpid() % 1000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, __file__, str(tmp_path / "store"), str(tmp_path)]
    ranks = [subprocess.Popen([*script, str(rank), port], env=env, cwd=ROOT) for rank in (0, 1)]
    assert [process.wait(timeout=120) for process in ranks] == [0, 0]
    expected = summarize_store(tmp_path / "store", KEY, UnitActivations(k=5, window=3))
    for rank in (0, 1):
        same(UnitSummary.load(tmp_path / f"rank{rank}.safetensors"), expected)


def main(store: str, out: str, rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        summary = summarize_store(store, KEY, UnitActivations(k=5, window=3))
        summary.save(Path(out) / f"rank{rank}.safetensors")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])


def test_a_key_of_whole_padded_sequences_is_refused(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, rank=0, plan=prepare_store(tmp_path, "create", {"spec": None}))
    writer.write({KEY: torch.ones(2, 5, 3)}, indices=[0, 1])  # (samples, seq, d): padding in
    writer.close()
    with pytest.raises(ValueError, match=r"holds whole sequences \(5, 3\) a row.*TokenRows"):
        summarize_store(tmp_path, KEY)


class Recording(torch.nn.Module):
    """An identity encoder in float64 that records the device and dtype of its inputs; on
    the ``meta`` device (a stand-in for a GPU: the rows must move there) it gives zeros."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64, device=device))
        self.seen: list[tuple[torch.device, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.device, x.dtype))
        return torch.zeros(x.shape, dtype=torch.float64) if x.is_meta else x * self.weight


def test_an_encoder_gets_the_rows_on_its_device_in_its_dtype(tmp_path: Path) -> None:
    write_store(tmp_path, batch_size=7)
    plain = summarize_store(tmp_path, KEY, UnitActivations(k=5, window=3))
    on_cpu = Recording("cpu")
    encoded = summarize_store(tmp_path, KEY, UnitActivations(k=5, window=3, of=on_cpu))
    assert set(on_cpu.seen) == {(torch.device("cpu"), torch.float64)}
    same(encoded, plain)  # an identity: the same examples (the stored values are quarters)
    elsewhere = Recording("meta")
    zeros = summarize_store(tmp_path, KEY, UnitActivations(k=5, window=3, of=elsewhere))
    assert set(elsewhere.seen) == {(torch.device("meta"), torch.float64)}
    assert zeros.rows == plain.rows and int(zeros.active.sum()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_encoder_on_a_gpu_summarizes_a_dump_there(tmp_path: Path) -> None:
    write_store(tmp_path, batch_size=7)
    encoder = torch.nn.Linear(UNITS, 4, dtype=torch.float64)
    on_cpu = summarize_store(tmp_path, KEY, UnitActivations(k=5, window=3, of=encoder))
    on_gpu = summarize_store(
        tmp_path, KEY, UnitActivations(k=5, window=3, of=copy.deepcopy(encoder).cuda())
    )
    assert on_gpu.top_index.is_cuda
    for name in ("top_index", "top_position", "context_ids", "active"):
        assert torch.equal(getattr(on_gpu, name).cpu(), getattr(on_cpu, name))
    torch.testing.assert_close(on_gpu.top_values.cpu(), on_cpu.top_values, equal_nan=True)
