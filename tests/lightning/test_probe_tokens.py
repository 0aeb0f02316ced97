"""Probes on padded Hugging Face batches count the real tokens only, through a real Trainer.

A random GPT-2 validates mapping batches (``input_ids``, ``attention_mask``, a target and
the dataset index), right- or left-padded to one length (so a sample's activations do not
depend on the batch it lands in), one sample without a real token. Ground truth: a
hand-written forward hook in a plain loop, and NumPy in float64 over the tokens whose
``attention_mask`` is 1. The same cases run on 2 DDP processes with uneven shards (``main``,
in the shared launch of tests/ddp_scenarios.py):

    python tests/lightning/test_probe_tokens.py OUT_DIR
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch import IOCaptureCallback, TokenRows
from lightning_iocatch.probes import ActivationStats, LayerCKA, LinearProbe
from lightning_iocatch.probes.linear import _unit_hash
from tests.ddp_scenarios import ranks_of
from tests.lightning.test_probe_ddp import read_ranks
from tests.probes.test_probes import numpy_batch_stats, numpy_cka

SAMPLES, SEQ, BATCH, EMPTY = 23, 10, 3, 5  # uneven over 2 processes; sample 5: no token
BLOCKS = ("model.transformer.h.0", "model.transformer.h.1")
SPEC = f"outputs[{'|'.join(BLOCKS)}]"
HOLDOUT, RIDGE = 0.3, 1e-3
STATS = ("mean", "std", "rms", "absmax", "zero_frac", "dead_frac")


class GPT2Module(pl.LightningModule):
    """A random GPT-2 (nothing downloaded) validating mapping batches."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=99, eos_token_id=99
        )
        self.model = GPT2LMHeadModel(config)

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def samples(side: str) -> list[dict[str, torch.Tensor]]:
    """Padded to ``SEQ`` on ``side``: lengths 0..SEQ, padding id 0, a float target."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, SEQ + 1, (SAMPLES,), generator=generator)
    lengths[EMPTY] = 0
    data = []
    for index, length in enumerate(lengths.tolist()):
        ids = torch.zeros(SEQ, dtype=torch.long)
        mask = torch.zeros(SEQ, dtype=torch.long)
        real = slice(0, length) if side == "right" else slice(SEQ - length, SEQ)
        ids[real] = torch.randint(1, 99, (length,), generator=generator)
        mask[real] = 1
        target = torch.randn((), generator=generator)
        data.append({"input_ids": ids, "attention_mask": mask, "y": target, "index": index})
    return data


def target(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["y"]


def probes(cka_pool: str) -> list[Any]:
    return [
        ActivationStats(),
        LinearProbe(target, task="regression", pool="mean", holdout=HOLDOUT, name="mean"),
        LinearProbe(target, task="regression", pool="last", holdout=HOLDOUT, name="last"),
        LayerCKA(pool=cka_pool),
    ]


def validate(
    sides: str | tuple[str, ...], probe_list: list[Any], devices: int = 1, **options: Any
) -> dict:
    """The logged values of a Trainer.validate with IOCaptureCallback(probes=...), one
    dataloader per padding side."""
    sides = (sides,) if isinstance(sides, str) else sides
    loaders = [DataLoader(samples(side), batch_size=BATCH) for side in sides]
    callback = IOCaptureCallback(SPEC, stages=["validate"], probes=probe_list, **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.validate(GPT2Module(), loaders, verbose=False)
    assert callback.probes is not None
    return dict(callback.probes.last_values)


@functools.cache
def hooked_outputs(side: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each block's output ``(SAMPLES, SEQ, 32)`` by a hand-written hook in a plain loop,
    in float64, and the batch's fields (computed once per side: do not modify them)."""
    module = GPT2Module().eval()
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in BLOCKS}
    handles = [
        module.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, name=name: outputs[name].append(
                (out[0] if isinstance(out, tuple) else out).detach().clone()
            )
        )
        for name in BLOCKS
    ]
    fields: dict[str, list[torch.Tensor]] = {}
    try:
        with torch.no_grad():
            for batch in DataLoader(samples(side), batch_size=BATCH):
                module.validation_step(batch, 0)
                for key, value in batch.items():
                    fields.setdefault(key, []).append(value)
    finally:
        for handle in handles:
            handle.remove()
    hidden = {name: torch.cat(parts).double().numpy() for name, parts in outputs.items()}
    return hidden, {key: torch.cat(parts).numpy() for key, parts in fields.items()}


def pooled(hidden: np.ndarray, real: np.ndarray, pool: str) -> np.ndarray:
    """Per sample with a real token: the mean of its real tokens, or its last real one."""
    rows = []
    for sample, mask in zip(hidden, real, strict=True):
        where = np.flatnonzero(mask)
        if where.size:
            rows.append(sample[where].mean(axis=0) if pool == "mean" else sample[where[-1]])
    return np.stack(rows)


def numpy_ridge_r2(x: np.ndarray, y: np.ndarray, indices: np.ndarray) -> float:
    """Ridge regression in float64 trained where the index hashes at or above HOLDOUT,
    R² on the others (LinearProbe's split and penalty, written out)."""
    held = np.array([_unit_hash(int(i)) < HOLDOUT for i in indices])
    train = np.c_[x[~held], np.ones((~held).sum())]
    gram = train.T @ train
    gram += np.diag([RIDGE * gram.diagonal()[:-1].mean()] * x.shape[1] + [0.0])
    weights = np.linalg.lstsq(gram, train.T @ y[~held], rcond=None)[0]
    predicted = np.c_[x[held], np.ones(held.sum())] @ weights
    return float(1 - ((y[held] - predicted) ** 2).sum() / ((y[held] - y[held].mean()) ** 2).sum())


def truth(side: str, cka_pool: str) -> dict[str, float]:
    """What the probes must log, from the hooked outputs and the real tokens alone."""
    hidden, fields = hooked_outputs(side)
    real = fields["attention_mask"] == 1
    has = real.any(axis=1)
    expected: dict[str, float] = {}
    for name in BLOCKS:
        stats = numpy_batch_stats([hidden[name][real]])
        expected.update({f"iocatch/{name}/outputs/{k}": v for k, v in stats.items()})
        for pool in ("mean", "last"):
            x = pooled(hidden[name], real, pool)
            r2 = numpy_ridge_r2(x, fields["y"][has].astype(np.float64), fields["index"][has])
            expected[f"iocatch/{name}/outputs/{pool}_r2"] = r2
    a, b = (pooled(hidden[name], real, cka_pool) for name in BLOCKS)
    expected[f"iocatch/cka/{BLOCKS[0]}/outputs~{BLOCKS[1]}/outputs"] = numpy_cka(a, b)
    return expected


CASES = {"right": "mean", "left": "last"}  # padding side -> LayerCKA's pool


def assert_equal(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    wrong = {
        name: (got[name], value)
        for name, value in expected.items()
        if got[name] != pytest.approx(value, rel=1e-5, abs=1e-9)
    }
    assert not wrong, wrong


@pytest.mark.parametrize("side", list(CASES))
def test_probes_count_real_tokens_under_padding(side: str) -> None:
    expected = truth(side, CASES[side])
    got = validate(side, probes(CASES[side]))
    assert_equal(got, expected)
    # the premise: counting every position gives other values
    hidden, _ = hooked_outputs(side)
    everywhere = hidden[BLOCKS[1]].mean()
    assert everywhere != pytest.approx(expected[f"iocatch/{BLOCKS[1]}/outputs/mean"], rel=1e-2)


def every_position(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


@pytest.mark.parametrize(
    ("rule", "which"),
    [
        ("all", "every"),
        (every_position, "every"),
        (TokenRows(drop_first=True), "drop_first"),
    ],
)
def test_probe_tokens_changes_which_tokens_count(rule: Any, which: str) -> None:
    """``probe_tokens="all"`` (or a mask of ones) counts every position, padding included;
    a ``TokenRows`` counts the tokens it keeps (here without each sequence's first)."""
    hidden, fields = hooked_outputs("left")
    real = fields["attention_mask"] == 1  # a new array
    if which == "every":
        real = np.ones_like(real)
    else:
        first = real.argmax(axis=1)
        real[np.arange(SAMPLES), first] = False
    got = validate("left", [ActivationStats()], probe_tokens=rule)
    for name in BLOCKS:
        expected = numpy_batch_stats([hidden[name][real]])
        assert {k: got[f"iocatch/{name}/outputs/{k}"] for k in STATS} == pytest.approx(
            expected, rel=1e-5
        )


def test_bad_probe_tokens_are_refused() -> None:
    with pytest.raises(TypeError, match=r"`probe_tokens` must be 'attention_mask', 'all'"):
        IOCaptureCallback(SPEC, probes=[ActivationStats()], probe_tokens="real")
    with pytest.raises(ValueError, match=r"`probe_tokens`: .* shape \(1, 10\) for a batch of 3"):
        validate("right", [ActivationStats()], probe_tokens=lambda b: b["attention_mask"][:1])
    sink = IOCaptureCallback(SPEC, probes=[ActivationStats()]).probes
    assert sink is not None
    with pytest.raises(ValueError, match=r"must be bool or integer, got torch.float32; pass"):
        sink._real_tokens({"attention_mask": torch.ones(2, 3)})


@pytest.mark.slow
def test_two_ddp_processes_count_real_tokens_as_one(ddp_scenarios: Path) -> None:
    """2 processes, 23 samples in batches of 3, a right- and a left-padded dataloader:
    process 1's last batch is padded with a repeat of sample 0; each process logs the
    float64 truth of all 23 samples."""
    ranks = read_ranks(ranks_of(ddp_scenarios, "probe_tokens"))
    expected = {}
    for number, side in enumerate(CASES):
        suffix = f"/dataloader_idx_{number}"
        expected.update({name + suffix: value for name, value in truth(side, "last").items()})
    for rank in ranks:
        assert_equal(rank, expected)


def main(out: Path) -> None:
    result = validate(tuple(CASES), probes("last"), devices=2)
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
