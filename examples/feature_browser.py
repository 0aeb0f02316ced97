"""What each latent of a sparse autoencoder reads: top examples, density, a feature browser.

    .venv/bin/python examples/feature_browser.py [--out runs/browser] [--quick]

1. Train the character-level GPT-2 and the sparse autoencoder of
   ``examples/interventions.py`` (English prose and Python code that ship with the
   installed packages; nothing is downloaded).
2. Dump block 0's outputs over both texts into one store, one row per character
   (``TokenRows``): the prose windows first, then the code.
3. ``summarize_store`` runs ``UnitActivations(of=sae.encode)`` over the dump: each stored
   batch read once, the SAE's encoder applied to its rows, and per latent its 20 largest
   activations (with 12 characters each side) and how often it is active.
4. ``write_browser`` writes the feature browser (static HTML, opens from disk), and the
   top contexts of the densest latents are printed.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from examples.interventions import KEY, dump, train
from lightning_iocatch.probes import UnitActivations, UnitSummary
from lightning_iocatch.reports import summarize_store, write_browser

K, WINDOW = 20, 12


def characters(ids: list[int]) -> list[str]:
    """The tokens of the character-level model: one byte each."""
    return [chr(i) for i in ids]


def run(out: Path, *, quick: bool = False, models: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps 2 to 4 on ``models`` (``interventions.train``'s, trained when not given)."""
    models = models or train(out, quick=quick)
    both = models["train"]["prose"] + models["train"]["code"]
    store = dump(models["lm"], both, out / "both")
    probe = UnitActivations(k=K, window=WINDOW, above=0.0, of=models["sae"].encode)
    summary = summarize_store(store, KEY, probe)
    summary.save(out / "latents.safetensors")
    index = write_browser(summary, out / "browser", tokenizer=characters)
    return {"summary": summary, "store": store, "sae": models["sae"], "index": index,
            "prose_windows": len(models["train"]["prose"])}  # fmt: skip


def context(summary: UnitSummary, unit: int, slot: int) -> str:
    """An example's characters, the example's own in brackets."""
    ids = summary.context_ids[unit, slot].tolist()
    middle = len(ids) // 2
    text = [chr(i) if i >= 0 else "" for i in ids]
    text[middle] = f"[{text[middle]}]"
    return "".join(text).replace("\n", "\\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/browser"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, for a smoke test")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    result = run(args.out, quick=args.quick)
    summary: UnitSummary = result["summary"]
    density = summary.density()
    dead = int((summary.active == 0).sum())
    print(f"{summary.units} latents over {summary.rows} characters: {dead} never active, "
          f"median density {float(density.median()):.4f}")  # fmt: skip
    alive = (summary.active > 0).nonzero().flatten()
    shown = alive[torch.argsort(density[alive])][:4]  # the most selective latents
    for unit in shown.tolist():
        where = "code" if int(summary.top_index[unit, 0]) >= result["prose_windows"] else "prose"
        print(f"latent {unit}: density {float(density[unit]):.4f}, top example from the {where}")
        for slot in range(3):
            print(f"  {float(summary.top_values[unit, slot]):7.3f}  {context(summary, unit, slot)}")
    print(f"feature browser: {result['index']}")


if __name__ == "__main__":
    main()
