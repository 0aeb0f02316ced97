"""Progress bars of long work (store/progress.py, through cli.py and the store's functions).

A bar goes to stderr, only when stderr is a terminal (or ``progress=True``), never with
``--quiet`` (or ``progress=False``), never to stdout, and changes nothing of what the work
prints, writes or raises. A terminal is a ``StringIO`` that says it is one, or (once) a
real pseudo-terminal in a process of its own.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback
from lightning_iocatch.cli import main
from lightning_iocatch.store.plan import Mode, prepare_store
from lightning_iocatch.store.progress import progress_bar
from lightning_iocatch.store.writer import ShardWriter
from tests.lightning_models import TinyModule, loader, trainer

ROOT = Path(__file__).resolve().parents[1]
MODES = ("terminal", "pipe", "quiet")  # stderr a terminal; not one; a terminal with --quiet
SETTINGS = {"spec": None, "stage": "predict", "dtype": None}


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as ``sys.stderr`` is in a shell."""

    def isatty(self) -> bool:
        return True


def cli(mode: str, *args: str) -> tuple[int, str, str]:
    """``lightning-iocatch ARGS`` with stderr a terminal or not: exit code, stdout, stderr."""
    out, err = io.StringIO(), Terminal() if mode != "pipe" else io.StringIO()
    quiet = ["--quiet"] if mode == "quiet" else []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, *quiet])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real predict loop of 30 rows in several shards (500-byte bound)."""
    path = tmp_path_factory.mktemp("progress") / "store"
    torch.manual_seed(0)
    writer = FeatureWriter(path, max_shard_bytes=500)
    callback = IOCaptureCallback("outputs[model.layers.1]", writer=writer)
    trainer([callback]).predict(TinyModule(), loader(30, 4), return_predictions=False)
    return path


def dump(path: str, mode: Mode = "create", progress: bool | None = None) -> None:
    """Rows 0..29 in batches of 4, shards of about 300 bytes."""
    plan = prepare_store(path, mode, SETTINGS, progress=progress)
    writer = ShardWriter(path, rank=0, plan=plan, max_shard_bytes=300)
    for start in range(0, 30, 4):
        indices = list(range(start, min(start + 4, 30)))
        writer.write({"h": torch.arange(len(indices) * 3.0).reshape(-1, 3)}, indices)
    writer.close()


def test_inspect_verify_draws_a_bar_only_on_a_terminal(store: Path) -> None:
    shards = len(FeatureStore(store, progress=False).metadata["shards"])
    assert shards > 1
    runs = {mode: cli(mode, "inspect", str(store), "--verify") for mode in MODES}
    code, stdout, bar = runs["terminal"]
    assert code == 0 and "every ledger line and every shard match their CRC-32" in stdout
    assert f"verify:   0%|          | 0/{shards} [" in bar and "shard/s]" in bar
    assert runs["pipe"] == runs["quiet"] == (0, stdout, "")  # the same output, no bar


def test_export_draws_a_bar_only_on_a_terminal_and_writes_the_same_rows(
    store: Path, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    outputs = {}
    for mode in MODES:
        out = tmp_path / mode
        code, stdout, stderr = cli(mode, "export", str(store), str(out))
        assert code == 0 and stdout == f"wrote {out} (read it with datasets.load_from_disk)\n"
        if mode == "terminal":
            assert "export:   0%|          | 0/30 [" in stderr and "row/s]" in stderr
        else:
            assert stderr == ""  # neither ours nor the `datasets` bar of the save
        outputs[mode] = datasets.load_from_disk(str(out)).with_format("torch")
    truth = FeatureStore(store)
    key = "model.layers.1/outputs"
    for dataset in outputs.values():
        rows = dataset[:]
        order = torch.argsort(rows["index"])
        assert torch.equal(rows["index"][order], truth.indices)
        assert torch.equal(rows[key][order], truth[key])


def test_a_bar_is_closed_and_the_error_passes_unchanged(store: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(store, tmp_path / "copy"))
    shard = copy / "shard-r000-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    error = f"error: shard {shard} does not match its checksum: it is corrupted"
    code, stdout, stderr = cli("terminal", "inspect", str(copy), "--verify")
    assert code == 2 and stdout == ""
    assert "verify" in stderr and stderr.endswith(f"\r{error}\n")  # the bar's line cleared first
    assert cli("pipe", "inspect", str(copy), "--verify") == (2, "", f"{error}\n")
    err = Terminal()
    with (
        contextlib.redirect_stderr(err),
        pytest.raises(KeyError, match="boom"),
        progress_bar(True, "work", total=3, unit="step") as advance,
    ):
        advance(1)
        raise KeyError("boom")
    assert "work" in err.getvalue() and err.getvalue().endswith("\r")  # closed: line cleared


def test_object_storage_open_resume_and_overwrite_draw_bars(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dump(url)
    capsys.readouterr()
    fs = fsspec.filesystem("memory")
    stray = url.removeprefix("memory://") + "/shard-r000-000099.safetensors"
    fs.pipe_file(stray, b"debris of a killed run")
    plan = prepare_store(url, "resume", SETTINGS, progress=True)
    resumed = capsys.readouterr()
    assert "read commit records" in resumed.err and "delete uncommitted shards" in resumed.err
    assert resumed.out == "" and not fs.exists(stray)
    assert plan.committed[0].ranges().tolist() == [[0, 29]]  # what dump wrote, bar or not
    assert FeatureStore(url, progress=True).indices.tolist() == list(range(30))
    opened = capsys.readouterr()
    assert "read commit records" in opened.err and opened.out == ""
    dump(url, mode="overwrite", progress=True)
    overwritten = capsys.readouterr()
    assert "delete the old store" in overwritten.err and overwritten.out == ""
    assert FeatureStore(url).indices.tolist() == list(range(30))  # not a terminal: no bar
    dump(url, mode="overwrite")
    fs.pipe_file(stray, b"debris")
    prepare_store(url, "resume", SETTINGS)
    assert capsys.readouterr() == ("", "") and not fs.exists(stray)


def test_a_feature_writer_shows_its_overwrite_bar_only_where_the_trainer_shows_one(
    url: str,
) -> None:
    dump(url)
    for shown in (False, True):
        err = Terminal()
        callback = IOCaptureCallback(
            "outputs[model.layers.1]", writer=FeatureWriter(url, mode="overwrite")
        )
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            trainer([callback], enable_progress_bar=shown).predict(
                TinyModule(), loader(8, 4), return_predictions=False
            )
        assert ("delete the old store" in err.getvalue()) is shown
        assert FeatureStore(url).indices.tolist() == list(range(8))


def test_progress_must_be_true_false_or_none(store: Path) -> None:
    with pytest.raises(TypeError, match="`progress` must be True, False or None, got 'yes'"):
        FeatureStore(store, progress="yes")  # type: ignore[arg-type]


def test_inspect_and_export_offer_quiet() -> None:
    for command in ("inspect", "export"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--quiet" in out.getvalue() and "no progress bar" in out.getvalue()


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_a_real_terminal_gets_the_bar_and_stdout_stays_clean(store: Path) -> None:
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    size = struct.pack("HHHH", 24, 100, 0, 0)  # rows, columns: a new one has none
    fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    command = [sys.executable, "-m", "lightning_iocatch", "inspect", str(store), "--verify"]
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=slave,
    ) as process:
        os.close(slave)  # the child holds the terminal now
        terminal = b""
        with contextlib.suppress(OSError):  # EIO: the child closed the terminal
            while chunk := os.read(master, 4096):
                terminal += chunk
        stdout = process.stdout.read() if process.stdout else b""
        code = process.wait(timeout=120)
    os.close(master)
    assert code == 0 and stdout.decode() == cli("pipe", "inspect", str(store), "--verify")[1]
    assert b"verify:   0%" in terminal and b"shard/s]" in terminal
