"""indices.py, the one module that reads Lightning's private internals.

If a Lightning release moves what it reads, these tests fail with a message that says
so, rather than the library silently losing dataset indices.
"""

from __future__ import annotations

from typing import Any

import lightning
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_iocatch import IOCaptureCallback, StoreError
from lightning_iocatch.lightning.sinks import BatchCaptures, CaptureSink
from tests.lightning_models import TinyModule, loader, trainer

UPGRADE = (
    f"Lightning {lightning.__version__} changed an internal that "
    "lightning_iocatch.lightning.batch_indices reads: "
)


def test_the_private_names_indices_py_reads_still_exist() -> None:
    from lightning.pytorch.overrides import distributed

    for name in ("_IndexBatchSamplerWrapper", "UnrepeatedDistributedSampler"):
        assert hasattr(distributed, name), (
            UPGRADE + f"lightning.pytorch.overrides.distributed.{name}"
        )
    wrapper = distributed._IndexBatchSamplerWrapper(
        torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(5)), 2, False)
    )
    assert list(wrapper) == [[0, 1], [2, 3], [4]]
    assert wrapper.seen_batch_indices == [[0, 1], [2, 3], [4]], UPGRADE + "seen_batch_indices"
    run = trainer([])
    for path in ("fit_loop.epoch_loop.val_loop", "validate_loop", "test_loop", "predict_loop"):
        loop: Any = run
        for part in path.split("."):
            assert hasattr(loop, part), UPGRADE + f"trainer.{path}"
            loop = getattr(loop, part)
        assert hasattr(loop, "_combined_loader"), UPGRADE + f"trainer.{path}._combined_loader"


class Recorder(CaptureSink):
    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[int, ...] | None]] = []

    def on_batch(self, batch: BatchCaptures) -> None:
        self.seen.append((batch.stage, batch.indices))


def test_indices_reach_sinks_in_predict_validate_test_and_fit() -> None:
    """A behavioural canary: through real loops, every batch knows its dataset indices."""
    recorder = Recorder()
    callback = IOCaptureCallback(
        "outputs[model.layers.0]", stages=["validate", "test", "predict"], sinks=[recorder]
    )
    module = TinyModule()
    run = trainer([callback], max_epochs=1, limit_train_batches=1)
    run.fit(module, loader(4, 2), loader(5, 2))
    run.validate(module, loader(5, 2), verbose=False)
    run.test(module, loader(5, 2), verbose=False)
    run.predict(module, loader(5, 2))
    expected = [(0, 1), (2, 3), (4,)]
    for stage in ("validate", "test", "predict"):
        got = [indices for s, indices in recorder.seen if s == stage]
        assert got[-3:] == expected, UPGRADE + f"{stage} batches lost their dataset indices"


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        for _ in range(6):
            yield (torch.randn(8),)


def test_a_predict_loader_without_indices_is_refused_when_the_loop_starts(tmp_path: Any) -> None:
    module = TinyModule()
    module.predict_step = lambda batch, batch_idx: module(batch[0])  # type: ignore[method-assign]
    callback = IOCaptureCallback("outputs[model.layers.0]", writer=tmp_path / "store")
    with pytest.raises(StoreError, match="gives no dataset indices: .*IterableDataset"):
        trainer([callback]).predict(module, DataLoader(Stream(), batch_size=2))
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())
    # the same loader is fine for a callback that keeps captures in memory
    memory = IOCaptureCallback("outputs[model.layers.0]", stages=["predict"])
    trainer([memory]).predict(module, DataLoader(Stream(), batch_size=2))
    assert memory.batch_indices["predict"][0] == [None, None, None]
    tensors = DataLoader(TensorDataset(torch.randn(6, 8)), batch_size=2)
    trainer([IOCaptureCallback("outputs[model.layers.0]", writer=tmp_path / "ok")]).predict(
        module, tensors
    )
