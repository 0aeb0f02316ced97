"""Resuming a killed dump: every sample exactly once, whatever changed; rank decisions made
once; the store's directory contained.

The ground truth is the data set itself (indices ``0 .. N-1``, each once) and a manual
forward of the same weights. Killed dumps are real ``SIGKILL``s in subprocesses:
``tests/scripts/dump_features.py`` for one process, and this file run as a script for two
(several DDP runs in one launch, the last one killed)::

    python tests/store/test_writer_resume.py OUT_DIR WEIGHTS
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import (
    BatchCaptures,
    CaptureSink,
    FeatureStore,
    FeatureWriter,
    IOCaptureCallback,
    StoreError,
    TokenRows,
)
from lightning_iocatch.probes import ActivationStats
from lightning_iocatch.store.backends.local_records import read_ledgers
from lightning_iocatch.store.names import INDEX_KEY, is_store_file
from lightning_iocatch.store.plan import prepare_store
from tests.lightning_models import (
    ID_STEP,
    TinyModule,
    TinyNet,
    dataset,
    document_loader,
    manual_outputs,
    trainer,
)

pytestmark = pytest.mark.filterwarnings("ignore:predict returned None")  # skipped batches

ROOT = Path(__file__).resolve().parents[2]
SPEC = "outputs[model.layers.1]|inputs[head]"  # as in tests/scripts/dump_features.py
N = 60
SHARD_BYTES = 600


class Dump(TinyModule):
    """The dumped model; records the dataset index of every sample it computes."""

    def __init__(self, weights: Path, kill_at_batch: int | None = None) -> None:
        super().__init__(model=TinyNet(3))
        self.load_state_dict(torch.load(weights), strict=True)
        self.kill_at_batch = kill_at_batch
        self.computed: list[int] = []

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if batch_idx == self.kill_at_batch:
            _kill_both_ranks()
        self.computed += batch[1].tolist()
        return self(batch[0])


def indexed_loader(batch_size: int) -> DataLoader:
    """The samples of ``loader(N)`` with their dataset index as the second field."""
    return DataLoader(TensorDataset(dataset(N).tensors[0], torch.arange(N)), batch_size=batch_size)


def truth(weights: Path) -> dict[str, torch.Tensor]:
    module = Dump(weights)
    outputs = manual_outputs(module, dataset(N).tensors[0])
    return {"head/inputs/args/0": outputs[2], "model.layers.1/outputs": outputs[1]}


def assert_exactly_once(path: Path, weights: Path) -> None:
    """Every sample once, equal to a manual forward, in the reader and in the files."""
    store = FeatureStore(path)
    assert store.indices.tolist() == list(range(N)) and store.duplicated_indices() == []
    expected = truth(weights)
    assert store.keys() == sorted(expected)
    for key, rows in expected.items():
        assert torch.equal(store[key], rows), key
    store.verify()
    on_disk = []
    for record in read_ledgers(path):  # the shards themselves, read by safetensors
        tensors = load_file(path / record.file)
        for position, batch in enumerate(record.batches):
            indices = tensors[f"b{position}/{INDEX_KEY}"]
            assert len(indices) == batch.rows
            for key, rows in expected.items():
                assert torch.equal(tensors[f"b{position}/{key}"], rows[indices])
            on_disk += indices.tolist()
    assert sorted(on_disk) == list(range(N))
    assert not [p for p in path.iterdir() if is_store_file(p.name) and p.name.endswith(".tmp")]


def resume(
    path: Path, weights: Path, batch_size: int, sinks: list[CaptureSink] | None = None, **kw: Any
) -> Dump:
    module = Dump(weights)
    writer = FeatureWriter(path, mode="resume", max_shard_bytes=SHARD_BYTES)
    callback = IOCaptureCallback(SPEC, writer=writer, sinks=sinks or [], **kw)
    trainer([callback]).predict(module, indexed_loader(batch_size), return_predictions=False)
    return module


def save_weights(directory: Path) -> Path:
    """The dumped model's weights (seed 0), saved in ``directory``."""
    torch.manual_seed(0)
    path = directory / "weights.pt"
    torch.save(TinyModule(model=TinyNet(3)).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_weights(tmp_path_factory.mktemp("weights"))


def killed_dump(path: Path, weights: Path, *options: str) -> Path:
    """A one-process dump SIGKILLed at batch 9 of 15 (batches of 4)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DUMP_WEIGHTS": str(weights)}
    script = ROOT / "tests/scripts/dump_features.py"
    result = subprocess.run(
        [sys.executable, str(script), str(path), "--kill-at-batch", "9", *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Path:
    path = killed_dump(tmp_path_factory.mktemp("killed") / "store", weights)
    committed = FeatureStore(path).indices.tolist()
    assert 0 < len(committed) < N and committed == list(range(len(committed)))
    return path


@pytest.fixture(scope="module")
def killed_documents(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Path:
    """The same dump of samples keyed by document ids 10**12 apart."""
    path = tmp_path_factory.mktemp("killed-documents") / "store"
    killed_dump(path, weights, "--document-ids")
    committed = FeatureStore(path).indices.tolist()
    assert 0 < len(committed) < N and committed == [k * ID_STEP for k in range(len(committed))]
    return path


def copy_of(store: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(store, tmp_path / "store", symlinks=True))


# One process, killed; resumed in this process


def test_resume_computes_and_writes_only_the_missing_samples(
    killed: Path, weights: Path, tmp_path: Path
) -> None:
    path = copy_of(killed, tmp_path)
    committed = FeatureStore(path).indices.tolist()
    ledger_before = (path / "ledger-r000.jsonl").read_bytes()
    module = resume(path, weights, batch_size=4)
    assert sorted(module.computed) == list(range(len(committed), N))  # committed: not computed
    assert_exactly_once(path, weights)
    assert (path / "ledger-r000.jsonl").read_bytes().startswith(ledger_before)


class Recorder(CaptureSink):
    def __init__(self) -> None:
        self.indices: list[int] = []

    def on_batch(self, batch: BatchCaptures) -> None:
        self.indices += batch.indices or ()


def test_resume_with_straddling_batches_and_other_sinks_writes_each_row_once(
    killed: Path, weights: Path, tmp_path: Path
) -> None:
    # Batches of 7 straddle the committed rows (whole batches of 4), and the other sinks
    # need every batch computed: the writer alone decides, row by row, what to write.
    path = copy_of(killed, tmp_path)
    user = Recorder()
    module = resume(
        path,
        weights,
        batch_size=7,
        sinks=[user],
        probes=[ActivationStats()],
        keep_in_memory=True,
        stages=("validate", "predict"),
    )
    assert sorted(module.computed) == sorted(user.indices) == list(range(N))
    assert_exactly_once(path, weights)


def test_a_complete_last_ledger_line_without_newline_counts_for_reader_and_resume(
    killed: Path, weights: Path, tmp_path: Path
) -> None:
    path = copy_of(killed, tmp_path)
    ledger = path / "ledger-r000.jsonl"
    ledger.write_bytes(ledger.read_bytes().removesuffix(b"\n"))
    committed = FeatureStore(path).indices.tolist()
    module = resume(path, weights, batch_size=4)
    assert sorted(module.computed) == list(range(len(committed), N))
    assert_exactly_once(path, weights)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"spec": "outputs[model.layers.1]"},
            "holds captures with spec 'inputs\\[head\\]\\|outputs\\[model.layers.1\\]', but "
            "this writer's spec is 'outputs\\[model.layers.1\\]'; resume with the same spec",
        ),
        ({"dtype": "float16"}, "holds captures with dtype None, but this writer's dtype is 'flo"),
    ],
)
def test_resume_with_another_spec_or_dtype_is_refused(
    killed: Path, weights: Path, tmp_path: Path, options: dict[str, str], match: str
) -> None:
    path = copy_of(killed, tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    writer = FeatureWriter(path, mode="resume", dtype=options.get("dtype"))
    callback = IOCaptureCallback(options.get("spec", SPEC), writer=writer)
    with pytest.raises(StoreError, match=match):
        trainer([callback]).predict(Dump(weights), indexed_loader(4), return_predictions=False)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


# The lifecycle: one writer, one dump; a start that failed leaves nothing in the way


class Tokens(pl.LightningModule):
    """An embedding over tuple batches ``(input_ids, attention_mask)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.embed(batch[0])


def token_batches() -> DataLoader:
    ids = torch.arange(24).reshape(6, 4) % 10
    mask = torch.ones(6, 4, dtype=torch.long)
    return DataLoader(TensorDataset(ids, mask), batch_size=2)


@pytest.mark.parametrize("mode", ["create", "resume"])
def test_a_dump_refused_at_its_first_batch_leaves_nothing_in_the_way(
    tmp_path: Path, mode: str
) -> None:
    """Before, the refused start left store.json: the corrected rerun with mode='create' was
    refused as not empty, and mode='resume' as holding other token settings."""
    path = tmp_path / "store"
    refused = IOCaptureCallback("outputs[embed]", writer=FeatureWriter(path, tokens=TokenRows()))
    with pytest.raises(ValueError, match="the batch is a list without one; pass `mask=`"):
        trainer([refused]).predict(Tokens(), token_batches(), return_predictions=False)
    corrected = TokenRows(mask=lambda batch: batch[1] == 1)
    writer = FeatureWriter(path, tokens=corrected, mode=mode)  # type: ignore[arg-type]
    callback = IOCaptureCallback("outputs[embed]", writer=writer)
    trainer([callback]).predict(Tokens(), token_batches(), return_predictions=False)
    store = FeatureStore(path)
    assert len(store) == 24 and store.metadata["tokens"]["mask"] == corrected.settings()["mask"]
    with torch.no_grad():
        truth = Tokens().embed(torch.arange(24).reshape(6, 4) % 10).reshape(24, 4)
    assert torch.equal(store["embed/outputs"], truth)


def test_create_takes_over_only_a_start_that_wrote_no_shard(tmp_path: Path) -> None:
    """A shard without a record (its ledger lost, or copied without it) is someone's only
    copy: ``create`` refuses it, naming overwrite, and deletes nothing."""
    from lightning_iocatch.store.plan import prepare_store

    settings = {"spec": SPEC, "stage": "predict"}
    prepare_store(tmp_path, "create", settings)
    (tmp_path / "shard-r000-000000.safetensors.tmp").write_bytes(b"cut short")
    prepare_store(tmp_path, "create", settings)  # store.json and a .tmp: taken over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store.json"]
    (tmp_path / "shard-r000-000000.safetensors").write_bytes(b"finished, no record")
    with pytest.raises(StoreError, match="is not empty; .*mode='overwrite'"):
        prepare_store(tmp_path, "create", settings)
    assert (tmp_path / "shard-r000-000000.safetensors").read_bytes() == b"finished, no record"


def test_a_resume_with_other_settings_is_refused_once_anything_is_committed(
    killed: Path, tmp_path: Path
) -> None:
    from lightning_iocatch.store.plan import prepare_store

    path = copy_of(killed, tmp_path)
    with pytest.raises(StoreError, match="holds captures with spec"):
        prepare_store(path, "resume", {"spec": "outputs[head]", "stage": "predict"})
    with pytest.raises(StoreError, match="is not empty"):
        prepare_store(path, "create", {"spec": SPEC, "stage": "predict"})


def test_a_second_predict_with_the_same_writer_is_refused_naming_the_fix(
    weights: Path, tmp_path: Path
) -> None:
    """Before: refused as "not empty", which tells the user nothing of what happened."""
    callback = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path / "store"))
    run = trainer([callback])
    run.predict(Dump(weights), indexed_loader(4), return_predictions=False)
    with pytest.raises(
        StoreError,
        match=r"\(mode='create'\) already wrote its dump to .*store in an earlier "
        r"trainer\.predict, and a second run in that mode would write over it: .*mode='resume'",
    ):
        run.predict(Dump(weights), indexed_loader(4), return_predictions=False)
    assert_exactly_once(tmp_path / "store", weights)
    resuming = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path / "store", mode="resume"))
    again = trainer([resuming])
    for _ in range(2):  # a resume may run again: after a failure, or with a smaller batch
        module = Dump(weights)
        again.predict(module, indexed_loader(5), return_predictions=False)
        assert module.computed == []
    assert_exactly_once(tmp_path / "store", weights)


def test_a_writer_belongs_to_one_callback(tmp_path: Path) -> None:
    """Before, each callback set ``writer.spec``: the last one's spec went into the store."""
    writer = FeatureWriter(tmp_path)
    first = IOCaptureCallback("outputs[model.layers.1]", writer=writer)
    assert writer.spec == "outputs[model.layers.1]"
    with pytest.raises(ValueError, match="already belongs to another IOCaptureCallback"):
        IOCaptureCallback("outputs[model.layers.2]", writer=writer)
    twice = FeatureWriter(tmp_path / "b")
    with pytest.raises(ValueError, match="given twice"):
        IOCaptureCallback("outputs[model.layers.2]", writer=twice, sinks=[twice])
    IOCaptureCallback("outputs[model.layers.2]", writer=twice)  # a refused callback took none
    assert first.spec.to_string() == writer.spec
    with pytest.raises(AttributeError):
        writer.spec = "outputs[model.layers.2]"  # type: ignore[misc]


# The store's directory: debris of a kill is cleaned, nothing else is touched


def serializer_temp(tmp_path: Path) -> bytes:
    """The first bytes safetensors' save_file writes for one of our shards."""
    from safetensors.torch import save_file

    tensors = {f"b0/{INDEX_KEY}": torch.arange(4), "b0/x": torch.zeros(4, 1000)}
    save_file(tensors, str(tmp_path / "full"), metadata={"format": "lightning-iocatch-store/1"})
    return (tmp_path / "full").read_bytes()[:3000]  # killed mid-write


def test_resume_cleans_the_debris_of_a_kill_and_nothing_else(
    killed: Path, weights: Path, tmp_path: Path
) -> None:
    path = copy_of(killed, tmp_path)
    shard = sorted(path.glob("shard-*.safetensors"))[0].read_bytes()
    debris = {
        "shard-r000-000041.safetensors.tmp": shard[:100],  # our serializer, killed
        "shard-r000-000040.safetensors": shard,  # renamed, but no ledger line
        "store.json.tmp": b"{",
        ".tmpAb12Cd": serializer_temp(tmp_path),  # safetensors' save_file, killed
    }
    users = {
        "notes.tmp": b"mine",
        ".tmpXy34Ef": b"also mine, named like a temporary file",
        "shard-notes.txt": b"mine too",
    }
    for name, data in {**debris, **users}.items():
        (path / name).write_bytes(data)
    resume(path, weights, batch_size=4)
    for name, data in users.items():
        assert (path / name).read_bytes() == data
    assert not [name for name in debris if (path / name).exists()]
    assert_exactly_once(path, weights)


def test_overwrite_deletes_the_stores_files_only(weights: Path, tmp_path: Path) -> None:
    path = tmp_path / "store"
    dump = IOCaptureCallback(SPEC, writer=FeatureWriter(path, max_shard_bytes=SHARD_BYTES))
    trainer([dump]).predict(Dump(weights), indexed_loader(4), return_predictions=False)
    users = {"notes.tmp": b"mine", ".tmpXy34Ef": b"mine", "ledger-r000.jsonl.bak": b"mine"}
    for name, data in users.items():
        (path / name).write_bytes(data)
    (path / ".tmpAb12Cd").write_bytes(serializer_temp(tmp_path))
    again = IOCaptureCallback(SPEC, writer=FeatureWriter(path, mode="overwrite"))
    trainer([again]).predict(Dump(weights), indexed_loader(6), return_predictions=False)
    assert {name: (path / name).read_bytes() for name in users} == users
    assert not (path / ".tmpAb12Cd").exists()
    assert_exactly_once(path, weights)


@pytest.mark.parametrize("mode", ["resume", "overwrite"])
@pytest.mark.parametrize(
    "name",
    ["ledger-r000.jsonl", "shard-r000-000040.safetensors", "shard-r000-000041.safetensors.tmp"],
)
def test_a_symbolic_link_in_the_store_is_never_written_through(
    killed: Path, weights: Path, tmp_path: Path, name: str, mode: str
) -> None:
    path = copy_of(killed, tmp_path)
    outside = tmp_path / "outside"
    original = (path / name).read_bytes() if (path / name).exists() else b"precious"
    outside.write_bytes(original)
    (path / name).unlink(missing_ok=True)
    (path / name).symlink_to(outside)
    writer = FeatureWriter(path, mode=mode)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match=f"{name} is a symbolic link"):
        trainer([IOCaptureCallback(SPEC, writer=writer)]).predict(
            Dump(weights), indexed_loader(4), return_predictions=False
        )
    assert outside.read_bytes() == original and (path / name).is_symlink()


@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_files_get_the_permissions_of_the_umask(weights: Path, tmp_path: Path, umask: int) -> None:
    before = os.umask(umask)
    try:
        dump = IOCaptureCallback(SPEC, writer=FeatureWriter(tmp_path, max_shard_bytes=SHARD_BYTES))
        trainer([dump]).predict(Dump(weights), indexed_loader(4), return_predictions=False)
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o666 & ~umask}, modes


# Two processes: one launch, several runs, the last one killed


def _kill_both_ranks() -> None:
    """Rank 0 kills rank 1 and then itself; rank 1 waits to be killed."""
    time.sleep(1.0)  # let the writer threads commit what they hold
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        os.kill(int(os.environ["IOCATCH_TEST_RANK1_PID"]), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def ddp_main(out: Path, weights: Path) -> None:
    """Runs of 2-process DDP dumps in one launch; each rank notes each run's outcome."""
    import lightning_iocatch.store.backends.local as local

    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))

    def sees_a_stray_file(path: Path) -> list[str]:
        return [*os.listdir(path), "stray.txt"]

    def cannot_read(path: Path) -> dict[str, Any]:
        raise StoreError(f"{path} is on another machine's disk")

    real_list, real_read = local._list_dir, local.LocalBackend.read_info

    def run(name: str, mode: str = "create", batch_size: int = 4, **patch: Any) -> None:
        data = document_loader(N, batch_size) if patch.get("documents") else None
        local._list_dir = patch.get("list_dir", {}).get(rank, real_list)  # type: ignore[assignment]
        local.LocalBackend.read_info = patch.get("read", {}).get(rank, real_read)  # type: ignore[method-assign]
        start = time.monotonic()
        (out / name).mkdir(exist_ok=True)  # an empty directory both ranks list
        try:
            writer = FeatureWriter(out / name, mode=mode, max_shard_bytes=SHARD_BYTES)  # type: ignore[arg-type]
            fit = trainer([IOCaptureCallback(SPEC, writer=writer)], devices=2, strategy="ddp")
            module = Dump(weights, kill_at_batch=patch.get("kill_at_batch"))
            error = None
            data = data or indexed_loader(batch_size)
            fit.predict(module, data, return_predictions=False)
        except StoreError as raised:
            error = str(raised)
        finally:
            local._list_dir = real_list  # type: ignore[assignment]
            local.LocalBackend.read_info = real_read  # type: ignore[method-assign]
        outcome = {"error": error, "seconds": time.monotonic() - start}
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(outcome))

    run("stray-on-rank1", list_dir={1: sees_a_stray_file})
    run("stray-on-rank0", list_dir={0: sees_a_stray_file})
    run("blind-rank1", read={1: cannot_read})
    run("resumed", mode="resume", batch_size=5)  # the parent put a killed store there
    run("documents-resumed", mode="resume", batch_size=5, documents=True)  # and another
    os.environ["IOCATCH_TEST_RANK1_PID"] = (out / "pid-rank1").read_text()
    run("killed", kill_at_batch=4)


@pytest.fixture(scope="module")
def ddp(
    tmp_path_factory: pytest.TempPathFactory, weights: Path, killed: Path, killed_documents: Path
) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    shutil.copytree(killed, out / "resumed", symlinks=True)
    shutil.copytree(killed_documents, out / "documents-resumed", symlinks=True)
    result = subprocess.run(
        [sys.executable, __file__, str(out), str(weights)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-4000:]
    _wait_until_gone(int((out / "pid-rank1").read_text()))
    return out


def _wait_until_gone(pid: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def outcomes(out: Path, run: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{run}-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_two_processes_seeing_different_files_get_one_decision(ddp: Path, weights: Path) -> None:
    # Only rank 1 sees a stray file: rank 0 decides, and the dump goes ahead on both.
    assert [o["error"] for o in outcomes(ddp, "stray-on-rank1")] == [None, None]
    # Only rank 0 sees it: both ranks raise the same error instead of one waiting forever.
    first, second = outcomes(ddp, "stray-on-rank0")
    assert first["error"] == second["error"] and "is not empty" in first["error"]
    assert "stray.txt" in first["error"]
    # Rank 1 cannot read what rank 0 prepared (a node-local disk): the same error on both.
    first, second = outcomes(ddp, "blind-rank1")
    assert first["error"] == second["error"] and "not every process sees" in first["error"]
    for run in ("stray-on-rank1", "stray-on-rank0", "blind-rank1"):
        assert all(outcome["seconds"] < 30 for outcome in outcomes(ddp, run))


@pytest.mark.slow
def test_a_two_process_dump_holds_every_sample_once(ddp: Path, weights: Path) -> None:
    assert_exactly_once(ddp / "stray-on-rank1", weights)
    metadata = FeatureStore(ddp / "stray-on-rank1").metadata
    assert metadata["ranks"] == [0, 1] and metadata["world_size"] == 2


@pytest.mark.slow
def test_a_one_process_kill_resumed_by_two_processes(ddp: Path, weights: Path) -> None:
    assert [o["error"] for o in outcomes(ddp, "resumed")] == [None, None]
    assert_exactly_once(ddp / "resumed", weights)
    assert FeatureStore(ddp / "resumed").metadata["ranks"] == [0, 1]


@pytest.mark.slow
def test_document_ids_far_apart_killed_and_resumed_by_two_processes_are_each_stored_once(
    ddp: Path, weights: Path
) -> None:
    """Ids 10**12 apart: before, the committed set was a bit per index up to the largest
    (about 7 TB here: ``MemoryError``), broadcast to every rank. One process killed at
    batch 9 of 15 (batches of 4), resumed by two in batches of 5: every document once, with
    its own rows; the plan a resume broadcasts is one interval, whatever the ids."""
    path = ddp / "documents-resumed"
    assert [o["error"] for o in outcomes(ddp, "documents-resumed")] == [None, None]
    store = FeatureStore(path)
    ids = [k * ID_STEP for k in range(N)]
    assert store.indices.tolist() == ids and store.duplicated_indices() == []
    assert store.missing_ranges(ids[-1] + 1) == [
        (a + 1, a + ID_STEP) for a in ids[:-1]
    ]  # one gap between two documents, not ID_STEP flags
    for key, rows in truth(weights).items():
        assert torch.equal(store[key], rows), key
    assert store.metadata["ranks"] == [0, 1]
    settings = {name: store.metadata[name] for name in ("spec", "stage", "dtype", "tokens")}
    plan = prepare_store(path, "resume", settings)
    assert plan.committed[0].ranges().tolist() == [[i, i] for i in ids]
    assert len(pickle.dumps(plan.committed)) < 2048


def test_a_two_process_kill_resumed_by_one_process(
    ddp: Path, weights: Path, tmp_path: Path
) -> None:
    path = copy_of(ddp / "killed", tmp_path)
    committed = FeatureStore(path).indices.tolist()
    assert 0 < len(committed) < N and FeatureStore(path).metadata["ranks"] == [0, 1]
    module = resume(path, weights, batch_size=3)
    assert sorted(module.computed + committed) == list(range(N))
    assert_exactly_once(path, weights)


if __name__ == "__main__":
    ddp_main(Path(sys.argv[1]), Path(sys.argv[2]))
