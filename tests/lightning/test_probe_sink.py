"""ProbeSink through a real Trainer: real decoder layers, mixed precision, changing widths,
padding. Ground truth: a hand-written hook, NumPy in float64 on the captured values."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_iocatch import BatchCaptures, CaptureSink, IOCaptureCallback
from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe
from lightning_iocatch.probes.linear import _unit_hash
from tests.lightning_models import tiny_llama, trainer
from tests.probes.test_probes import numpy_batch_stats, numpy_cka, numpy_probe_acc

STATS = ("mean", "std", "rms", "absmax", "zero_frac", "dead_frac")


def logged_stats(values: dict[str, float], key: str) -> dict[str, float]:
    return {stat: values[f"iocatch/{key}/{stat}"] for stat in STATS}


class Decoder(pl.LightningModule):
    """A Llama-style causal LM with random weights (nothing downloaded) as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, mask, _ = batch
        self.model(input_ids=ids, attention_mask=mask)  # use_cache: a cache object too


def test_llama_decoder_layer_inputs_feed_every_probe() -> None:
    """``inputs[...]`` of a decoder layer: hidden states next to a bool mask, position ids,
    rotary tables of batch dimension 1 and a cache object. Only the hidden states are
    probed, and their statistics equal NumPy on a hand-written pre-hook's capture."""
    module = Decoder()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (8, 10), generator=generator)
    mask = torch.ones(8, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the layer gets a 4-D bool mask
    labels = torch.arange(8) % 2
    data = DataLoader(TensorDataset(ids, mask, labels), batch_size=4)
    probes = [ActivationStats(), LinearProbe(lambda b: b[2], num_classes=2), LayerCKA()]
    spec = "inputs[model.model.layers.1]|outputs[model.model.layers.0]"
    callback = IOCaptureCallback(spec, probes=probes, keep_in_memory=True)
    hidden: list[torch.Tensor] = []

    def pre_hook(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    handle = module.model.model.layers[1].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        trainer([callback]).validate(module, data, verbose=False)
    finally:
        handle.remove()

    captured = flatten_captures(callback.captures["validate"][0])
    kinds = {key.split("/", 2)[-1]: value.dtype for key, value in captured.items()}
    assert torch.bool in kinds.values() and torch.int64 in kinds.values()  # the premise
    assert any(v.shape[0] == 1 for v in captured.values() if v.is_floating_point())
    values = callback.probes.last_values if callback.probes else {}
    layer_input = "model.model.layers.1/inputs/args/0"
    expected = numpy_batch_stats([h.double().numpy() for h in hidden])
    assert logged_stats(values, layer_input) == pytest.approx(expected, rel=1e-6)
    pooled_input = np.concatenate([h.double().mean(dim=1).numpy() for h in hidden])
    expected_acc = numpy_probe_acc(pooled_input, labels.numpy(), np.arange(8), num_classes=2)
    assert values[f"iocatch/{layer_input}/probe_acc"] == pytest.approx(expected_acc)
    probed = {name.rsplit("/", 1)[0] for name in values if "cka" not in name}
    layer_output = next(key for key in probed if "layers.0/outputs" in key).removeprefix("iocatch/")
    assert probed == {f"iocatch/{layer_input}", f"iocatch/{layer_output}"}
    pooled = np.concatenate([h.double().mean(dim=1).numpy() for h in hidden])
    cka = values[f"iocatch/cka/{layer_output}~{layer_input}"]  # the same tensor: CKA 1
    assert cka == pytest.approx(numpy_cka(pooled, pooled), rel=1e-6)


class Hot(pl.LightningModule):
    """``small``: 8 ordinary units; ``big``: 60 units near 300 and 4 always zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.small = nn.Linear(8, 8)
        self.big = nn.Linear(8, 64)
        with torch.no_grad():
            self.big.weight.mul_(20)
            self.big.bias.fill_(300)
            self.big.weight[60:] = 0
            self.big.bias[60:] = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.big(self.small(x))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("accelerator", "precision", "dtype", "captured"),
    [
        ("cpu", "bf16-mixed", None, torch.bfloat16),
        ("cpu", "32-true", "float16", torch.float16),
        # on CPU Lightning turns "16-mixed" into "bf16-mixed": float16 autocast needs CUDA
        pytest.param("gpu", "16-mixed", None, torch.float16, marks=[pytest.mark.gpu, CUDA]),
    ],
)
def test_mixed_precision_statistics_equal_float64(
    accelerator: str, precision: str, dtype: str | None, captured: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=generator)
    y = x[:, 0] + 0.1 * torch.randn(96, generator=generator)
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    probes = [
        ActivationStats(),
        LinearProbe(lambda b: b[1], task="regression", ridge=0.0, holdout_dtype=torch.float64),
        LayerCKA(),
    ]
    callback = IOCaptureCallback(
        "outputs[small|big]", probes=probes, dtype=dtype, keep_in_memory=True
    )
    run = trainer([callback], accelerator=accelerator, precision=precision)
    run.validate(Hot(), data, verbose=False)
    values = callback.probes.last_values if callback.probes else {}
    buffer = callback.captures["validate"][0]
    outputs = {name: buffer[name]["outputs"] for name in ("small", "big")}
    assert all(t.dtype == captured for batches in outputs.values() for t in batches)
    as64 = {name: [t.double().numpy() for t in batches] for name, batches in outputs.items()}
    assert np.abs(np.concatenate(as64["big"])).max() > 250  # float16 sums would overflow
    for name, batches in as64.items():
        expected = numpy_batch_stats(batches)
        assert logged_stats(values, f"{name}/outputs") == pytest.approx(expected, rel=1e-6)
    small, big = np.concatenate(as64["small"]), np.concatenate(as64["big"])
    cka = values["iocatch/cka/big/outputs~small/outputs"]
    assert cka == pytest.approx(numpy_cka(big, small), rel=1e-6)
    held = np.array([_unit_hash(i) < 0.2 for i in range(96)])
    design, target = np.c_[small, np.ones(96)], y.double().numpy()
    weights = np.linalg.lstsq(design[~held], target[~held], rcond=None)[0]
    residual = ((target[held] - design[held] @ weights) ** 2).sum()
    r2 = 1 - residual / ((target[held] - target[held].mean()) ** 2).sum()
    assert values["iocatch/small/outputs/probe_r2"] == pytest.approx(r2, rel=1e-6)
    assert not any(np.isnan(v) for v in values.values())


class Frames(pl.LightningModule):
    """A pointwise Conv1d + ReLU over ``(B, channels, time)``: time varies between batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Sequential(nn.Conv1d(2, 5, kernel_size=1, bias=False), nn.ReLU())

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.conv(batch)


def pad_to_multiple_of_4(samples: list[torch.Tensor]) -> torch.Tensor:
    """Pad each batch's sequences with zeros to its longest, rounded up to a multiple of 4."""
    longest = max(s.shape[-1] for s in samples)
    width = -(-longest // 4) * 4
    return torch.stack([nn.functional.pad(s, (0, width - s.shape[-1])) for s in samples])


def test_dead_frac_over_a_time_axis_that_changes_between_batches() -> None:
    """Units are time positions 0..max-1; dead: zero in every batch that had them."""
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4, 9, 6, 7, 3, 4]  # batches of 3: widths 8, 12, 8
    sequences = [torch.randn(2, n, generator=generator) for n in lengths]
    data = DataLoader(sequences, batch_size=3, collate_fn=pad_to_multiple_of_4)  # type: ignore[arg-type]
    callback = IOCaptureCallback("outputs[conv.1]", probes=[ActivationStats()], keep_in_memory=True)
    trainer([callback]).validate(Frames(), data, verbose=False)
    batches = [t.numpy() for t in callback.captures["validate"][0]["conv.1"]["outputs"]]
    assert sorted({b.shape[-1] for b in batches}) == [8, 12]
    expected = numpy_batch_stats(batches)
    assert 0 < expected["dead_frac"] < 1  # positions 9..11: only in one batch, padding there
    values = callback.probes.last_values if callback.probes else {}
    assert logged_stats(values, "conv.1/outputs") == pytest.approx(expected, rel=1e-9)


class Recorder(CaptureSink):
    def __init__(self) -> None:
        self.batches: list[BatchCaptures] = []

    def on_batch(self, batch: BatchCaptures) -> None:
        self.batches.append(batch)


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.layer(batch[0])

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0])


def test_sampler_padding_is_flagged_and_left_out_of_the_probes() -> None:
    """Process 1 of 2 of a ``DistributedSampler`` over 5 samples gets 1, 3 and a repeat of 0."""
    x = torch.randn(5, 3)
    dataset = TensorDataset(x)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    recorder = Recorder()
    callback = IOCaptureCallback(
        "outputs[layer]", probes=[ActivationStats()], sinks=[recorder], stages=["validate"]
    )
    module = Plain()
    run = trainer([callback])
    run.validate(module, DataLoader(dataset, batch_size=2, sampler=sampler), verbose=False)
    assert [(b.indices, b.repeated) for b in recorder.batches] == [
        ((1, 3), (False, False)),
        ((0,), (True,)),
    ]
    with torch.no_grad():
        expected = numpy_batch_stats([module.layer(x[[1, 3]]).double().numpy()])
    values = callback.probes.last_values if callback.probes else {}
    assert logged_stats(values, "layer/outputs") == pytest.approx(expected, rel=1e-6)

    recorder.batches.clear()
    predict = IOCaptureCallback("outputs[layer]", sinks=[recorder], stages=["predict"])
    trainer([predict]).predict(module, DataLoader(dataset, batch_size=2, sampler=sampler))
    assert [(b.indices, b.repeated) for b in recorder.batches] == [
        ((1, 3), (False, False)),
        ((0,), (True,)),
    ]
    recorder.batches.clear()
    run = trainer([IOCaptureCallback("outputs[layer]", sinks=[recorder])])
    run.validate(module, DataLoader(dataset, batch_size=2), verbose=False)
    assert [b.repeated for b in recorder.batches] == [(False,) * 2, (False,) * 2, (False,)]
