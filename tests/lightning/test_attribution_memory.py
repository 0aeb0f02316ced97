"""AttributionPatching holds only the batch in flight: its peak memory does not grow with
the data set.

The model: 6 residual blocks of width 64 over sequences of 512 tokens, batches of 4. One
batch's values of the 6 components in both runs and their gradients are 12 MiB (kept for
the 16 batches of the test, 192 MiB). In a fresh process (this file is also the script),
after a warm-up epoch, an epoch of 2 batches and one of 16 each reset the process' peak
resident memory (``VmHWM``) and report how far its peak rose above the memory resident
before it.

    python tests/lightning/test_attribution_memory.py OUT_FILE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.attribution import AttributionPatching
from tests.conftest import run_script

WIDTH, VOCAB, SEQ, BATCH, BLOCKS = 64, 64, 512, 4, 6
HELD_PER_BATCH_MIB = 4 * BLOCKS * BATCH * SEQ * WIDTH * 4 / 2**20  # 2 runs x (value, grad)
# measured on the 2-core machine at width 512 and 64 tokens (the same bytes): 6.3 MiB (2
# batches), 16.4 (16), 18.3 (48); before the gradient hooks held their site weakly,
# 1,095 MiB (48): every batch's graph was kept


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(x))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(input_ids)))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch["input_ids"])


def data(batches: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    found = []
    for _ in range(batches * BATCH):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        corrupted = ids.clone()
        corrupted[SEQ // 2] = (ids[SEQ // 2] + 1) % VOCAB
        found.append({"input_ids": ids, "corrupted_input_ids": corrupted})
    return found


def _resident_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rises_mib(*batches: int) -> list[float]:
    """How far the peak resident memory rose over an epoch of each number of batches."""
    atp = AttributionPatching(
        "outputs[blocks.*]", conventions="denoising", exact=["blocks.2/outputs"]
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[atp])  # fmt: skip
    model = Model()
    trainer.validate(model, DataLoader(data(2), batch_size=BATCH), verbose=False)  # warm-up
    rises = []
    for count in batches:
        loader = DataLoader(data(count), batch_size=BATCH)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _resident_mib("VmRSS")
        trainer.validate(model, loader, verbose=False)
        rises.append(_resident_mib("VmHWM") - before)
        assert len(atp.scores["denoising"]) == BLOCKS
    return rises


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux' /proc")
@pytest.mark.slow
def test_peak_memory_stays_flat_with_the_number_of_batches(tmp_path: Path) -> None:
    out = tmp_path / "rises.json"
    run_script(__file__, str(out), timeout=240)
    small, large = json.loads(out.read_text())
    kept = 16 * HELD_PER_BATCH_MIB  # 192 MiB: every batch's values and gradients
    assert HELD_PER_BATCH_MIB == 12
    # the bound: a batch in flight (12 MiB) and allocator noise, far below what keeping
    # every batch would take
    assert large < 36 < kept / 4, (small, large)
    assert large - small < 24, (small, large)


if __name__ == "__main__":
    result: Any = peak_rises_mib(2, 16)
    Path(sys.argv[1]).write_text(json.dumps(result))
