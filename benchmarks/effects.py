"""What evaluating variants costs, against one clean forward of the same batch, as JSON.

A 12-block GPT-2-style causal LM (width 256, 8 heads, vocabulary 1,024, random weights),
a batch of 8 sequences of 256 tokens, under ``torch.inference_mode`` as in Lightning's
validation loop, without a key/value cache (``use_cache=False``: a validation forward needs
none). The edits act on the residual stream entering block 6 (``transformer.h.6``'s
inputs): blocks 0-5 come before them, blocks 6-11, the final norm and the head after.

Rows (each the ratio of its time to one clean forward in the same round; interleaved
rounds, median, min and max). Each group of rows below is interleaved with the clean
forward on its own, as a validation loop interleaves the step's forward and the variants:
in one interleaving of every row, the shared rows measured 10-25 % slower and the separate
ones not (three runs; more time in the kernel: the memory allocator's state after the
other rows).

- ``three_shared``: clean + SAE splice + zero ablation through ``Variants`` (shared);
- ``three_separate``: the same three as whole forwards (``share=False``);
- ``one_shared`` / ``one_separate``: clean + the SAE splice;
- ``one_zero_shared``: clean + the zero ablation (sharing alone, no SAE);
- ``ideal_*``: 1 + the time of what each variant must compute (blocks 6-11, norm, head,
  and the SAE for the splice) over the clean forward's, measured the same way: the floor
  any sharing can reach;
- ``validate_with_effects``: ``trainer.validate`` with ``InterventionEffects`` (the SAE
  splice and the zero ablation, ``recovered``) over ``trainer.validate`` without it, the
  validation step computing the model's cross-entropy (6 batches a run, a new Trainer
  each); the callback reuses the step's forward as the clean one and computes its losses
  and KL in float64. Its floor is ``ideal_three`` less the clean forward, plus the losses;
- ``validate_with_effects_apart``: the same with ``reuse=False`` (the callback's own clean
  forward beside the step's, as before the reuse).

Subnormal floats are flushed to zero (``torch.set_flush_denormal``) for every row: with random
weights they are common, and their slow arithmetic would be timed instead of the work.
The SAE has 1,024 latents (4 x the width): ``decoder(relu(encoder(h)))``. Before timing,
each shared output is checked equal (``torch.equal``) to the separate forwards'.

    python benchmarks/effects.py            # about two minutes on 2 cores
    python benchmarks/effects.py --quick
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning.pytorch as pl
import torch
from common import interleaved_ratios, quiet_trainer, run_facts
from torch import nn
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import InterventionEffects
from lightning_iocatch.capture import ModelIOCatcher, Replace, Zero
from lightning_iocatch.capture.variants import Variants

WIDTH, EDITED = 256, "transformer.h.6"
GROUPS = (
    ("three_shared", "three_separate"),
    ("one_shared", "one_separate", "one_zero_shared"),
    ("tail", "tail_sae"),
)


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=WIDTH, n_head=8, vocab_size=1024, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


class SAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.encoder(h)))


class Validated(pl.LightningModule):
    """The LM as a LightningModule whose validation step logs its cross-entropy."""

    def __init__(self, lm: GPT2LMHeadModel) -> None:
        super().__init__()
        self.model = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"]).logits
        loss = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten()
        )
        self.log("val_loss", loss)


def validate_rows(lm: GPT2LMHeadModel, sae: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """``plain``: validate without the callback; ``validate_with_effects``: with it."""
    module = Validated(lm)
    data = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    loader = DataLoader(data * 6, batch_size=8)  # 6 batches: the Trainer's setup weighs less

    def run(effects: bool, reuse: bool = True) -> None:
        callbacks: list[pl.Callback] = []
        if effects:
            edits = {
                "splice": [Replace(f"model.{EDITED}", sae, kind="inputs")],
                "zero": [Zero(f"model.{EDITED}", kind="inputs")],
            }
            forward = lambda m, b: m(b["input_ids"], b["attention_mask"])  # noqa: E731
            callbacks.append(
                InterventionEffects(
                    edits, recovered={"splice": "zero"}, forward=forward, reuse=reuse
                )
            )
        quiet_trainer(callbacks).validate(module, loader, verbose=False)
        if effects:
            runner = callbacks[0]._runner  # type: ignore[attr-defined]
            assert runner.reused == reuse and runner.fallbacks == [], runner.fallbacks

    return {
        "plain": lambda: run(False),
        "validate_with_effects": lambda: run(True),
        "validate_with_effects_apart": lambda: run(True, reuse=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    # Random weights make subnormal floats, whose slow CPU arithmetic (10x in the SAE's
    # output, run through blocks 6-11) would be timed instead of the work: flushed to zero
    # for every row alike.
    torch.set_flush_denormal(True)
    lm, sae = model(), SAE().eval()
    ids = torch.randint(0, 1024, (8, 256), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def clean() -> torch.Tensor:
        return lm(input_ids=ids, attention_mask=mask, use_cache=False).logits

    splice = [Replace(EDITED, sae, kind="inputs")]
    zero = [Zero(EDITED, kind="inputs")]
    runners = {
        "three_shared": Variants(ModelIOCatcher(lm, "cpu"), {"splice": splice, "zero": zero}),
        "three_separate": Variants(
            ModelIOCatcher(lm, "cpu"), {"splice": splice, "zero": zero}, share=False
        ),
        "one_shared": Variants(ModelIOCatcher(lm, "cpu"), {"splice": splice}),
        "one_separate": Variants(ModelIOCatcher(lm, "cpu"), {"splice": splice}, share=False),
        "one_zero_shared": Variants(ModelIOCatcher(lm, "cpu"), {"zero": zero}),
    }
    with torch.inference_mode():
        hidden = lm.transformer(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        entering = hidden.hidden_states[6]  # the residual stream entering block 6
        shared = runners["three_shared"](clean)
        separate = runners["three_separate"](clean)
        for name in shared:
            assert torch.equal(shared[name], separate[name]), name
        assert runners["three_shared"].fallbacks == []

    def after(h: torch.Tensor) -> torch.Tensor:
        for block in lm.transformer.h[6:]:
            h = block(h)
            h = h[0] if isinstance(h, tuple) else h
        return lm.lm_head(lm.transformer.ln_f(h))

    rows = {name: (lambda r=runner: r(clean)) for name, runner in runners.items()}
    rows["tail"] = lambda: after(entering)
    rows["tail_sae"] = lambda: after(sae(entering))
    ratios: dict = {}
    for group in GROUPS:  # each group interleaved with the clean forward on its own
        with torch.inference_mode():
            found = interleaved_ratios(
                {"plain": clean} | {name: rows[name] for name in group},
                repeats=3 if args.quick else 7,
                min_seconds=1.0,
            )
        ratios |= {name: found[name] for name in group}
        ratios.setdefault("baseline_s", []).append(found["baseline_s"])
    found = interleaved_ratios(validate_rows(lm, sae, ids), repeats=3 if args.quick else 5)
    ratios["validate_with_effects"] = found["validate_with_effects"]
    ratios["validate_with_effects_apart"] = found["validate_with_effects_apart"]
    ratios["validate_s"] = found["baseline_s"]
    tail_zero, tail_sae = ratios.pop("tail"), ratios.pop("tail_sae")
    ratios["ideal_three"] = round(1 + tail_zero["median"] + tail_sae["median"], 3)
    ratios["ideal_one"] = round(1 + tail_sae["median"], 3)
    ratios["ideal_one_zero"] = round(1 + tail_zero["median"], 3)
    ratios["tail_share_of_forward"] = tail_zero
    print(json.dumps(run_facts(batch=[8, 256], edited=f"{EDITED} inputs", **ratios), indent=1))


if __name__ == "__main__":
    main()
