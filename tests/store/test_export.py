"""Export to Hugging Face ``datasets``: every row and index read back with ``load_from_disk``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_iocatch import FeatureStore, FeatureWriter, IOCaptureCallback
from lightning_iocatch.cli import main
from lightning_iocatch.store.export import ExportError, export_dataset
from tests.lightning_models import TinyModule, dataset, loader, manual_outputs, trainer

datasets = pytest.importorskip("datasets")

SPEC = "inputs[head]|outputs[model.layers.1]"
N, CONTEXT, D_IN, VOCAB = 14, 5, 4, 50


def dump_tiny(path: Path, n: int = 30, **options: object) -> TinyModule:
    """A real predict loop: several shards (500-byte bound), batches of 4."""
    torch.manual_seed(0)
    module = TinyModule()
    writer = FeatureWriter(path, max_shard_bytes=500, **options)  # type: ignore[arg-type]
    callback = IOCaptureCallback(SPEC, writer=writer)
    trainer([callback]).predict(module, loader(n, 4), return_predictions=False)
    return module


class TokenModel(TinyModule):
    """Token ids ``(batch, seq)`` in, ``(batch, seq, d)`` activations out of ``model.1``."""

    def __init__(self) -> None:
        super().__init__(model=nn.Sequential(nn.Embedding(VOCAB, D_IN), nn.Linear(D_IN, D_IN)))

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.model(batch[0])  # type: ignore[index]


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, CONTEXT), generator=torch.Generator().manual_seed(1))


def dump_tokens(path: Path) -> TokenModel:
    torch.manual_seed(0)
    module = TokenModel()
    callback = IOCaptureCallback("inputs[model]|outputs[model.1]", writer=FeatureWriter(path))
    data = DataLoader(TensorDataset(token_ids()), batch_size=4)
    trainer([callback]).predict(module, data, return_predictions=False)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyModule]:
    path = tmp_path_factory.mktemp("tiny") / "store"
    return path, dump_tiny(path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TokenModel]:
    path = tmp_path_factory.mktemp("tokens") / "store"
    return path, dump_tokens(path)


def test_columns_layout_holds_every_row_and_index(
    tiny: tuple[Path, TinyModule], tmp_path: Path
) -> None:
    path, module = tiny
    assert len(FeatureStore(path).metadata["shards"]) > 1
    out = export_dataset(path, tmp_path / "ds", batch_rows=3)  # record batches split batches
    data = datasets.load_from_disk(str(out))
    keys = ["head/inputs/args/0", "model.layers.1/outputs"]
    assert data.column_names == [*keys, "index"] and data.num_rows == 30
    assert data.features["model.layers.1/outputs"] == datasets.List(
        datasets.Value("float32"), length=8
    )
    data.set_format("torch")
    everything = data[:]
    indices = everything["index"]
    assert sorted(indices.tolist()) == list(range(30))
    expected = manual_outputs(module, dataset(30).tensors[0])  # independent of the store
    assert torch.equal(everything["model.layers.1/outputs"], expected[1][indices])
    assert torch.equal(everything["head/inputs/args/0"], expected[2][indices])
    store = FeatureStore(path)
    for row in data:  # and row by row, against the store's own reading
        i = int(row["index"])
        for key in keys:
            assert torch.equal(row[key], store[key][i])


def test_bfloat16_rows_export_as_float32_and_keys_select(tmp_path: Path) -> None:
    dump_tiny(tmp_path / "store", n=10, dtype=torch.bfloat16)
    export_dataset(tmp_path / "store", tmp_path / "ds", keys=["model.layers.1/outputs"])
    data = datasets.load_from_disk(str(tmp_path / "ds")).with_format("torch")
    assert data.column_names == ["model.layers.1/outputs", "index"]
    rows = data[:]["model.layers.1/outputs"]
    stored = FeatureStore(tmp_path / "store")["model.layers.1/outputs"]
    assert stored.dtype == torch.bfloat16 and rows.dtype == torch.float32
    assert torch.equal(rows, stored[data[:]["index"]].float())


def test_saelens_layout_columns(tokens: tuple[Path, TokenModel], tmp_path: Path) -> None:
    path, module = tokens
    hook = "blocks.0.hook_resid_post"
    export_dataset(path, tmp_path / "ds", layout="saelens", hook_name=hook)
    data = datasets.load_from_disk(str(tmp_path / "ds"))
    assert data.column_names == [hook, "token_ids", "index"] and data.num_rows == N
    assert data.features[hook] == datasets.Array2D(shape=(CONTEXT, D_IN), dtype="float32")
    assert data.features["token_ids"] == datasets.List(datasets.Value("int32"), length=CONTEXT)
    everything = data.with_format("torch")[:]
    ids = token_ids()[everything["index"]]
    with torch.no_grad():
        expected = module.model(ids)  # a manual forward, not the store
    assert torch.equal(everything["token_ids"], ids.to(torch.int32))
    assert torch.equal(everything[hook], expected)


def test_saelens_layout_names_the_hook_after_the_module_by_default(
    tokens: tuple[Path, TokenModel], tmp_path: Path
) -> None:
    path, _ = tokens
    export_dataset(path, tmp_path / "ds", layout="saelens", token_ids_key="model/inputs/args/0")
    assert datasets.load_from_disk(str(tmp_path / "ds")).column_names == [
        "model.1",
        "token_ids",
        "index",
    ]


@pytest.mark.filterwarnings("ignore:All samples in the training dataset have been exhausted")
def test_saelens_reads_the_export(tokens: tuple[Path, TokenModel], tmp_path: Path) -> None:
    """SAELens' own ActivationsStore, as its training runner builds it for a cache, reads it."""
    pytest.importorskip("sae_lens")
    from sae_lens.training.activations_store import ActivationsStore

    path, module = tokens
    hook = "blocks.0.hook_resid_post"
    export_dataset(path, tmp_path / "ds", layout="saelens", hook_name=hook)
    store = ActivationsStore(  # the arguments of ActivationsStore.from_cache_activations
        model=cast(Any, None),  # a store reading a cache never runs the model
        dataset=None,
        streaming=False,
        hook_name=hook,
        hook_head_index=None,
        context_size=CONTEXT,
        d_in=D_IN,
        n_batches_in_buffer=4,
        total_training_tokens=N * CONTEXT,
        store_batch_size_prompts=N // 2,
        train_batch_size_tokens=8,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(tmp_path / "ds"),
    )
    (acts_a, ids_a), (acts_b, ids_b) = store.get_raw_llm_batch(), store.get_raw_llm_batch()
    assert ids_a is not None and ids_b is not None  # token ids read from the cache
    acts, ids = torch.cat([acts_a, acts_b]), torch.cat([ids_a, ids_b])
    order = datasets.load_from_disk(str(tmp_path / "ds")).with_format("torch")[:]["index"]
    with torch.no_grad():
        expected = module.model(token_ids()[order]).reshape(N * CONTEXT, D_IN)
    assert torch.equal(acts, expected)
    assert torch.equal(ids.long(), token_ids()[order].reshape(-1))
    batch = next(iter(store.get_data_loader()))  # what the trainer consumes: mixed tokens
    assert batch.shape == (8, D_IN)
    assert all(bool((row == expected).all(dim=1).any()) for row in batch)


class Sometimes(TinyModule):
    """``head`` runs in the first batch only: its key covers fewer samples."""

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        hidden = self.model(batch[0])  # type: ignore[index]
        return self.head(hidden) if batch_idx == 0 else hidden


class Ragged(TinyModule):
    """Token sequences whose length varies from batch to batch."""

    def __init__(self) -> None:
        super().__init__(model=nn.Embedding(10, 4))

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.model(batch[0][:, : 2 + batch_idx])  # type: ignore[index]


class Caster(nn.Module):
    """Casts its input to float16 when ``to_half`` is set."""

    to_half = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half() if self.to_half else x


class MixedDtypes(TinyModule):
    """``model``'s output is float16 in the second batch only."""

    def __init__(self) -> None:
        super().__init__(model=Caster())

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        cast(Caster, self.model).to_half = batch_idx == 1
        return self.model(batch[0])  # type: ignore[index]


def test_keys_that_cannot_be_columns_are_refused(tmp_path: Path) -> None:
    writer = FeatureWriter(tmp_path / "mixed")
    trainer([IOCaptureCallback("outputs[model]", writer=writer)]).predict(
        MixedDtypes(), loader(8, 4)
    )
    with pytest.raises(ExportError, match="stored as float16 and float32 in different batches"):
        export_dataset(tmp_path / "mixed", tmp_path / "out")
    ids = TensorDataset(torch.randint(0, 10, (6, 5)))
    writer = FeatureWriter(tmp_path / "ragged")
    trainer([IOCaptureCallback("outputs[model]", writer=writer)]).predict(
        Ragged(), DataLoader(ids, batch_size=2)
    )
    with pytest.raises(ExportError, match="'model/outputs' has rows of different shapes"):
        export_dataset(tmp_path / "ragged", tmp_path / "out")
    writer = FeatureWriter(tmp_path / "some")
    spec = "outputs[model.layers.0|head]"
    trainer([IOCaptureCallback(spec, writer=writer)]).predict(Sometimes(), loader(8, 4))
    with pytest.raises(
        ExportError,
        match="'head/outputs' and 'model.layers.0/outputs' are stored for different samples",
    ):
        export_dataset(tmp_path / "some", tmp_path / "out")
    export_dataset(tmp_path / "some", tmp_path / "out", keys=["head/outputs"])
    assert datasets.load_from_disk(str(tmp_path / "out"))[:]["index"] == [0, 1, 2, 3]


def test_per_batch_keys_are_refused(tmp_path: Path) -> None:
    class PerBatch(TinyModule):
        def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
            self.model.get_submodule("layers.0")(torch.zeros(1, 8))  # no row per sample
            return self(batch[0])  # type: ignore[index]

    writer = FeatureWriter(tmp_path / "store")
    spec = "inputs[model.layers.0]|outputs[model.layers.1]"
    trainer([IOCaptureCallback(spec, writer=writer)]).predict(PerBatch(), loader(8, 4))
    assert "model.layers.0/inputs/args/0" in FeatureStore(tmp_path / "store").metadata["per_batch"]
    with pytest.raises(ExportError, match="stored once per batch"):
        export_dataset(tmp_path / "store", tmp_path / "out")


def test_bad_arguments_are_refused(
    tiny: tuple[Path, TinyModule], tokens: tuple[Path, TokenModel], tmp_path: Path
) -> None:
    path, _ = tiny
    with pytest.raises(ExportError, match=r"no key 'layers.1/outputs'.*did you mean"):
        export_dataset(path, tmp_path / "a", keys=["layers.1/outputs"])
    with pytest.raises(ExportError, match="`layout` must be one of"):
        export_dataset(path, tmp_path / "a", layout="parquet")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="apply to layout='saelens' only"):
        export_dataset(path, tmp_path / "a", hook_name="x")
    with pytest.raises(ExportError, match="`batch_rows` must be a positive int"):
        export_dataset(path, tmp_path / "a", batch_rows=0)
    with pytest.raises(ExportError, match="`keys` must be a sequence of key names"):
        export_dataset(path, tmp_path / "a", keys="head/inputs/args/0")
    with pytest.raises(ExportError, match=r"saelens.*found none"):
        export_dataset(path, tmp_path / "a", layout="saelens")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not an empty directory"):
        export_dataset(path, tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="is inside the store"):
        export_dataset(path, path / "ds")
    token_path, _ = tokens
    with pytest.raises(ExportError, match="needs floating rows of shape"):
        export_dataset(token_path, tmp_path / "a", layout="saelens", keys=["model/inputs/args/0"])
    with pytest.raises(ExportError, match="token ids need integer rows of shape"):
        export_dataset(
            token_path, tmp_path / "a", layout="saelens", token_ids_key="model.1/outputs"
        )
    assert not (tmp_path / "a").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no scratch file left behind


def test_cli_export(
    tokens: tuple[Path, TokenModel], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = tokens
    out = tmp_path / "ds"
    args = ["export", str(path), str(out), "--layout", "saelens", "--hook-name", "blocks.0"]
    assert main(args) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = datasets.load_from_disk(str(out))
    assert data.column_names == ["blocks.0", "token_ids", "index"] and data.num_rows == N
    assert main(["export", str(path), str(tmp_path / "k"), "--keys", "model.1/outputs"]) == 0
    assert datasets.load_from_disk(str(tmp_path / "k")).column_names == ["model.1/outputs", "index"]
    capsys.readouterr()
    assert main(["export", str(path), str(out)]) == 2  # out is not empty
    err = capsys.readouterr().err
    assert err.startswith("error: `out_dir`") and err.count("\n") == 1
    assert main(["export", str(path), str(tmp_path / "x"), "--keys", "model.2/outputs"]) == 2
    err = capsys.readouterr().err
    assert "no key 'model.2/outputs'" in err and err.count("\n") == 1
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(path), str(tmp_path / "z"), "--layout", "parquet"])
    assert exit_.value.code == 2


class Wide(TinyModule):
    """Rows of 1024 float32 (4 KiB) out of ``model``."""

    def __init__(self) -> None:
        super().__init__(model=nn.Linear(8, 1024))

    def predict_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> object:
        return self.model(batch[0])  # type: ignore[index]


def anonymous_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def export_peak_mib(store: Path, out: Path) -> float:
    """Peak growth of this process's anonymous memory while the export runs (sampled).

    Anonymous memory is what cannot be paged out; pages of memory-mapped files (the shards,
    the Arrow file) count in RSS while read but are the kernel's to drop.
    """
    base, peak, done = anonymous_rss_mib(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_rss_mib() - base)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        export_dataset(store, out)
    finally:
        done.set()
        watcher.join()
    return peak[0]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_memory_does_not_grow_with_the_store(tmp_path: Path) -> None:
    # bfloat16 rows are widened to float32 chunk by chunk: copies that are not file-backed
    # (float32 rows go from the memory-mapped shards to Arrow without one)
    for name, rows in (("small", 2048), ("large", 16384)):  # 4 MiB and 32 MiB of bfloat16
        data = DataLoader(TensorDataset(torch.randn(rows, 8)), batch_size=512)
        writer = FeatureWriter(
            tmp_path / name, max_shard_bytes=2**21, durable=False, dtype=torch.bfloat16
        )
        trainer([IOCaptureCallback("outputs[model]", writer=writer)]).predict(
            Wide(), data, return_predictions=False
        )
    export_peak_mib(tmp_path / "small", tmp_path / "warm-up")  # imports, first allocations
    small = export_peak_mib(tmp_path / "small", tmp_path / "small-ds")
    large = export_peak_mib(tmp_path / "large", tmp_path / "large-ds")
    # 64 MiB of float32 written: 2 to 18 MiB at the peak (Arrow's allocator keeps some);
    # holding every row instead of streaming measured 66 MiB
    assert large < 32, (small, large)
    assert datasets.load_from_disk(str(tmp_path / "large-ds")).num_rows == 16384
