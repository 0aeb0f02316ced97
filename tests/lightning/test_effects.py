"""InterventionEffects against the truth, through real Trainers.

The truth: for every batch of the same DataLoader, the model run by hand with hand-written
hooks returning each variant's edited value, and the cross-entropies and KL divergences of
its logits computed in NumPy (float64) and averaged over the epoch's tokens. Then the same
runs on 2 DDP processes (``main``, in the shared launch of tests/ddp_scenarios.py) must
log the 1-process values with 11 samples in batches of 2 (the sampler repeats sample 0 on
the second process).

    python tests/lightning/test_effects.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch.capture import Replace, Steer, Zero
from lightning_iocatch.lightning.effects import InterventionEffects
from tests.ddp_scenarios import ranks_of
from tests.lightning_models import SAE

WIDTH, VOCAB = 32, 64


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=4, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=16)
        self.model = GPT2LMHeadModel(config)
        self.seen: list[int] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.seen += batch["index"].tolist()
        self(batch["input_ids"], batch["attention_mask"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"], batch["attention_mask"]).logits.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    data = []
    for index in range(n):
        mask = torch.ones(12, dtype=torch.long)
        mask[12 - index % 4 :] = 0  # right padding of 0-3 tokens
        ids = torch.randint(0, VOCAB, (12,), generator=generator)
        data.append({"input_ids": ids, "attention_mask": mask, "index": torch.tensor(index)})
    return data


def forward(module: pl.LightningModule, batch: dict[str, torch.Tensor]) -> Any:
    return module(batch["input_ids"], batch["attention_mask"])


STEER = torch.linspace(-1, 1, WIDTH)


def variants() -> dict[str, list[Any]]:
    return {
        "splice": [Replace("model.transformer.h.2", SAE(WIDTH))],
        "zero": [Zero("model.transformer.h.2")],
        "steer": [Steer("model.transformer.h.1", STEER, alpha=4.0, kind="inputs")],
    }


def validate(
    devices: int, n: int = 11, batch_size: int = 2, precision: str = "32-true"
) -> tuple[dict[str, float], LM]:
    module = LM()
    effects = InterventionEffects(variants(), recovered={"splice": "zero"}, forward=forward)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[effects], precision=precision,
    )  # fmt: skip
    results = trainer.validate(module, DataLoader(samples(n), batch_size=batch_size), verbose=False)
    assert results[0] == pytest.approx(effects.last_values, rel=1e-15)
    return dict(effects.last_values), module


def first(value: Any, new: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return (new(value[0]), *value[1:]) if isinstance(value, tuple) else new(value)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def truth(n: int = 11, batch_size: int = 2, bf16: bool = False) -> dict[str, float]:
    """The hand computation: hooks written here, NumPy float64 for the losses."""
    lm = LM().eval()
    blocks = lm.model.transformer.h
    sae = SAE(WIDTH)
    hooks: dict[str, list[tuple[nn.Module, str, Callable]]] = {
        "clean": [],
        "splice": [(blocks[2], "outputs", lambda h: sae(h).to(h.dtype))],
        "zero": [(blocks[2], "outputs", torch.zeros_like)],
        "steer": [(blocks[1], "inputs", lambda h: h + 4.0 * STEER)],
    }
    ce = {name: [0.0, 0] for name in hooks}
    kl = {name: [0.0, 0] for name in hooks}
    for batch in DataLoader(samples(n), batch_size=batch_size):
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy().astype(bool)
        logits = {}
        for name, edits in hooks.items():
            handles = []
            for module, kind, new in edits:
                if kind == "outputs":
                    hook = module.register_forward_hook(lambda m, a, o, f=new: first(o, f))
                else:
                    hook = module.register_forward_pre_hook(lambda m, a, f=new: (f(a[0]),))
                handles.append(hook)
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                logits[name] = forward(lm, batch).logits.double().numpy()
            for handle in handles:
                handle.remove()
            p = log_softmax(logits[name])
            for row in range(len(ids)):
                for t in range(ids.shape[1] - 1):
                    if mask[row, t] and mask[row, t + 1]:
                        ce[name][0] += -p[row, t, ids[row, t + 1]]
                        ce[name][1] += 1
        clean = log_softmax(logits["clean"])
        for name in hooks:
            terms = (np.exp(clean) * (clean - log_softmax(logits[name]))).sum(-1)
            kl[name][0] += terms[mask].sum()
            kl[name][1] += mask.sum()
    loss = {name: total / count for name, (total, count) in ce.items()}
    expected = {"effects/clean/loss": loss["clean"]}
    for name in ("splice", "zero", "steer"):
        expected[f"effects/{name}/loss"] = loss[name]
        expected[f"effects/{name}/kl"] = kl[name][0] / kl[name][1]
    expected["effects/splice/loss_recovered"] = (loss["zero"] - loss["splice"]) / (
        loss["zero"] - loss["clean"]
    )
    return expected


def test_validate_logs_the_hand_computed_effects():
    logged, _ = validate(devices=1)
    expected = truth()
    assert logged.keys() == expected.keys()
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, rel=1e-10), name
    assert min(logged[f"effects/{name}/kl"] for name in ("splice", "zero", "steer")) > 1e-4


def test_under_bf16_mixed_the_forwards_run_as_the_validation_step_does():
    logged, _ = validate(devices=1, n=5, precision="bf16-mixed")
    expected, full = truth(5, bf16=True), truth(5)
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, rel=1e-10), name
    assert logged["effects/clean/loss"] != pytest.approx(full["effects/clean/loss"], rel=1e-6)


def test_a_baseline_as_good_as_clean_gives_nan_recovered_not_an_error():
    effects = InterventionEffects(
        {
            "a": [Zero("model.transformer.h.2")],
            "none": [Steer("model.lm_head", torch.zeros(VOCAB))],
        },
        recovered={"a": "none"},
        forward=forward,
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[effects])  # fmt: skip
    trainer.validate(LM(), DataLoader(samples(3), batch_size=2), verbose=False)
    assert effects.last_values["effects/none/kl"] == 0.0
    assert math.isnan(effects.last_values["effects/a/loss_recovered"])


def test_fit_logs_effects_each_validation_epoch_and_not_in_the_sanity_check():
    module = LM()
    effects = InterventionEffects({"zero": [Zero("model.transformer.h.2")]}, forward=forward)
    data = DataLoader(samples(6), batch_size=3)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[effects],
        num_sanity_val_steps=1,
    )  # fmt: skip
    trainer.fit(module, data, data)
    assert trainer.callback_metrics["effects/zero/kl"] == pytest.approx(
        truth(6, 3)["effects/zero/kl"], rel=1e-10
    )
    assert len(module.seen) == 3 + 2 * 6  # the sanity batch, then 2 epochs


@pytest.mark.parametrize("effects_first", [True, False])
def test_a_capture_callback_beside_it_sees_only_the_loops_own_forwards(effects_first: bool):
    from lightning_iocatch import IOCaptureCallback

    module = LM()
    capture = IOCaptureCallback(
        "outputs[model.transformer.h.3]", keep_in_memory=True, edits=[Zero("model.transformer.h.0")]
    )
    effects = InterventionEffects({"zero": [Zero("model.transformer.h.2")]}, forward=forward)
    callbacks = [effects, capture] if effects_first else [capture, effects]
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.validate(module, DataLoader(samples(5), batch_size=2), verbose=False)
    captured = capture.captures["validate"][0]["model.transformer.h.3"]["outputs"]
    assert len(captured) == 3  # one per batch: the effects' forwards are not captured
    expected = truth(5, 2)  # the effects' clean forward is not edited by the capture's edit
    assert effects.last_values["effects/zero/kl"] == pytest.approx(
        expected["effects/zero/kl"], rel=1e-10
    )


def test_a_loss_the_user_defines_and_bad_arguments():
    module = LM()
    per_sample = InterventionEffects(
        {"zero": [Zero("model.transformer.h.2")]},
        forward=forward,
        loss=lambda logits, batch: logits[:, -1].double().pow(2).mean(-1),  # one term a sample
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[per_sample])  # fmt: skip
    trainer.validate(module, DataLoader(samples(5), batch_size=2), verbose=False)
    lm = LM().eval()
    with torch.no_grad():
        batch = {
            k: torch.stack([s[k] for s in samples(5)]) for k in ("input_ids", "attention_mask")
        }
        clean = forward(lm, batch).logits[:, -1].double().pow(2).mean(-1).mean()
    assert per_sample.last_values["effects/clean/loss"] == pytest.approx(float(clean), rel=1e-6)
    with pytest.raises(ValueError, match="both must be variants"):
        InterventionEffects({"a": [Zero("x")]}, recovered={"a": "b"})
    with pytest.raises(ValueError, match="not 'clean'"):
        InterventionEffects({"clean": [Zero("x")]})


@pytest.mark.slow
def test_two_processes_log_the_one_process_values_with_uneven_data(ddp_scenarios: Path):
    out = ranks_of(ddp_scenarios, "effects")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    single, _ = validate(devices=1)
    assert ranks[1]["seen"] == [1, 3, 5, 7, 9, 0]  # sample 0 again: the sampler's padding
    assert ranks[0]["seen"] == [0, 2, 4, 6, 8, 10]
    # the note on the key/value cache, said once in the whole run (not once per process)
    assert sum(rank["notes"] for rank in ranks) == 1
    for rank in ranks:
        assert rank["values"].keys() == single.keys()
        for name, value in single.items():
            assert rank["values"][name] == pytest.approx(value, rel=1e-12, abs=0), name


def main(out: Path) -> None:
    """One process of the 2-process run (in the shared launch of tests/ddp_scenarios.py)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        values, module = validate(devices=2)
    rank = torch.distributed.get_rank()
    notes = sum("DynamicCache" in str(warning.message) for warning in said)
    result = {"values": values, "seen": module.seen, "notes": notes}
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True))


def test_the_default_loss_follows_labels_and_refuses_logits_of_other_positions():
    from lightning_iocatch.lightning.effects import kl_per_sample, next_token_loss

    lm = LM().eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt the loss leaves out, as in fine-tuning
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with torch.no_grad():
        output = lm.model(**batch)
    sums, counts = next_token_loss(output.logits, batch)
    assert float(sums.sum() / counts.sum()) == pytest.approx(float(output.loss), rel=1e-6)
    with pytest.raises(ValueError, match="one position per token"):
        next_token_loss(torch.zeros(2, 12, VOCAB), {"input_ids": ids})  # a soft-prompt prefix
    with pytest.raises(ValueError, match="one position per token"):
        kl_per_sample(torch.zeros(2, 12, 5), torch.zeros(2, 12, 5), {"attention_mask": ids})
    # a class ruled out (-inf) in both: it adds nothing, as 0 log 0 = 0 (NumPy, float64)
    clean, variant = torch.randn(1, 3, 5, dtype=torch.float64), torch.randn(1, 3, 5)
    clean[..., 4] = variant[..., 4] = -math.inf
    kl, count = kl_per_sample(clean, variant, {})
    p, q = log_softmax(clean[..., :4].numpy()), log_softmax(variant[..., :4].double().numpy())
    assert float(kl[0]) == pytest.approx(float((np.exp(p) * (p - q)).sum()), rel=1e-12)
    assert count.tolist() == [3.0]
