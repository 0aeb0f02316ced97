"""Which component causes a behaviour: attribution patching on a copying task.

    .venv/bin/python examples/attribution.py [--out runs/attribution] [--quick]

1. Train a tiny GPT-2 (3 blocks, width 64, 4 heads, random init) to copy: a sequence is
   ``HALF`` random tokens followed by the same tokens again, so the second half is
   predictable only by copying from ``HALF`` places back.
2. Validation pairs, the answer known by construction: the clean sequence, and the same
   with token ``P`` of the first half replaced (``corrupted_input_ids``). Its copy, token
   ``HALF + P``, no longer matches: only the prediction made at position ``COPY = HALF + P
   - 1`` gets worse, and only through what carries token ``P``'s identity there.
3. ``AttributionPatching`` through ``trainer.validate``, for two metrics: the default
   next-token loss (the change of the mean loss per token) and the logit difference at
   ``COPY`` (the corrupting token's logit minus the right one's, per pair). The
   components: the residual stream (the embeddings, ``model.transformer.drop``'s output,
   and every block's output) and each attention head (the input of ``attn.c_proj``).
4. Exact patching of every (residual stream, position) cell, one forward per cell and
   batch: the top cells and a few random ones beside their AtP estimates, and the Pearson
   correlation of AtP with exact patching over all cells, per metric and convention.
5. The heat maps of AtP and exact patching per block and position: ``OUT/atp-heatmap.png``.
"""

from __future__ import annotations

import argparse
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import AttributionPatching
from lightning_iocatch.capture import ModelIOCatcher
from lightning_iocatch.capture.attribution import components, patched_metric
from lightning_iocatch.lightning.attribution import corrupted_fields
from lightning_iocatch.lightning.effect_terms import next_token_loss

HALF, LAYERS, WIDTH, HEADS, VOCAB = 8, 3, 64, 4, 64
SEQ = 2 * HALF
P = 3  # the corrupted position of the first half
COPY = HALF + P - 1  # the position that predicts P's copy
EMBED = "model.transformer.drop"  # its output: the embeddings, the residual stream's start
ROWS = [EMBED, *(f"model.transformer.h.{b}" for b in range(LAYERS))]  # the residual stream
HEAD_INPUTS = "model.transformer.h.*.attn.c_proj"  # its input: the heads side by side
SPEC = f"outputs[{EMBED}|model.transformer.h.*]|inputs[{HEAD_INPUTS}]"
CONVENTIONS = ("denoising", "noising")
METRICS = ("loss", "logit difference")
BATCH = 32


def copies(count: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``HALF`` random tokens followed by the same tokens."""
    first = torch.randint(0, VOCAB, (count, HALF), generator=torch.Generator().manual_seed(seed))
    return torch.cat([first, first], dim=1)


class CopyTask(Dataset):
    """Copying sequences made on the fly, a fresh one at every index."""

    def __init__(self, count: int, seed: int = 0) -> None:
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = copies(1, self.seed * 1_000_003 + index)[0]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def pairs(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Clean sequences and, as ``corrupted_input_ids``, the same with token ``P`` replaced
    by ``distractor`` (the second half keeps the original: its token ``HALF + P`` is now
    the odd one out). ``distractor`` is a field of both runs: the logit difference reads it.
    """
    ids = copies(count, seed)
    shift = torch.randint(1, VOCAB, (count,), generator=torch.Generator().manual_seed(seed + 1))
    distractor = (ids[:, P] + shift) % VOCAB
    corrupted = ids.clone()
    corrupted[:, P] = distractor
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "corrupted_input_ids": c,
         "distractor": d}
        for i, c, d in zip(ids, corrupted, distractor, strict=True)
    ]  # fmt: skip


def logit_difference(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per pair, at ``COPY``: the distractor's logit minus the right token's (higher is
    worse, as a loss). The right token is ``HALF + P``'s, the same in both runs."""
    at = logits[:, COPY].double()
    right = batch["input_ids"][:, HALF + P]
    return (at.gather(-1, batch["distractor"][:, None]) - at.gather(-1, right[:, None]))[:, 0]


def loss_sums(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per sequence: the sum of its next-token losses (the callback's default loss)."""
    return next_token_loss(logits, batch)[0]


MEASURES: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "loss": loss_sums,
    "logit difference": logit_difference,
}
TERMS = {"loss": SEQ - 1, "logit difference": 1}  # terms per sample of each metric


class CopyLM(pl.LightningModule):
    """A GPT-2 as ``self.model``; ``self(input_ids, attention_mask)`` -> its output."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB,
                            n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def call(lm: pl.LightningModule, batch: dict[str, torch.Tensor]) -> Any:
    """How the model is called: its token fields only (``distractor`` is the metric's)."""
    return lm(batch["input_ids"], batch["attention_mask"])


def trainer(**options: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **options)  # fmt: skip


def train(*, quick: bool = False) -> CopyLM:
    """Step 1: the copying model."""
    pl.seed_everything(0, verbose=False)
    lm = CopyLM()
    steps = 200 if quick else 600
    trainer(max_steps=steps).fit(lm, DataLoader(CopyTask(steps * BATCH), batch_size=BATCH))
    return lm.eval()


def attribute(lm: CopyLM, data: list[dict[str, Any]], metric: str) -> AttributionPatching:
    """Step 3: AtP of every component per position, through ``trainer.validate``."""
    atp = AttributionPatching(
        SPEC,
        heads={HEAD_INPUTS: HEADS},
        forward=call,
        loss=None if metric == "loss" else logit_difference,
        exact=[f"{name}/outputs" for name in ROWS],  # each whole row, logged beside AtP
    )
    trainer(callbacks=[atp]).validate(lm, DataLoader(data, batch_size=BATCH), verbose=False)
    return atp


def exact_map(lm: CopyLM, data: list[dict[str, Any]], metric: str, convention: str) -> torch.Tensor:
    """Step 4: the exact patching effect of every (row, position), float64 ``[rows,
    positions]``, per term of the metric as the callback's scores: one forward per cell and
    batch. These are ``exact_patching(..., positions=mask)``'s steps, with the patched
    run's metric and the other run's values computed once per batch, not once per cell."""
    measure = MEASURES[metric]

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return measure(call(lm, batch).logits, batch)

    places = components(lm, f"outputs[{'|'.join(ROWS)}]")
    catcher = ModelIOCatcher(lm, None)
    total = torch.zeros(len(ROWS), SEQ, dtype=torch.float64)
    for batch in DataLoader(data, batch_size=BATCH):
        clean, corrupted = corrupted_fields(batch)
        base, source = (corrupted, clean) if convention == "denoising" else (clean, corrupted)
        with catcher(outputs=ROWS) as captured, torch.no_grad():
            run(source)
        with torch.no_grad():
            before = run(base)
        for row, place in enumerate(places):
            value = place.value(captured[place.module]["outputs"][0])
            for position in range(SEQ):
                mask = torch.zeros(value.shape[:2], dtype=torch.bool)
                mask[:, position] = True
                after = patched_metric(catcher, place, run, base, value, positions=mask)
                total[row, position] += (after - before).double().sum()
    return total / (len(data) * TERMS[metric])


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def slope(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    """The least-squares slope of AtP on exact patching through 0: the scale that Pearson's
    correlation does not see (1: the right size; 0.5: half of it)."""
    estimate, truth = estimate.flatten().double(), truth.flatten().double()
    return float((estimate * truth).sum() / (truth * truth).sum())


def stream(atp: AttributionPatching, convention: str) -> torch.Tensor:
    """``[rows, positions]``: the residual stream's AtP scores."""
    return torch.stack([atp.scores[convention][f"{name}/outputs"] for name in ROWS])


def heads(atp: AttributionPatching, convention: str) -> torch.Tensor:
    """``[blocks x heads, positions]``: each head's AtP scores."""
    found = [atp.scores[convention][f"{name}.attn.c_proj/inputs"].T for name in ROWS[1:]]
    return torch.cat(found)


def row_label(name: str) -> str:
    return "embeddings" if name == EMBED else name.removeprefix("model.transformer.")


def run(out: Path, *, quick: bool = False, lm: CopyLM | None = None) -> dict[str, Any]:
    """Every step; ``lm``: a trained :class:`CopyLM` (trained here when not given)."""
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: more threads only wait on each other
    try:
        lm = lm or train(quick=quick)
        data = pairs(BATCH if quick else 8 * BATCH)
        result: dict[str, Any] = {"lm": lm, "data": data, "atp": {}, "atp_heads": {}}
        result |= {"exact": {}, "correlation": {}, "slope": {}}
        for metric in METRICS:
            atp = attribute(lm, data, metric)
            result["atp"][metric] = {c: stream(atp, c) for c in CONVENTIONS}
            result["atp_heads"][metric] = {c: heads(atp, c) for c in CONVENTIONS}
            result["exact"][metric] = {c: exact_map(lm, data, metric, c) for c in CONVENTIONS}
            result["correlation"][metric] = {
                c: pearson(result["atp"][metric][c], result["exact"][metric][c])
                for c in CONVENTIONS
            }
            result["slope"][metric] = {
                c: slope(result["atp"][metric][c], result["exact"][metric][c]) for c in CONVENTIONS
            }
            result.setdefault("logged", {})[metric] = atp.last_values
    finally:
        torch.set_num_threads(threads)
    result["heatmap"] = heatmap(result, out / "atp-heatmap.png")
    return result


def heatmap(result: dict[str, Any], path: Path) -> Path:
    """Step 5: AtP (left) and exact patching (right) per residual stream row and position,
    for each metric and convention; red where patching raises the metric (the loss)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10.0, 8.2), layout="constrained")
    cells = [(m, c) for m in METRICS for c in CONVENTIONS]
    axes = figure.subplots(len(cells), 2, sharex=True, sharey=True)
    labels = [row_label(name) for name in ROWS]
    for (metric, convention), pair in zip(cells, axes, strict=True):
        maps = (result["atp"][metric][convention], result["exact"][metric][convention])
        bound = max(float(m.abs().max()) for m in maps) or 1.0
        for ax, values, what in zip(pair, maps, ("AtP", "exact patching"), strict=True):
            image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound,
                              aspect="auto")  # fmt: skip
            ax.set_title(f"{convention}, {metric}: {what}", fontsize=9, loc="left")
            ax.set_yticks(range(len(labels)), labels, fontsize=8)
            ax.set_xticks(range(SEQ), [_position(t) for t in range(SEQ)], fontsize=7)
        figure.colorbar(image, ax=list(pair), shrink=0.9, pad=0.01)
    for ax in axes[-1]:
        ax.set_xlabel("position (P: the corrupted token; copy: where its copy is predicted)",
                      fontsize=8)  # fmt: skip
    figure.savefig(path, dpi=80)
    return path


def _position(t: int) -> str:
    return f"{t}\nP" if t == P else f"{t}\ncopy" if t == COPY else str(t)


def table(
    result: dict[str, Any], metric: str, convention: str, top: int = 4, random: int = 2
) -> list[str]:
    """The ``top`` cells by |AtP| and ``random`` others, AtP beside exact patching."""
    atp, exact = result["atp"][metric][convention], result["exact"][metric][convention]
    order = atp.abs().flatten().argsort(descending=True, stable=True).tolist()
    shuffled = torch.randperm(len(order) - top, generator=torch.Generator().manual_seed(0))
    picked = order[:top] + [order[top + i] for i in shuffled[:random].tolist()]
    lines = []
    for n, cell in enumerate(picked):
        row, position = divmod(cell, SEQ)
        name = f"{row_label(ROWS[row])} @ {position}" + (" (random)" if n >= top else "")
        lines.append(f"  {name:26s} {float(atp[row, position]):+9.4f} "
                     f"{float(exact[row, position]):+9.4f}")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/attribution"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, for a smoke test")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    result = run(args.out, quick=args.quick)
    logged = result["logged"]["loss"]
    print(f"copying {HALF} random tokens; token {P} corrupted, its copy predicted at position "
          f"{COPY}; {len(result['data'])} pairs")  # fmt: skip
    print(f"mean loss per token: clean {logged['atp/clean/loss']:.3f}, corrupted "
          f"{logged['atp/corrupted/loss']:.3f} (chance {math.log(VOCAB):.3f})")  # fmt: skip
    print("the change of the metric when a cell is patched (loss: per token; logit difference: "
          "per pair)")  # fmt: skip
    for metric in METRICS:
        for convention in CONVENTIONS:
            print(f"{convention + ', ' + metric:28s} {'AtP':>9s} {'exact':>9s}")
            print("\n".join(table(result, metric, convention)))
    print(f"AtP against exact patching, all {len(ROWS)} x {SEQ} cells: Pearson's r, and the slope "
          "(1: the right size)")  # fmt: skip
    header = [f"{c} {what}" for c in CONVENTIONS for what in ("r", "slope")]
    print(f"  {'':17s}" + "".join(f"{h:>16s}" for h in header))
    for metric, found in result["correlation"].items():
        scale = result["slope"][metric]
        cells = "".join(f"{found[c]:16.3f}{scale[c]:16.4f}" for c in CONVENTIONS)
        print(f"  {metric:17s}{cells}")
    found = result["atp_heads"]["loss"]["denoising"][:, COPY].reshape(LAYERS, HEADS)
    print(f"denoising AtP (loss) of each head at position {COPY}:")
    for block, row in enumerate(found.tolist()):
        print(f"  h.{block}  " + "".join(f"{value:+9.4f}" for value in row))
    print(f"heat maps: {result['heatmap']}")


if __name__ == "__main__":
    main()
