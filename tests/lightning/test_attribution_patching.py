"""AttributionPatching against the truth, through real Trainers.

The truth: for every batch of the same DataLoader, the model run by hand with hand-written
hooks, its next-token losses summed in float64 and ``torch.autograd.grad`` of them, the
scores ``(a_source - a_base) . grad`` added over the epoch and divided by its tokens; the
exact effects by a hand-written hook that returns the other run's value. Then the same on
2 DDP processes (``main``, in the shared launch of tests/ddp_scenarios.py), 7 samples
shuffled in batches of 2 (the sampler repeats a sample on the second process), must log
the 1-process values.

    python tests/lightning/test_attribution_patching.py OUT_DIR
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_iocatch.lightning.attribution import AttributionPatching, corrupted_fields
from tests.ddp_scenarios import ranks_of
from tests.lightning.test_effects import LM, VOCAB, forward, samples

BLOCKS = [f"model.transformer.h.{i}" for i in range(4)]
HEADS = "model.transformer.h.1.attn.c_proj"
SPEC = f"outputs[model.transformer.h.*]|inputs[{HEADS}]"
EXACT = ["model.transformer.h.2/outputs", "model.transformer.h.0/outputs"]


def pairs(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    data = samples(n)
    for sample in data:
        corrupted = sample["input_ids"].clone()
        corrupted[3:5] = torch.randint(0, VOCAB, (2,), generator=generator)
        sample["corrupted_input_ids"] = corrupted
    return data


def validate(
    devices: int, n: int = 7, precision: str = "32-true", shuffle: bool = False
) -> AttributionPatching:
    atp = AttributionPatching(
        SPEC, heads={HEADS: 4}, exact=EXACT, forward=lambda m, b: forward(m, b)
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[atp], precision=precision,
    )  # fmt: skip
    trainer.validate(LM(), DataLoader(pairs(n), batch_size=2, shuffle=shuffle), verbose=False)
    return atp


BF16 = {"on": False}  # the forwards of the truth under bf16 autocast


def _losses(lm: LM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the summed next-token cross-entropy over real tokens, float64 (the
    forward under autocast when BF16 says so, the loss outside it)."""
    with torch.autocast("cpu", torch.bfloat16, enabled=BF16["on"]):
        out = forward(lm, batch)
    logits = out.logits.double()
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = mask[:, 1:] & mask[:, :-1]
    return -(logp * keep).sum(1), keep.sum(1).double()


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _run(lm: LM, batch: dict[str, torch.Tensor], grad: bool) -> dict[str, Any]:
    """Hand-written hooks: each block's output and the heads' input, with gradients."""
    places = {name: "outputs" for name in BLOCKS} | {HEADS: "inputs"}
    modules = dict(lm.named_modules())
    held: dict[str, torch.Tensor] = {}
    handles = []
    for name, kind in places.items():
        if kind == "outputs":
            handles.append(
                modules[name].register_forward_hook(
                    lambda m, a, o, n=name: held.__setitem__(f"{n}/outputs", _first(o))
                )
            )
        else:
            handles.append(
                modules[name].register_forward_pre_hook(
                    lambda m, a, n=name: held.__setitem__(f"{n}/inputs", a[0])
                )
            )
    with torch.enable_grad():
        sums, counts = _losses(lm, batch)
        keys = sorted(held)
        grads = torch.autograd.grad(sums.sum(), [held[k] for k in keys]) if grad else None
    for handle in handles:
        handle.remove()
    out = {"values": {k: v.detach() for k, v in held.items()}, "sums": sums.detach()}
    out["counts"] = counts
    out["grads"] = dict(zip(keys, grads, strict=True)) if grads else {}
    return out


def _patched(
    lm: LM, batch: dict[str, torch.Tensor], name: str, value: torch.Tensor
) -> torch.Tensor:
    module = dict(lm.named_modules())[name]
    handle = module.register_forward_hook(
        lambda m, a, o: value if isinstance(o, torch.Tensor) else (value, *o[1:])
    )
    with torch.no_grad():
        sums, _ = _losses(lm, batch)
    handle.remove()
    return sums


def truth(n: int = 7, bf16: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    BF16["on"] = bf16
    try:
        return _truth(n)
    finally:
        BF16["on"] = False


def _truth(n: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    lm = LM().eval()
    totals: dict[str, Any] = {}
    terms = {"clean": 0.0, "corrupted": 0.0}
    for batch in DataLoader(pairs(n), batch_size=2):
        clean, corrupted = corrupted_fields(batch)
        clean.pop("index"), corrupted.pop("index")
        runs = {"clean": _run(lm, clean, True), "corrupted": _run(lm, corrupted, True)}
        batches = {"clean": clean, "corrupted": corrupted}
        for which, found in runs.items():
            terms[which] += float(found["counts"].sum())
            totals[f"loss/{which}"] = totals.get(f"loss/{which}", 0.0) + found["sums"].sum()
        for convention, base, source in (
            ("denoising", "corrupted", "clean"),
            ("noising", "clean", "corrupted"),
        ):
            for key, grad in runs[base]["grads"].items():
                delta = runs[source]["values"][key].double() - runs[base]["values"][key].double()
                if key.startswith(HEADS):
                    delta, grad = (
                        delta.reshape(*delta.shape[:-1], 4, -1),
                        grad.reshape(*grad.shape[:-1], 4, -1),
                    )
                score = (delta.double() * grad.double()).sum(-1).sum(0)
                name = f"{convention}/{key}"
                totals[name] = totals.get(name, 0) + score
            for key in EXACT:
                module = key.split("/")[0]
                value = runs[source]["values"][key]
                change = _patched(lm, batches[base], module, value) - runs[base]["sums"]
                name = f"exact/{convention}/{key}"
                totals[name] = totals.get(name, 0.0) + change.sum()
    logged = {f"atp/{w}/loss": float(totals[f"loss/{w}"]) / terms[w] for w in terms}
    maps = {}
    for name, total in totals.items():
        if name.startswith("loss/"):
            continue
        convention = name.split("/")[1] if name.startswith("exact/") else name.split("/")[0]
        base = "corrupted" if convention == "denoising" else "clean"
        logged[f"atp/{name}"] = float(total.sum()) / terms[base]
        if not name.startswith("exact/"):
            maps[name] = total / terms[base]
    return logged, maps


def test_validate_logs_the_hand_computed_attribution_and_exact_effects() -> None:
    atp = validate(devices=1)
    expected, maps = truth()
    assert set(atp.last_values) == set(expected)
    for name, value in expected.items():
        assert atp.last_values[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    for name, value in maps.items():
        convention, key = name.split("/", 1)
        scale = float(value.abs().max())  # float32 products: to 1e-6 of the map's scale
        torch.testing.assert_close(atp.scores[convention][key], value, rtol=0, atol=1e-6 * scale)
    assert atp.scores["noising"][f"{HEADS}/inputs"].shape == (12, 4)  # positions x heads
    assert abs(expected["atp/denoising/model.transformer.h.2/outputs"]) > 1e-4


def test_under_bf16_mixed_the_passes_run_as_the_validation_step_does() -> None:
    atp = validate(devices=1, n=5, precision="bf16-mixed")
    expected, _ = truth(5, bf16=True)
    full, _ = truth(5)
    for name, value in expected.items():
        assert atp.last_values[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    name = "atp/denoising/model.transformer.h.2/outputs"
    assert atp.last_values[name] != pytest.approx(full[name], rel=1e-4)  # autocast ran


def test_a_shuffled_loader_of_batches_of_2_gives_the_same_figures() -> None:
    atp = validate(devices=1)
    shuffled = AttributionPatching(
        SPEC, heads={HEADS: 4}, exact=EXACT, forward=lambda m, b: forward(m, b)
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[shuffled])  # fmt: skip
    loader = DataLoader(pairs(7), batch_size=2, shuffle=True)
    trainer.validate(LM(), loader, verbose=False)
    for name, value in atp.last_values.items():
        assert shuffled.last_values[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_fit_logs_each_validation_epoch_and_training_is_untouched() -> None:
    module, alone = LM(), LM()
    atp = AttributionPatching("outputs[model.transformer.h.*]", forward=forward)
    data = DataLoader(pairs(4), batch_size=2)

    def fit(lm: LM, callbacks: list[Any]) -> None:
        torch.manual_seed(1)  # the same dropout masks in both trainings
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
            num_sanity_val_steps=1,
        )  # fmt: skip
        trainer.fit(lm, data, data)

    for lm in (module, alone):
        lm.configure_optimizers = lambda lm=lm: torch.optim.SGD(lm.parameters(), lr=0.1)
    fit(module, [atp])
    fit(alone, [])
    for mine, theirs in zip(module.parameters(), alone.parameters(), strict=True):
        assert torch.equal(mine, theirs)  # the same training, step for step
    assert "atp/denoising/model.transformer.h.1/outputs" in atp.last_values
    assert len(module.seen) == 2 + 2 * 4  # the sanity batch, then 2 epochs


def test_a_capture_callback_beside_it_sees_only_the_loops_own_forwards() -> None:
    from lightning_iocatch import IOCaptureCallback

    capture = IOCaptureCallback("outputs[model.transformer.h.3]", keep_in_memory=True)
    atp = AttributionPatching(SPEC, heads={HEADS: 4}, exact=EXACT, forward=forward)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[capture, atp])  # fmt: skip
    trainer.validate(LM(), DataLoader(pairs(7), batch_size=2), verbose=False)
    captured = capture.captures["validate"][0]["model.transformer.h.3"]["outputs"]
    assert len(captured) == 4  # one per batch: the attribution's forwards are not captured
    expected, _ = truth()
    for name, value in expected.items():
        assert atp.last_values[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_the_pairing_and_the_components_are_checked() -> None:
    with pytest.raises(ValueError, match="corrupted_"):
        corrupted_fields({"input_ids": torch.zeros(1)})
    with pytest.raises(ValueError, match="conventions"):
        AttributionPatching("outputs[a]", conventions="both")
    atp = AttributionPatching(
        "outputs[model.transformer.h.0]", exact=["model.transformer.h.1/outputs"]
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[atp])  # fmt: skip
    with pytest.raises(ValueError, match="not among the components"):
        trainer.validate(LM(), DataLoader(pairs(2), batch_size=2), verbose=False)


def test_parameters_keep_their_grad_and_requires_grad() -> None:
    module = LM()
    for parameter in list(module.parameters())[::2]:
        parameter.requires_grad_(False)  # a partly frozen model
    before = [p.requires_grad for p in module.parameters()]
    atp = AttributionPatching("outputs[model.transformer.h.1]", forward=forward)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[atp])  # fmt: skip
    trainer.validate(module, DataLoader(pairs(3), batch_size=2), verbose=False)
    assert [p.requires_grad for p in module.parameters()] == before
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.slow
def test_two_processes_log_the_one_process_values_with_uneven_data(ddp_scenarios: Path) -> None:
    logged = json.loads(
        (ranks_of(ddp_scenarios, "attribution_patching") / "rank0.json").read_text()
    )
    single = validate(devices=1)
    assert set(logged) == set(single.last_values)
    for name, value in single.last_values.items():
        assert logged[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def main(out: Path) -> None:
    """One process of the 2-process run (tests/ddp_scenarios.py)."""
    found = validate(devices=2, shuffle=True)  # the sampler's padding is told by its place
    rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps(found.last_values))
