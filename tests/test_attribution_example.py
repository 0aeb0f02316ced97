"""examples/attribution.py, quick: what the copying task fixes by construction, checked
against the model run by hand (float64 log-softmax, hand-written hooks, autograd.grad)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.attribution import COPY, HALF, ROWS, SEQ, P, run
from lightning_iocatch.lightning.attribution import corrupted_fields


def token_losses(lm: Any, ids: torch.Tensor, hook: Any = None) -> torch.Tensor:
    """``[batch, SEQ - 1]``: each position's next-token loss, float64, optionally with a
    forward hook on block 0."""
    handle = lm.model.transformer.h[0].register_forward_hook(hook) if hook else None
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=ids).logits.double()
    finally:
        if handle:
            handle.remove()
    logp = torch.log_softmax(logits[:, :-1], -1)
    return -logp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_attribution_finds_the_copy_and_agrees_with_exact_patching(tmp_path: Path) -> None:
    result = run(tmp_path, quick=True)
    lm, data = result["lm"], result["data"]
    clean, corrupted = corrupted_fields({k: torch.stack([d[k] for d in data]) for k in data[0]})
    ids, bad = clean["input_ids"], corrupted["input_ids"]

    # the task is as constructed: the model copies, and the corruption hurts only at COPY
    before, after = token_losses(lm, ids), token_losses(lm, bad)
    assert before[:, HALF - 1 :].mean() < 0.3  # the second half is copied
    change = (after - before).mean(0)
    assert change[COPY] > 3.0
    assert change.abs().topk(2).values[1] < 0.05 * change[COPY]
    logged = result["logged"]["loss"]  # the callback's mean loss per token
    assert logged["atp/clean/loss"] == pytest.approx(float(before.mean()), rel=1e-5)
    assert logged["atp/corrupted/loss"] == pytest.approx(float(after.mean()), rel=1e-5)

    atp, exact = result["atp"], result["exact"]
    for metric in ("loss", "logit difference"):
        for convention in ("denoising", "noising"):
            # before P the runs are the same: nothing to patch, exactly
            assert not atp[metric][convention][:, :P].any()
            assert not exact[metric][convention][:, :P].any()
        last = SEQ - 1 if metric == "loss" else COPY  # the metric reads no later position
        assert not atp[metric]["denoising"][:, last + 1 :].any()

    # where AtP holds (denoising; noising of the logit difference): the largest cells at P
    # and COPY, the top AtP cell a top exact one, and a high correlation over all cells
    for metric, convention in [("loss", "denoising"), ("logit difference", "denoising"),
                               ("logit difference", "noising")]:  # fmt: skip
        estimate, truth = atp[metric][convention], exact[metric][convention]
        top = estimate.abs().flatten().topk(4).indices % SEQ
        assert set(top.tolist()) <= {P, COPY}, (metric, convention)
        outside = torch.ones(SEQ, dtype=torch.bool)
        outside[[P, COPY]] = False
        assert estimate[:, outside].abs().max() < 0.02 * estimate.abs().max()
        cell = int(estimate.abs().flatten().argmax())
        best = truth.flatten()[cell]
        assert best.sign() == estimate.flatten()[cell].sign()
        assert best.abs() >= 0.95 * truth.abs().max(), (metric, convention)
        assert result["correlation"][metric][convention] > 0.9  # 0.976-0.986 measured (3 seeds)
        assert 0.3 < result["slope"][metric][convention] < 1.3  # 0.39-0.97 measured (3 seeds)

    # noising the loss: the clean model is right with probability ~1, its loss's gradient ~0,
    # so AtP misses what exact patching finds (the docs' warning)
    saturated, truth = atp["loss"]["noising"], exact["loss"]["noising"]
    assert truth[-1, COPY] > 0.3
    assert saturated[-1, COPY].abs() < 0.05 * truth[-1, COPY]
    assert abs(result["slope"]["loss"]["noising"]) < 0.05

    # one cell of each by hand: block 0's output at COPY, denoising, the loss
    block = ROWS.index("model.transformer.h.0")
    held: dict[str, torch.Tensor] = {}
    token_losses(lm, ids, lambda m, a, o: held.__setitem__("clean", o.detach()))

    def patch(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        patched = output.clone()
        patched[:, COPY] = held["clean"][:, COPY]
        return patched

    by_hand = (token_losses(lm, bad, patch) - after).sum() / after.numel()
    assert float(exact["loss"]["denoising"][block, COPY]) == pytest.approx(float(by_hand), 1e-5)
    hidden = lm.model.transformer.h[0]
    handle = hidden.register_forward_hook(lambda m, a, o: held.__setitem__("bad", o))
    try:
        with torch.enable_grad():
            logits = lm.model(input_ids=bad).logits.double()
            losses = -torch.log_softmax(logits[:, :-1], -1).gather(-1, bad[:, 1:, None])
            (grad,) = torch.autograd.grad(losses.sum(), held["bad"])
    finally:
        handle.remove()
    delta = held["clean"][:, COPY] - held["bad"][:, COPY].detach()
    estimate = (delta.double() * grad[:, COPY].double()).sum() / after.numel()
    assert float(atp["loss"]["denoising"][block, COPY]) == pytest.approx(float(estimate), 1e-5)
    assert result["heatmap"].stat().st_size > 10_000
