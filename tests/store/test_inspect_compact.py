"""``inspect`` lays out its key table in columns whatever the dtype's name (the ground truth:
each cell cut from the line at its header's column, compared with what was written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_iocatch.cli import main
from lightning_iocatch.store.plan import prepare_store
from lightning_iocatch.store.writer import ShardWriter

SETTINGS = {"spec": None, "stage": "predict", "dtype": None, "world_size": 1}


def test_inspect_columns_stay_aligned_with_a_scaled_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s"
    writer = ShardWriter(
        path, rank=0, plan=prepare_store(path, "create", SETTINGS), dtype="float8_e4m3fn"
    )
    writer.write({"x": torch.randn(6, 5), "ids": torch.arange(6)}, list(range(6)))
    writer.close()
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("key "))
    table = lines[lines.index(header) + 1 : lines.index(header) + 3]
    at = [header.index(name) for name in ("dtype", "row shape")]
    cells = {
        line.split()[0]: (line[at[0] : at[1]].strip(), line[at[1] :].split()[0]) for line in table
    }
    assert cells == {"x": ("float8_e4m3fn (scaled per row)", "(5,)"), "ids": ("int64", "()")}
    assert all(line.rstrip().endswith("6") and len(line) == len(header) for line in table)
