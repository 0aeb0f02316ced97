"""Interventions end to end: splice a sparse autoencoder into a language model, and steer it.

    .venv/bin/python examples/interventions.py [--out runs/interventions] [--quick]

1. Train a small character-level GPT-2 (2 blocks, width 64) on two kinds of text that ship
   with the installed packages (nothing is downloaded): English prose (scikit-learn's
   dataset descriptions) and Python code (the standard library's ``json`` package).
2. Dump block 0's outputs (the residual stream after it), one row per character
   (``TokenRows``), with ``IOCaptureCallback`` and ``FeatureWriter`` in a predict loop.
3. Train a sparse autoencoder on the dump through ``StoreDataModule``: ``SAEModule``,
   TopK with SAELens' recipe.
4. Evaluate it with ``trainer.validate`` and ``InterventionEffects``: the held-out text's
   next-character cross-entropy clean, with the SAE's reconstruction spliced in place of
   block 0's output, and with that output zero-ablated; the CE loss recovered and the KL
   divergence from the clean model.
5. Steer: the difference between block 0's mean output on code and on prose (two dumps'
   ``FeatureStore.mean``), added to the residual stream with a strength alpha, and its
   effect on the probability the model gives to a "code character" coming next (one far
   more frequent in the code than in the prose), a loss of our own for
   ``InterventionEffects``.
"""

from __future__ import annotations

import argparse
import logging
import sysconfig
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import sklearn
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import (
    FeatureStore,
    FeatureWriter,
    InterventionEffects,
    IOCaptureCallback,
    SAEModule,
    StoreDataModule,
    TokenRows,
)
from lightning_iocatch.capture import Replace, Steer, Zero

LAYER = "model.transformer.h.0"
KEY = f"{LAYER}/outputs"
CONTEXT, WIDTH = 64, 64
STRENGTHS = (-4.0, -2.0, 2.0, 4.0)
LATENTS, K = 4 * WIDTH, 16  # the SAE's latents, and how many fire on each row (TopK)


def texts() -> dict[str, bytes]:
    """English prose and Python code from the installed packages."""
    descr = Path(sklearn.__file__).parent / "datasets" / "descr"
    code = Path(sysconfig.get_paths()["stdlib"]) / "json"
    return {
        "prose": b"\n".join(p.read_bytes() for p in sorted(descr.glob("*.rst"))),
        "code": b"\n".join(p.read_bytes() for p in sorted(code.glob("*.py"))),
    }


def windows(text: bytes, start: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` windows of ``CONTEXT`` characters, every ``CONTEXT``, from ``start``."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    found = []
    for k in range(count):
        ids = data[start + k * CONTEXT : start + (k + 1) * CONTEXT]
        found.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return found


def split(text: bytes, held_out: int) -> tuple[list[dict], list[dict]]:
    """Training windows, and ``held_out`` windows from the end of the text."""
    count = len(text) // CONTEXT
    return windows(text, 0, count - held_out), windows(text, (count - held_out) * CONTEXT, held_out)


class CharLM(pl.LightningModule):
    """A GPT-2 over bytes as ``self.model``; ``self(input_ids, attention_mask)`` -> output."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=256,
                            n_positions=CONTEXT, bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch, labels=batch["input_ids"]).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch, labels=batch["input_ids"]).loss)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def trainer(**options: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **options)  # fmt: skip


def dump(lm: CharLM, data: list[dict], out: Path) -> FeatureStore:
    writer = FeatureWriter(out, mode="overwrite", tokens=TokenRows())
    capture = IOCaptureCallback(f"outputs[{LAYER}]", early_exit=True, writer=writer)
    trainer(callbacks=[capture]).predict(
        lm, DataLoader(data, batch_size=64), return_predictions=False
    )
    return FeatureStore(out)


def effects(lm: CharLM, data: list[dict], variants: dict, **options: Any) -> dict[str, float]:
    measured = InterventionEffects(variants, **options)
    trainer(callbacks=[measured]).validate(lm, DataLoader(data, batch_size=64), verbose=False)
    return measured.last_values


def train(out: Path, *, quick: bool = False) -> dict[str, Any]:
    """Steps 1 to 3: the language model, a dump of each kind of text, the SAE on both."""
    pl.seed_everything(0, verbose=False)
    train_data, held_out = {}, {}
    for name, text in texts().items():
        train_data[name], held_out[name] = split(text, held_out=16 if quick else 64)
    lm = CharLM()
    steps = 60 if quick else 1500
    both = DataLoader(train_data["prose"] + train_data["code"], batch_size=32, shuffle=True)
    trainer(max_steps=steps).fit(lm, both)
    lm.eval()

    stores = {name: dump(lm, train_data[name], out / name) for name in train_data}
    # SAELens' TopK recipe; the input normalisation estimated from the first 8 batches
    module = SAEModule(WIDTH, LATENTS, "topk", k=K, key=KEY, lr=3e-3, normalize_batches=8,
                       dead_after_tokens=50_000)  # fmt: skip
    for name in stores:  # one store per kind of text: the SAE reads both
        data = StoreDataModule(out / name, KEY, batch_size=256, seed=0)
        trainer(max_epochs=1 if quick else 4).fit(module, datamodule=data)
    sae = module.sae.eval()  # a SparseAutoencoder: encode, decode, forward
    return {"lm": lm, "sae": sae, "train": train_data, "held_out": held_out, "stores": stores}


def run(out: Path, *, quick: bool = False, models: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps 4 and 5 on ``models`` (:func:`train`'s, trained into ``out`` when not given)."""
    models = models or train(out, quick=quick)
    lm, sae, stores, held_out = models["lm"], models["sae"], models["stores"], models["held_out"]

    evaluation = held_out["prose"] + held_out["code"]
    spliced = effects(lm, evaluation, {
        "splice": [Replace(LAYER, sae)],
        "zero": [Zero(LAYER)],
    }, recovered={"splice": "zero"})  # fmt: skip

    x = torch.cat([stores[name].rows(KEY)[1][:20_000] for name in stores])
    with torch.no_grad():
        active = float((sae.encode(x) > 0).float().sum(-1).mean())

    # steering: block 0's mean output on code minus on prose, added with a strength alpha;
    # the measure: the probability the model gives to the next character being one of the
    # characters far more frequent in code than in prose (found in the training text)
    toward_code = stores["code"].mean(KEY) - stores["prose"].mean(KEY)
    frequency = {name: torch.bincount(torch.frombuffer(bytearray(text), dtype=torch.uint8).long(),
                                      minlength=256).double() / len(text)
                 for name, text in texts().items()}  # fmt: skip
    symbols = torch.tensor([not chr(c).isalnum() for c in range(256)])
    code_chars = (frequency["code"] > 5 * frequency["prose"]) & (frequency["code"] > 1e-3)
    code_chars = (code_chars & symbols).nonzero().flatten()

    def code_probability(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.softmax(logits.double(), -1)[..., code_chars].sum(-1).mean(-1)

    steering = {f"{alpha:+g}": [Steer(LAYER, toward_code, alpha=alpha)] for alpha in STRENGTHS}
    steered = {
        name: effects(lm, held_out[name], steering, loss=code_probability) for name in held_out
    }
    return {
        "spliced": spliced,
        "active": active,
        "steered": steered,
        "code_chars": bytes(code_chars.tolist()).decode(),
        "rows": {k: len(s) for k, s in stores.items()},
        "lm": lm,
        "held_out": held_out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/interventions"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, for a smoke test")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    result = run(args.out, quick=args.quick)
    s = result["spliced"]
    print(f"dumped {KEY}: {result['rows']} rows (one per character)")
    print("next-character cross-entropy on held-out prose and code (nats):")
    print(f"  clean {s['effects/clean/loss']:.3f}   SAE spliced {s['effects/splice/loss']:.3f}"
          f"   zero-ablated {s['effects/zero/loss']:.3f}")  # fmt: skip
    print(f"  CE loss recovered by the SAE: {s['effects/splice/loss_recovered']:.3f}"
          f" ({result['active']:.1f} of {LATENTS} latents active per character)")  # fmt: skip
    print(f"  KL from clean: SAE {s['effects/splice/kl']:.3f}, zero {s['effects/zero/kl']:.3f}")
    print(f"steering block 0 by alpha x (mean on code - mean on prose): the probability of a "
          f"code character ({result['code_chars']!r}) next, mean over positions")  # fmt: skip
    print("  alpha:    " + "".join(f"{a:>8g}" for a in (0.0, *STRENGTHS)))
    for name, values in result["steered"].items():
        row = [values["effects/clean/loss"]]
        row += [values[f"effects/{alpha:+g}/loss"] for alpha in STRENGTHS]
        print(f"  on {name:5s}  " + "".join(f"{p:8.4f}" for p in row))


if __name__ == "__main__":
    main()
