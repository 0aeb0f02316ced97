"""The work of one process of ``benchmarks/units.py``: the synthetic SAE, the stores, and
each measured way of reading them (ours, a plain read, ``torch.topk`` in memory, the
peers' caching), run in a fresh process so that its peak RSS is its own.

    python benchmarks/units_peers.py KIND STORE ROWS_UP_TO [SAVE]
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import peak_memory
import torch

KEY = "sae_in"  # the stored residual activations a SAE reads
D_MODEL = 256
LATENTS = 4096
CONTEXT = 128  # tokens per sample, every one a row
BATCH_SAMPLES = 32  # samples per stored batch: 4,096 rows
VOCAB = 50_257
K, WINDOW, ABOVE = 20, 8, 0.0
ROWS_PER_STEP = 8192
# each latent's density, log-uniform from 10^-4 to 10^-1 (mean 1.45 %): a ReLU SAE's spread
DENSITY_RANGE = (-4.0, -1.0)


class Encoder(torch.nn.Module):
    """A ReLU SAE encoder ``relu((x - b_dec) @ W_enc + b_enc)`` with random weights (a fixed
    seed) whose biases give latent ``i`` of standard normal inputs the density
    ``10 ** linspace(-4, -1)[i]``; float16 rows are computed in float32."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(D_MODEL, LATENTS, generator=generator)
        self.W_enc = torch.nn.Parameter(weight / weight.norm(dim=0), requires_grad=False)
        density = torch.logspace(*DENSITY_RANGE, LATENTS, dtype=torch.float64)
        threshold = torch.distributions.Normal(0.0, 1.0).icdf(1 - density).float()
        self.b_enc = torch.nn.Parameter(-threshold, requires_grad=False)
        self.b_dec = torch.nn.Parameter(torch.zeros(D_MODEL), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x.float() - self.b_dec) @ self.W_enc + self.b_enc)


def build(path: Path, rows: int) -> None:
    """A store of ``rows`` token rows (float16, ``D_MODEL`` wide) with positions and token
    ids, written by ``ShardWriter`` in batches of ``BATCH_SAMPLES`` samples; kept once built."""
    from lightning_iocatch.store import ShardWriter, TokenSelection, prepare_store

    if (path / "built").exists():
        return
    settings = {
        "spec": None,
        "stage": "predict",
        "dtype": None,
        "tokens": {"mask": "attention_mask", "token_ids": "input_ids", "drop_first": False,
                   "drop_token_ids": [], "reduce": None},
    }  # fmt: skip
    plan = prepare_store(path, "overwrite" if path.exists() else "create", settings)
    writer = ShardWriter(path, rank=0, plan=plan, durable=False)
    generator = torch.Generator().manual_seed(1)
    samples = rows // CONTEXT
    for step, first in enumerate(range(0, samples, BATCH_SAMPLES)):
        count = min(BATCH_SAMPLES, samples - first)
        keep = torch.ones(count, CONTEXT, dtype=torch.bool)
        ids = torch.randint(0, VOCAB, (count, CONTEXT), generator=generator)
        residual = torch.randn(count * CONTEXT, D_MODEL, generator=generator).half()
        writer.write(
            {KEY: residual},
            list(range(first, first + count)),
            batch_idx=step,
            tokens=TokenSelection(keep, ids, None),
            token_keys=[KEY],
        )
    writer.close()
    (path / "built").touch()


# Reading: the same stored batches, the same way, for every kind


def batches(store: Any) -> Iterator[Any]:
    """Each stored batch's rows with their dataset index, position and token id, read as
    ``summarize_store`` reads them (``FeatureStore.row_batches``)."""
    return store.row_batches(KEY)


class Marks:
    """RSS and seconds after 10 %, 50 % and 100 % of the stored batches (flat memory: alike)."""

    def __init__(self) -> None:
        self.total, self.start, self.seen = 0, time.perf_counter(), 0
        self.marks: list[dict[str, float]] = []

    def watch(self, store: Any) -> None:
        """Count the batches ``store.row_batches`` yields, whoever reads them."""
        self.total = sum(KEY in b.keys for b in store.stored_batches())
        wanted = {max(1, self.total // 10), max(1, self.total // 2), self.total}
        read = store.row_batches

        def counted(key: str, share: tuple[int, int] = (0, 1)) -> Iterator[Any]:
            for batch in read(key, share):
                yield batch
                self.seen += 1
                if self.seen in wanted:
                    seconds = round(time.perf_counter() - self.start, 1)
                    rss = {"rss_mib": round(_rss() / 2**20), **_rss_parts()}
                    self.marks.append({"batches": self.seen, "seconds": seconds, **rss})

        store.row_batches = counted


def warm(path: Path) -> int:
    """Read every file of the store once (untimed): the timed reads find it in the page cache."""
    total = 0
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb", buffering=0) as handle:
                while chunk := handle.read(64 << 20):
                    total += len(chunk)
    return total


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_parts() -> dict[str, int]:
    """Resident MiB now: anonymous (tensors, Python) and file-backed (mapped shards)."""
    parts = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            parts[line[3:7].lower() + "_mib"] = round(int(line.split()[1]) / 1024)
    return parts


# The kinds: each returns (rows, facts) and may save its top values for a check


def read_only(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """Every row read and converted to float32 (the encoder's first step), nothing else."""
    rows = 0
    for batch in batches(store):
        batch.rows.float()
        rows += len(batch.rows)
    return rows, {}


def encode(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """Every row read and encoded into latents, which are thrown away: the plain read."""
    rows = 0
    for batch in batches(store):
        encoder(batch.rows)
        rows += len(batch.rows)
    return rows, {}


def ours(store: Any, encoder: Encoder, up_to: int, k: int = K) -> tuple[int, dict[str, Any]]:
    """``summarize_store`` with ``UnitActivations(k, window, above, of=encoder)``."""
    from lightning_iocatch.probes import UnitActivations
    from lightning_iocatch.reports.store_units import summarize_store

    probe = UnitActivations(k=k, window=WINDOW, above=ABOVE, of=encoder)
    summary = summarize_store(store, KEY, probe, rows_per_step=ROWS_PER_STEP)
    facts = {"mean_density": float(summary.density().mean())}
    return summary.rows, {**facts, "top": summary.top_values, "active": summary.active}


def density_only(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """Ours with ``k=0``: the density part alone (a diagnostic)."""
    return ours(store, encoder, up_to, k=0)


def topk(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """The latents of the first ``up_to`` rows held in one float32 tensor, then
    ``torch.topk(k, dim=0)`` over it and the active count per latent."""
    up_to = min(up_to, store.row_count(KEY))
    latents = torch.empty(up_to, LATENTS)
    rows = 0
    for batch in batches(store):
        take = min(len(batch.rows), up_to - rows)
        latents[rows : rows + take] = encoder(batch.rows[:take])
        rows += take
        if rows == up_to:
            break
    latents = latents[:rows]
    top = latents.topk(K, dim=0).values.T.double()  # (latents, k)
    top = torch.where(top > ABOVE, top, torch.nan)
    return rows, {"top": top, "active": (latents > 0).sum(0)}


def delphi(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """delphi's ``InMemoryCache`` (eai-delphi), fed as its ``LatentCache.run`` feeds it:
    per batch of sequences, ``cache.add(latents, tokens, ...)`` (every non-zero latent's
    (sequence, position, latent) as int64 and its value) and the firing counts, then
    ``cache.save()`` (one tensor of all). The model's forward is the stored rows here."""
    from delphi.latents.cache import InMemoryCache

    cache = InMemoryCache(batch_size=BATCH_SAMPLES)
    firing = torch.zeros(LATENTS, dtype=torch.int64)
    rows = 0
    for number, batch in enumerate(batches(store)):
        latents = encoder(batch.rows).view(-1, CONTEXT, LATENTS)
        cache.add(latents, batch.token_ids.view(-1, CONTEXT), number, "sae")
        firing += (latents > 0).sum((0, 1))
        rows += len(batch.rows)
    cache.save()

    def top() -> dict[str, torch.Tensor]:  # for the check, after the clock stops
        latent = cache.latent_locations["sae"][:, 2]
        value = cache.latent_activations["sae"]
        order = torch.argsort(value, descending=True, stable=True)
        order = order[torch.argsort(latent[order], stable=True)]
        counts = torch.bincount(latent, minlength=LATENTS)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order)) - starts.repeat_interleave(counts)
        kept = slot < K
        best = torch.full((LATENTS, K), torch.nan, dtype=torch.float64)
        best[latent[order][kept], slot[kept]] = value[order][kept].double()
        return {"top": torch.where(best > ABOVE, best, torch.nan), "active": firing}

    return rows, {"later": top, "nonzeros": len(cache.latent_activations["sae"])}


def profile(store: Any, encoder: Encoder, up_to: int) -> tuple[int, dict[str, Any]]:
    """Ours under cProfile: the functions with the most time of their own, and the time
    inside the top-k and density updates (cumulative)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    rows, facts = ours(store, encoder, up_to)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tottime for _, _, tottime, _, _ in stats.values())

    def name(where: tuple[str, int, str]) -> str:
        file, line, function = where
        return f"{Path(file).name}:{line}({function})" if line else function

    own = sorted(stats.items(), key=lambda item: -item[1][2])[:14]
    wanted = ("update_units", "above_cut", "candidates", "finish_top", "forward")
    inside = {
        f"{Path(w[0]).name}:{w[2]}": round(v[3], 2)
        for w, v in stats.items()
        if (w[2] in wanted and "probes" in w[0]) or (w[2] == "forward" and "units_peers" in w[0])
    }
    return rows, {
        **facts,
        "profiled_seconds": round(total, 2),
        "cumulative_seconds": inside,
        "own_seconds": [[name(w), round(v[2], 2), v[1]] for w, v in own],
    }


KINDS: dict[str, Callable[[Any, Encoder, int], tuple[int, dict[str, Any]]]] = {
    "profile": profile,
    "delphi": delphi,
    "read": read_only,
    "encode": encode,
    "ours": ours,
    "density_only": density_only,
    "topk": topk,
}


def child(kind: str, path: Path, up_to: int, save: Path | None) -> dict[str, Any]:
    """One measurement in this fresh process: peak RSS from after the imports, the
    encoder and opening the store (with its files in the page cache)."""
    from lightning_iocatch import FeatureStore

    encoder = Encoder()
    store = FeatureStore(path)
    warmed = warm(path)
    peak_memory.reset_peak()
    before = _rss()
    marks = Marks()
    marks.watch(store)
    start = marks.start = time.perf_counter()
    with torch.inference_mode():
        rows, facts = KINDS[kind](store, encoder, up_to)
    seconds = time.perf_counter() - start
    peak = peak_memory.peak()
    saved = {name: facts.pop(name) for name in ("top", "active") if name in facts}
    if "later" in facts:
        saved = facts.pop("later")()
    if save is not None and saved:
        torch.save(saved, save)
    return {
        "kind": kind,
        "rows": rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "peak_rss_mib": peak / 2**20,
        "peak_growth_mib": (peak - before) / 2**20,
        "rss_before_mib": before / 2**20,
        "warmed_bytes": warmed,
        "threads": torch.get_num_threads(),
        "marks": marks.marks,
        **facts,
    }


if __name__ == "__main__":
    kind, where, limit = sys.argv[1:4]
    out = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    print(json.dumps(child(kind, Path(where), int(limit), out)))
