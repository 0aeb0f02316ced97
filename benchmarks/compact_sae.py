"""Compact stores: what a smaller storage dtype costs the sparse autoencoder trained on it.

The same token rows as ``compact_store.py`` (one block's output of a byte-level GPT-2
trained on the Python standard library, :mod:`compact_common`) dumped as float32, bfloat16
and float8_e4m3fn. On each store the same SAE is trained: same seed (initialisation and
``StoreRows`` order), steps, batch and hyperparameters, rows read as float32 (what the
store gives for the dtype, widened). Every SAE is then evaluated on **float32**
activations of held-out text (other files of the standard library), taken with Hugging
Face's ``output_hidden_states``:

- **MSE**: mean squared error per value; **explained variance**: ``1 - sum|x - x_hat|^2 /
  sum|x - mean(x)|^2``; **L0**: mean number of active latents per token;
- **CE loss recovered**: ``InterventionEffects`` over ``trainer.validate`` on the held-out
  text, the SAE spliced in at the block's output against a zero ablation of it:
  ``(loss_zero - loss_splice) / (loss_zero - loss_clean)``.

Seeds 0, 1, 2 (``--seeds``): each figure's mean and spread (min, max), and each dtype's
difference from float32 paired by seed. A difference that exceeds the seed spread of
float32 is called out. A codec is lossless: where ``codec="zstd"`` is available its store
is checked to read bit-identical rows (``torch.equal``), and no SAE is trained on it.

The SAE (TopK): ``codes`` = the ``k`` largest of ``(x / s - b_dec) W_enc + b_enc``, ReLU,
the others 0; ``x_hat = s (codes W_dec + b_dec)``; 4 x the width in latents, ``k`` 8 (a
fixed L0 at most ``k``: no sparsity penalty to tune per variant); loss ``|x/s - x_hat/s|^2``,
Adam; ``s`` makes the first batch's mean squared norm equal the width, ``b_dec`` starts at
its mean.

    python benchmarks/compact_sae.py            # 9 minutes on 2 shared cores, 3 dtypes
                                                # (+ the model's training once, cached)
    python benchmarks/compact_sae.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from compact_common import (
    CACHE,
    CODECS,
    DTYPES,
    FULL,
    QUICK,
    ByteLM,
    Setup,
    accepted_variants,
    block_outputs,
    dump,
    dump_ids,
    eval_ids,
    loader,
    quiet,
    records_scale,
    store_bytes,
    trained_lm,
)
from torch import nn
from torch.utils.data import DataLoader

from lightning_iocatch import FeatureStore, InterventionEffects, StoreRows
from lightning_iocatch.capture import Replace, Zero

METRICS = ("mse", "explained_variance", "l0", "ce_recovered", "splice_loss")


@dataclass(frozen=True)
class Training:
    """The SAE's hyperparameters (the same for every variant)."""

    expansion: int = 4
    k: int = 8  # active latents per token (1/16 of the width)
    steps: int = 3000
    batch: int = 256
    lr: float = 1e-3


QUICK_TRAINING = Training(k=8, steps=40, batch=64)


class SAE(nn.Module):
    """A TopK sparse autoencoder with a fixed input scale ``s`` (see the module's doc)."""

    def __init__(self, width: int, codes: int, k: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        decoder = torch.randn(codes, width, generator=generator)
        decoder = 0.1 * decoder / decoder.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(decoder)
        self.W_enc = nn.Parameter(decoder.T.clone())
        self.b_enc = nn.Parameter(torch.zeros(codes))
        self.b_dec = nn.Parameter(torch.zeros(width))
        self.register_buffer("scale", torch.ones(()))
        self.k = k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        pre = (x / self.scale - self.b_dec) @ self.W_enc + self.b_enc
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes @ self.W_dec + self.b_dec) * self.scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = self.encode(x)
        return self.decode(codes), codes


def train_sae(path: Path, setup: Setup, training: Training, seed: int) -> SAE:
    """The SAE trained on the store at ``path``, its rows read as float32 by StoreRows."""
    torch.manual_seed(seed)
    sae = SAE(setup.width, training.expansion * setup.width, training.k, seed)
    optimizer = torch.optim.Adam(sae.parameters(), lr=training.lr)
    data = StoreRows(path, setup.key, batch_size=training.batch, seed=seed, dtype=torch.float32)
    step = epoch = 0
    while step < training.steps:
        data.set_epoch(epoch)
        for batch in DataLoader(data, batch_size=None):
            x = batch[setup.key]
            if step == 0:
                sae.scale.fill_(float(x.pow(2).sum(-1).mean().div(setup.width).sqrt()))
                with torch.no_grad():
                    sae.b_dec.copy_(x.mean(0) / sae.scale)  # start at the rows' mean
            x_hat, _ = sae(x)
            optimizer.zero_grad()
            ((x_hat - x) / sae.scale).pow(2).sum(-1).mean().backward()
            optimizer.step()
            step += 1
            if step == training.steps:
                break
        epoch += 1
    return sae.eval()


def reconstruction(sae: SAE, x: torch.Tensor) -> dict[str, float]:
    """MSE per value, explained variance and L0 of ``sae`` on the rows ``x``."""
    with torch.no_grad():
        x_hat, codes = sae(x)
    residual = (x_hat - x).double()
    return {
        "mse": float(residual.pow(2).mean()),
        "explained_variance": float(
            1 - residual.pow(2).sum() / (x.double() - x.double().mean(0)).pow(2).sum()
        ),
        "l0": float((codes > 0).double().sum(-1).mean()),
    }


def ce_recovered(lm: ByteLM, setup: Setup, sae: SAE, ids: torch.Tensor) -> dict[str, float]:
    """CE loss with the SAE spliced in, and recovered against a zero ablation."""
    effects = InterventionEffects(
        {"splice": [Replace(setup.module, lambda h: sae(h)[0])], "zero": [Zero(setup.module)]},
        recovered={"splice": "zero"},
    )
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[effects])  # fmt: skip
    trainer.validate(lm, loader(ids, batch_size=16), verbose=False)
    values = effects.last_values
    return {
        "ce_recovered": values["effects/splice/loss_recovered"],
        "splice_loss": values["effects/splice/loss"],
        "clean_loss": values["effects/clean/loss"],
        "zero_loss": values["effects/zero/loss"],
    }


def codec_checks(paths: dict[str, Path], key: str) -> dict[str, str]:
    """Each codec store's rows against its plain partner's: bit-identical or not."""
    found = {}
    for name, path in paths.items():
        if "+" not in name:
            continue
        plain, coded = FeatureStore(paths[name.split("+")[0]]), FeatureStore(path)
        same = torch.equal(plain.indices, coded.indices) and torch.equal(plain[key], coded[key])
        found[name] = "bit-identical" if same else "DIFFERENT"
    return found


def quantization_error(paths: dict[str, Path], key: str) -> dict[str, float]:
    """Relative RMS error of each dtype's stored rows (as float32) to the float32 store's."""
    exact = FeatureStore(paths["float32"])[key].double()
    return {
        name: float(
            (FeatureStore(path)[key].double() - exact).pow(2).sum().sqrt()
            / exact.pow(2).sum().sqrt()
        )
        for name, path in paths.items()
        if "+" not in name
    }


def study(
    setup: Setup, training: Training, seeds: tuple[int, ...], work: Path, cache: Path = CACHE
) -> dict[str, Any]:
    """Dump into ``work``, train every SAE, evaluate; ``"saes"`` and ``"model"`` hold the
    SAEs and the language model (not printed)."""
    lm, trained = trained_lm(setup, cache)
    ids = dump_ids(setup)
    writers, skipped = accepted_variants(work, DTYPES, CODECS)
    paths: dict[str, Path] = {}
    rows: dict[str, int] = {}
    for name, out in writers.items():
        dump(lm, setup, ids, out)
        paths[name], rows[name] = work / name, out.rows_written
    held_out = eval_ids(setup)
    x = block_outputs(lm, setup, held_out)
    runs: dict[str, dict[int, dict[str, float]]] = {}
    saes: dict[tuple[str, int], SAE] = {}
    for seed in seeds:
        for name in (n for n in paths if "+" not in n):
            sae = train_sae(paths[name], setup, training, seed)
            saes[name, seed] = sae
            figures = {**reconstruction(sae, x), **ce_recovered(lm, setup, sae, held_out)}
            runs.setdefault(name, {})[seed] = figures
            print(f"  seed {seed} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    return {
        "setup": setup.digest(),
        "training": training.__dict__,
        "lm": trained,
        "rows": rows,
        "bytes_per_row": {name: store_bytes(path) / rows[name] for name, path in paths.items()},
        "fp8_scale_recorded": {n: records_scale(p) for n, p in paths.items() if "float8" in n},
        "eval_tokens": len(x),
        "codec": codec_checks(paths, setup.key),
        "quantization_error": quantization_error(paths, setup.key),
        "runs": runs,
        "summary": summary(runs),
        "skipped": skipped,
        "saes": saes,
        "model": lm,
    }


def summary(runs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per dtype and figure: mean, min, max over seeds, and the difference from float32
    paired by seed (mean, min, max); float32's own spread is the yardstick."""
    found: dict[str, dict[str, Any]] = {}
    base = runs.get("float32", {})
    for name, by_seed in runs.items():
        found[name] = {}
        for metric in METRICS:
            values = [by_seed[s][metric] for s in sorted(by_seed)]
            entry = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
            if name != "float32" and base:
                diffs = [by_seed[s][metric] - base[s][metric] for s in sorted(by_seed)]
                entry["diff"] = statistics.fmean(diffs)
                entry["diff_min"], entry["diff_max"] = min(diffs), max(diffs)
                spread = max(v[metric] for v in base.values()) - min(
                    v[metric] for v in base.values()
                )
                # one seed has no spread: nothing can be called beyond it
                entry["beyond_spread"] = len(base) > 1 and abs(entry["diff"]) > spread
            found[name][metric] = entry
    return found


def markdown(result: dict[str, Any]) -> str:
    """The table of the docs and the verdicts."""
    lines = [
        "| stored as | rel. RMS error of rows | MSE | explained variance | L0 | CE loss recovered "
        "| CE loss with SAE (nats) |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(entry: dict[str, Any], digits: int) -> str:
        text = f"{entry['mean']:.{digits}f} ({entry['min']:.{digits}f}, {entry['max']:.{digits}f})"
        if "diff" in entry:
            flag = " **beyond seed spread**" if entry["beyond_spread"] else ""
            text += f"<br>vs float32: {entry['diff']:+.{digits}f}{flag}"
        return text

    for name, figures in result["summary"].items():
        error = result["quantization_error"][name]
        lines.append(
            f"| {name} | {error:.2e} | {cell(figures['mse'], 5)} | "
            f"{cell(figures['explained_variance'], 4)} | {cell(figures['l0'], 1)} | "
            f"{cell(figures['ce_recovered'], 4)} | {cell(figures['splice_loss'], 4)} |"
        )
    for name, reason in result["skipped"].items():
        if "+" not in name:
            lines.append(f"| {name} | skipped: {reason.splitlines()[0][:80]} | | | | | |")
    lines.append("")
    for name, scaled in result["fp8_scale_recorded"].items():
        how = "with a scale recorded in the store" if scaled else "a plain cast, no scale recorded"
        lines.append(f"- {name}: stored {how}")
    for name, verdict in result["codec"].items():
        lines.append(f"- {name}: rows read {verdict} to {name.split('+')[0]}'s")
    for name, figures in result["summary"].items():
        if name == "float32":
            continue
        beyond = [m for m in METRICS if figures[m].get("beyond_spread")]
        if len(result["runs"]["float32"]) < 2:
            lines.append(f"- {name}: one seed, no spread to judge the differences by")
            continue
        lines.append(
            f"- {name}: "
            + (f"differs from float32 by more than the seed spread in {', '.join(beyond)}"
               if beyond else "every difference from float32 is within the seed spread")
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few seconds")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="SAE steps (default 3000)")
    parser.add_argument("--k", type=int, default=None, help="active latents (default 8)")
    parser.add_argument("--json", action="store_true", help="print the JSON result too")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(args.threads)
    setup, training = (QUICK, QUICK_TRAINING) if args.quick else (FULL, Training())
    if args.steps:
        training = Training(**{**training.__dict__, "steps": args.steps})
    if args.k:
        training = Training(**{**training.__dict__, "k": args.k})
    seeds = tuple(range(args.seeds or (1 if args.quick else 3)))
    work = Path(tempfile.mkdtemp(prefix="compact-sae-"))
    try:
        result = study(setup, training, seeds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.pop("saes"), result.pop("model")
    if args.json:
        print(json.dumps(result, indent=1))
    t, lm = training, result["lm"]
    print(f"SAE {t.expansion}x on {setup.key} (width {setup.width}), {t.steps} steps of "
          f"{t.batch} rows, TopK k {t.k}, lr {t.lr}, seeds {list(seeds)}; "
          f"{result['rows']['float32']} training rows; evaluated on {result['eval_tokens']} "
          f"held-out tokens (model: {lm['held_out_loss_after']} nats/byte, clean)")  # fmt: skip
    print(markdown(result))


if __name__ == "__main__":
    main()
