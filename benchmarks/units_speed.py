"""Unit summaries against the plain work, in one process: the three ratios of issue 41.

    python benchmarks/units_speed.py [--quick] [--rounds N] [--dir DIR]   # about 2 minutes

Torch single-threaded, CPU time of the process; each ratio is taken within a round of
interleaved timings (the order reversed every other round), printed as median, min and
max over the rounds:

- ``stored``: ``summarize_store(store, key, UnitActivations())`` (k=20, window=8,
  above=0) over stored SAE latents, in rows per second over those of a plain read of the
  same rows (``FeatureStore.row_batches``, each batch converted to float32, as
  ``benchmarks/units_peers.py``'s ``read``). The store: 2^17 token rows of 256 latents,
  float16, ``relu(x - b)`` of standard normal ``x`` with biases giving latent ``i`` the
  density ``10 ** linspace(-4, -1)[i]`` (mean 1.45 %), samples of 128 tokens, batches
  of 4,096 rows. Goal: at least 0.5x.
- ``of_encoder``: the same over stored residual rows (256 wide, float16, 2^15 rows) with
  ``of=`` a 4,096-latent ReLU encoder, in time over a plain read + the encoder's own
  forward over those rows. Goal: at most 1.2x.
- ``validate``: ``trainer.validate`` of a small model (embedding, MLP, LayerNorm: 32
  batches of 4 x 128 tokens) with ``IOCaptureCallback(probes=[UnitActivations(of=
  encoder)])`` on its output, in time over ``validate`` with the encoder run on that
  output by hand in ``validation_step``. Goal: at most 1.2x. (Half the rounds for
  ``of_encoder``, the slowest.)

Also printed: each side's median CPU seconds, and the load average at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import quiet_trainer, spread
from torch.utils.data import DataLoader, TensorDataset
from units_peers import D_MODEL, DENSITY_RANGE, KEY, Encoder, build

from lightning_iocatch import FeatureStore, IOCaptureCallback
from lightning_iocatch.probes import UnitActivations
from lightning_iocatch.reports.store_units import summarize_store

HERE = Path(__file__).resolve().parent


def sparse_store(path: Path, rows: int) -> None:
    """``build``'s store with its rows made sparse latents (see the module docstring)."""
    import units_peers

    if (path / "built").exists():
        return
    density = torch.logspace(*DENSITY_RANGE, D_MODEL, dtype=torch.float64)
    bias = torch.distributions.Normal(0.0, 1.0).icdf(1 - density).float()
    plain = torch.randn

    def latents(*shape: Any, **options: Any) -> torch.Tensor:
        drawn = plain(*shape, **options)
        return torch.relu(drawn - bias) if drawn.dim() == 2 else drawn

    units_peers.torch.randn = latents  # type: ignore[assignment]
    try:
        build(path, rows)
    finally:
        units_peers.torch.randn = plain  # type: ignore[assignment]


def interleave(sides: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each side (the process's: torch runs one thread, so other jobs on
    the machine change them less than wall time), one warm-up round then ``rounds``
    rounds, the order alternating."""
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name in names if round_ % 2 else names[::-1]:
            start = time.process_time()
            sides[name]()
            if round_:
                seconds[name].append(time.process_time() - start)
    return seconds


def summary(seconds: dict[str, list[float]], base: str, side: str, *, speed: bool) -> dict:
    """The ratio per round (``speed``: base time over side time, a throughput ratio)."""
    pairs = zip(seconds[base], seconds[side], strict=True)
    ratios = [b / s if speed else s / b for b, s in pairs]
    return {
        "ratio": spread(ratios),
        **{f"{name}_s": round(statistics.median(seconds[name]), 4) for name in (base, side)},
    }


def stored(root: Path, rows: int, rounds: int) -> dict[str, Any]:
    path = root / f"sparse-{rows}"
    sparse_store(path, rows)
    store = FeatureStore(path)

    def plain() -> None:
        for batch in store.row_batches(KEY):
            batch.rows.float()

    def ours() -> None:
        summarize_store(store, KEY, UnitActivations())

    found = summary(interleave({"plain_read": plain, "ours": ours}, rounds), "plain_read",
                    "ours", speed=True)  # fmt: skip
    found["rows"] = rows
    found["rows_per_s"] = {
        name: round(rows / found[f"{name}_s"]) for name in ("plain_read", "ours")
    }
    return found


def of_encoder(root: Path, rows: int, rounds: int) -> dict[str, Any]:
    path = root / f"units-{rows}"
    build(path, rows)
    store, encoder = FeatureStore(path), Encoder()

    def plain() -> None:
        with torch.no_grad():
            for batch in store.row_batches(KEY):
                encoder(batch.rows)

    def ours() -> None:
        summarize_store(store, KEY, UnitActivations(of=encoder))

    found = summary(interleave({"read_encode": plain, "ours": ours}, rounds), "read_encode",
                    "ours", speed=False)  # fmt: skip
    return {"rows": rows, **found}


class Model(pl.LightningModule):
    """Embedding, MLP and LayerNorm as ``self.model``; ``by_hand``: the encoder applied to
    its output in ``validation_step``, the latents dropped."""

    def __init__(self, by_hand: torch.nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(1024, D_MODEL),
            torch.nn.Linear(D_MODEL, D_MODEL),
            torch.nn.GELU(),
            torch.nn.Linear(D_MODEL, D_MODEL),
            torch.nn.LayerNorm(D_MODEL),
        )
        self.by_hand = by_hand

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        hidden = self.model(batch[0])
        if self.by_hand is not None:
            self.by_hand(hidden)


def validate(batches: int, rounds: int) -> dict[str, Any]:
    ids = torch.randint(0, 1024, (batches * 4, 128), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids), batch_size=4)
    encoder = Encoder()
    by_hand, plain = Model(encoder), Model()

    def hand() -> None:
        quiet_trainer([]).validate(by_hand, loader, verbose=False)

    def ours() -> None:
        probe = UnitActivations(of=encoder)
        capture = IOCaptureCallback("outputs[model]", stages=["validate"], probes=[probe])
        quiet_trainer([capture]).validate(plain, loader, verbose=False)

    found = summary(interleave({"by_hand": hand, "ours": ours}, rounds), "by_hand", "ours",
                    speed=False)  # fmt: skip
    return {"tokens": batches * 4 * 128, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and rows")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=HERE / ".stores")
    parser.add_argument("--only", default="stored,of_encoder,validate")
    parser.add_argument("--stored-rows", type=int, default=2**17)
    parser.add_argument("--encoder-rows", type=int, default=2**15)
    parser.add_argument("--validate-batches", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    quick = 2 if args.quick else 1
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    wanted = args.only.split(",")
    if "stored" in wanted:
        report["stored"] = stored(args.dir, args.stored_rows // quick, rounds)
        print(json.dumps({"stored": report["stored"]}), file=sys.stderr)
    if "of_encoder" in wanted:
        encoder_rounds = max(2, rounds // 2)  # the slowest phase
        report["of_encoder"] = of_encoder(args.dir, args.encoder_rows // quick, encoder_rounds)
        print(json.dumps({"of_encoder": report["of_encoder"]}), file=sys.stderr)
    if "validate" in wanted:
        report["validate"] = validate(args.validate_batches // quick, rounds)
        print(json.dumps({"validate": report["validate"]}), file=sys.stderr)
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
