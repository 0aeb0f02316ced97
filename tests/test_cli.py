"""cli.py: the lightning-iocatch command, run in this process through ``cli.main`` (one test
starts ``python -m lightning_iocatch`` in a process of its own)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_iocatch import FeatureWriter, IOCaptureCallback
from lightning_iocatch.cli import main
from lightning_iocatch.store.records import ShardRecord
from tests.lightning_models import TinyModule, loader, trainer
from tests.store.test_store_reader import transplant

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> Result:
    """``lightning-iocatch ARGS``: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse: --help, or a bad command line
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


def test_python_dash_m_runs_the_command_in_a_process_of_its_own(store: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_iocatch", "inspect", str(store), "--expected", "99"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stdout.startswith(f"store      {store}")
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_help_of_every_command() -> None:
    for command in (["modules"], ["inspect"], ["export"], ["plot"], ["browse"]):
        result = cli(*command, "--help")
        assert result.returncode == 0 and "usage: lightning-iocatch" in result.stdout
        if command in (["inspect"], ["export"]):  # both read a store on disk or at a URL
            assert "fsspec URL" in result.stdout and "--storage-options JSON" in result.stdout
    assert "modules" in cli("--help").stdout and cli().returncode == 2  # no command


def test_modules_lists_names_types_and_parameters() -> None:
    result = cli("modules", "tests.lightning_models:TinyModule")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["(root)", "TinyModule", "225"]  # 3 x (8*8+8) + 9
    assert ["model.layers.0.0", "RowLinear", "72"] in [line.split() for line in lines]


def test_modules_resolves_a_spec_or_fails_like_the_callback() -> None:
    ok = cli(
        "modules",
        "tests.lightning_models:TinyModule",
        "--spec",
        "outputs[model.layers.*]|inputs[head]",
    )
    assert ok.returncode == 0, ok.stderr
    assert "inputs   head" in ok.stdout
    assert "model.layers.0, model.layers.1, model.layers.2" in ok.stdout
    unknown = cli(
        "modules", "tests.lightning_models:TinyModule", "--spec", "outputs[model.layer.1]"
    )
    assert unknown.returncode == 2 and "did you mean 'model.layers.1'" in unknown.stderr
    malformed = cli("modules", "tests.lightning_models:TinyModule", "--spec", "output[head]")
    assert malformed.returncode == 2 and "did you mean 'outputs'" in malformed.stderr


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tests.cli_targets", "must look like 'package.module:attribute'"),
        ("tests.nowhere:Model", "cannot import 'tests.nowhere'"),
        ("tests.cli_targets:Missing", "has no attribute 'Missing'"),
        ("tests.cli_targets:WIDTH", "neither an nn.Module"),
        ("tests.cli_targets:needs_arguments", "could not be called without arguments"),
        ("tests.cli_targets:not_a_model", "returned list, not an nn.Module"),
    ],
)
def test_modules_rejects_bad_targets(target: str, message: str) -> None:
    result = cli("modules", target)
    assert result.returncode == 2 and message in result.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "store"
    callback = IOCaptureCallback("outputs[model.layers.1]", writer=FeatureWriter(path))
    trainer([callback]).predict(TinyModule(), loader(30, 4), return_predictions=False)
    return path


def test_inspect_a_complete_store(store: Path) -> None:
    result = cli("inspect", str(store), "--verify")
    assert result.returncode == 0, result.stderr
    assert "model.layers.1/outputs" in result.stdout and "(8,)" in result.stdout
    assert (
        "rows       30" in result.stdout and "each of 0..29 present exactly once" in result.stdout
    )


def test_inspect_fails_on_missing_or_duplicated_rows(store: Path, tmp_path: Path) -> None:
    missing = cli("inspect", str(store), "--expected", "32")
    assert (
        missing.returncode == 1
        and "2 dataset indices missing, in 1 gap(s): 30..31" in missing.stderr
    )
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    transplant(store, copy, rank=1)  # every shard again, as rank 1's
    duplicated = cli("inspect", str(copy))
    assert duplicated.returncode == 1 and "30 dataset indices duplicated" in duplicated.stderr
    assert "rows       30" in duplicated.stdout  # each read once, from its first commit
    absent = cli("inspect", str(tmp_path / "nothing"))
    assert absent.returncode == 2 and "is not a feature store" in absent.stderr


def test_inspect_verify_checks_before_printing_anything(store: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(store, tmp_path / "copy"))
    shard = copy / "shard-r000-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of the tensor data: the header still reads well
    shard.write_bytes(bytes(data))
    assert cli("inspect", str(copy)).returncode == 0  # without --verify nothing notices
    result = cli("inspect", str(copy), "--verify")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: shard {shard} does not match its checksum: it is corrupted\n"


def test_inspect_refuses_a_hostile_store_in_one_line(store: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(store, tmp_path / "copy"))
    ledger = copy / "ledger-r000.jsonl"
    lines = ledger.read_text().splitlines(keepends=True)
    record = dataclasses.replace(
        ShardRecord.from_json(lines[0], version=3), file="../outside.safetensors"
    )
    ledger.write_text(record.to_json() + "\n" + "".join(lines[1:]))
    result = cli("inspect", str(copy), "--verify")
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {ledger} line 1 is damaged: `file` '../outside")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--expected", "-3"],
            "error: argument --expected: must be a non-negative integer, got '-3'",
        ),
        (["--dataloader-idx", "x"], "error: argument --dataloader-idx: must be a non-negative"),
        (
            ["--dataloader-idx", "1"],
            "error: {store} holds no captures of dataloader_idx=1; it holds",
        ),
    ],
)
def test_inspect_refuses_bad_arguments_in_one_line(
    store: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with contextlib.suppress(SystemExit):  # argparse exits; a FeatureStore error returns
        assert main(["inspect", str(store), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(message.format(store=store))


def test_inspect_bad_arguments_exit_2_without_usage_or_traceback(store: Path) -> None:
    result = cli("inspect", str(store), "--expected", "ten")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "error: argument --expected: must be a non-negative integer, got 'ten' "
        "(see `lightning-iocatch inspect --help`)\n"
    )


def test_plot_from_metrics_csv(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        "epoch,step,iocatch/a/outputs/probe_acc,iocatch/b/outputs/probe_acc,iocatch/cka/a/outputs~b/outputs\n"
        "0,9,0.5,0.6,0.7\n1,19,0.8,0.9,0.75\n"
    )
    result = cli("plot", str(metrics), "--out", str(tmp_path / "figures"))
    assert result.returncode == 0, result.stderr
    for name in ("probe_by_layer.png", "cka.png"):
        assert (tmp_path / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics.write_text("epoch,step,val_loss\n0,9,1.0\n")
    empty = cli("plot", str(metrics))
    assert empty.returncode == 2 and "holds no iocatch/ metrics" in empty.stderr
    assert cli("plot", str(tmp_path / "none.csv")).returncode == 2
