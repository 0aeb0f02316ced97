"""Token-level dumps against SAELens' cache runner; shuffled reading against ``datasets``.

    python benchmarks/tokens.py [--quick] [--markdown]

Needs SAELens beside lightning-iocatch, which the project's ``.venv`` does not have, so it
runs in an environment of its own (``.venv-bench``, with the CPU torch pinned as in the
Makefile's test environment)::

    make bench-tokens

Both sides get the same work, and nothing is downloaded: a ``HookedTransformer`` built from
a config with random weights (seeded: every process builds the same weights), the same
random token ids (pre-tokenized, no tokenizer), the same hook point, float32, the same
batches of sequences, the same shard size, and the data durable on disk when the clock
stops. The script checks that both dumps hold the same values and token ids.

- **Dump**, tokens per second:

  - ``iocatch``: ``trainer.predict`` with ``IOCaptureCallback(early_exit=True)`` and a
    ``FeatureWriter(tokens=TokenRows(...))`` storing one row per token (with its position
    and token id); it fsyncs every shard, its ledger and the directory;
  - ``saelens``: ``CacheActivationsRunner(cfg, override_dataset=tokens).run()`` (SAELens
    6: ``run_with_cache(stop_at_layer=2)``, one Arrow row per sequence with its
    ``token_ids``, shards consolidated into one directory, ``shuffle=False`` as
    lightning-iocatch does not shuffle either), then an fsync of every file it wrote and of
    the directory, inside the timing: SAELens does not fsync, and a write left in the
    page cache measures the cache, not the writer. The runner loads its model by name;
    that one call (``load_model``) is replaced to hand it the model object;
  - ``forward``: the forward pass up to the hook point alone (``model(tokens,
    stop_at_layer=2)`` under ``inference_mode``) over the same batches: the limit.

  A timing starts once the model and the tokens are in memory and a warm-up forward has
  run, and includes everything a user waits for after that: the Trainer or the runner,
  reading the token batches, the forwards, the copies, the writes and the fsyncs.

- **Read**, rows per second: the token rows of the dumps, every row once per epoch,
  shuffled, in batches of 4,096 rows, from a warm page cache, after opening and one
  warm-up epoch:

  - ``iocatch``: ``StoreRows(path, key, batch_size=..., shuffle=True)`` through a
    ``DataLoader(batch_size=None)`` in the main process: stored batches in a random
    order, rows shuffled within windows of 65,536 rows (its default ``shuffle_rows``),
    each batch gathered from its shards;
  - ``hf_iterable``: the same rows as an Arrow dataset of one row per token (written from
    SAELens' dump, in as many shards as the store has stored batches),
    ``load_from_disk(...).to_iterable_dataset(num_shards=...).shuffle(seed,
    buffer_size=8 * batch_size)``, ``.iter(batch_size)``: the same kind of shuffle (shard
    order, then rows mixed within a bounded number of rows), the counterpart doing the
    closest work;
  - ``hf_map``: the same dataset, ``ds.shuffle(seed, keep_in_memory=True).iter(batch_size)``
    each epoch: the full permutation most users reach for first (a stronger shuffle);
    ``keep_in_memory`` keeps the permutation out of ``datasets``' cache on disk, which
    would otherwise serve later rounds.

Every measurement runs in a fresh process (``benchmarks/token_work.py``). The processes of
one round start together, load their libraries and build their model at the same time,
then run their timed work one after the other, in an order reversed every other round, so
that the measurements of a round lie close together in time. A ratio (lightning-iocatch's
throughput over the other side's) is taken within a round; the figures are the median with
min and max over the rounds. Prints JSON, or a markdown table with ``--markdown``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from token_work import BYTES_PER_TOKEN, CONTEXT, HOOK, READ_BATCH, READY, WIDTH, disk_bytes

DUMPS = ("iocatch", "saelens", "forward")
READS = ("iocatch", "iocatch_1_thread", "hf_iterable", "hf_map")


# The parent: rounds of fresh processes


class Child:
    """A fresh process that prepares its work at once and runs it when told to."""

    def __init__(self, log: Path, *args: Any) -> None:
        env = {
            **os.environ,
            "TQDM_DISABLE": "1",
            "PYTHONWARNINGS": "ignore",
            "HF_HUB_OFFLINE": "1",  # nothing may be downloaded
            "HF_DATASETS_OFFLINE": "1",
        }
        work = str(Path(__file__).with_name("token_work.py"))
        self.command = [sys.executable, work, *map(str, args)]
        self.log = log
        with open(log, "w") as stderr:  # the child keeps its own descriptor
            self._process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )

    def _line(self, wanted: Callable[[str], bool]) -> str:
        assert self._process.stdout is not None
        while line := self._process.stdout.readline():
            if wanted(line.strip()):
                return line
        self._process.wait()
        raise SystemExit(f"{' '.join(self.command)} failed:\n{self.log.read_text()[-4000:]}")

    def ready(self) -> None:
        self._line(lambda line: line == READY)

    def run(self) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write("go\n")
        self._process.stdin.flush()
        result = json.loads(self._line(lambda line: line.startswith("{")))
        self._process.communicate()
        return result


def rounds(
    logs: Path, names: tuple[str, ...], repeats: int, args: Callable[[str], tuple[Any, ...]]
) -> dict[str, list[dict[str, Any]]]:
    """One fresh process per name and round, prepared together, run in an order reversed
    every other round (each process's stderr in ``logs``)."""
    logs.mkdir(exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(repeats):
        children = {name: Child(logs / f"{name}-{round_}.log", *args(name)) for name in names}
        for child in children.values():
            child.ready()
        for name in names if round_ % 2 else reversed(names):
            results[name].append(children[name].run())
    return results


def ratios(ours: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, float]:
    """Round by round, lightning-iocatch's throughput over the other side's (same work)."""
    from common import spread  # here, not at the top: the child processes need neither

    return spread([o["seconds"] / m["seconds"] for m, o in zip(ours, other, strict=True)])


def per_second(results: list[dict[str, Any]], unit: str) -> dict[str, int]:
    rates = [r[unit] / r["seconds"] for r in results]
    return {
        "median": round(statistics.median(rates)),
        "min": round(min(rates)),
        "max": round(max(rates)),
    }


def benchmark(root: Path, quick: bool) -> dict[str, Any]:
    seqs, batch, shard_seqs = (64, 32, 32) if quick else (512, 32, 128)
    repeats, epochs = (1, 1) if quick else (6, 4)
    blocks = seqs // batch  # stored batches of lightning-iocatch's dump
    logs = root / "logs"

    def dump(name: str) -> tuple[Any, ...]:
        return ("dump", name, fresh(root / name), seqs, batch, shard_seqs)

    def check(name: str) -> tuple[Any, ...]:
        return (name, root / "iocatch", root / "saelens", fresh(root / "hf_tokens"), blocks)

    def read(name: str) -> tuple[Any, ...]:
        path = root / ("iocatch" if name.startswith("iocatch") else "hf_tokens")
        return ("read", name, path, epochs, blocks)

    dumps = rounds(logs, DUMPS, repeats, dump)
    checked = rounds(logs, ("check",), 1, check)["check"][0]
    reads = rounds(logs, READS, repeats, read)
    return {
        "sizes": {
            "sequences": seqs,
            "context": CONTEXT,
            "tokens": seqs * CONTEXT,
            "width": WIDTH,
            "dtype": "float32",
            "batch_sequences": batch,
            "shard_sequences": shard_seqs,
            "hook": HOOK,
            "rounds": repeats,
        },
        "rows_written": {name: dumps[name][-1]["rows"] for name in ("iocatch", "saelens")},
        "check": checked,
        "dump": {
            "tokens_per_s": {name: per_second(dumps[name], "tokens") for name in DUMPS},
            "seconds": {name: [round(r["seconds"], 3) for r in dumps[name]] for name in DUMPS},
            "vs_saelens": ratios(dumps["iocatch"], dumps["saelens"]),
            "vs_forward": ratios(dumps["iocatch"], dumps["forward"]),
            # the most lightning-iocatch / SAELens can be: the forward alone over SAELens
            "forward_vs_saelens": ratios(dumps["forward"], dumps["saelens"]),
            "bytes_on_disk": {
                "iocatch": disk_bytes(root / "iocatch"),
                "saelens": disk_bytes(root / "saelens"),
                "activations": seqs * CONTEXT * BYTES_PER_TOKEN,
            },
        },
        "read": {
            "batch_rows": READ_BATCH,
            "epochs": epochs,
            "rows": seqs * CONTEXT,
            "rows_per_s": {name: per_second(reads[name], "rows") for name in READS},
            "seconds": {name: [round(r["seconds"], 3) for r in reads[name]] for name in READS},
            "vs_hf_iterable": ratios(reads["iocatch"], reads["hf_iterable"]),
            "vs_hf_map": ratios(reads["iocatch"], reads["hf_map"]),
            "1_thread_vs_hf_iterable": ratios(reads["iocatch_1_thread"], reads["hf_iterable"]),
        },
    }


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "sae-lens", "transformer-lens", "datasets", "lightning"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    return found


def rate(r: dict[str, int], unit: str) -> str:
    return f"{r['median']:,} {unit} ({r['min']:,} to {r['max']:,})"


def table(results: dict[str, Any]) -> str:
    import report  # the verdict wording of the other benchmarks

    dump, read, sizes = results["dump"], results["read"], results["sizes"]
    disk, tps, rps = dump["bytes_on_disk"], dump["tokens_per_s"], read["rows_per_s"]
    rows = [
        ("dump, lightning-iocatch (a row per token)", rate(tps["iocatch"], "tokens/s"), ""),
        ("dump, SAELens `CacheActivationsRunner` + fsync", rate(tps["saelens"], "tokens/s"), ""),
        ("forward up to the hook point alone (the limit)", rate(tps["forward"], "tokens/s"), ""),
        (
            "dump throughput, lightning-iocatch / SAELens",
            report.spread(dump["vs_saelens"]),
            report.verdict([dump["vs_saelens"]], at_least=1.2),
        ),
        (
            "dump throughput, lightning-iocatch / forward alone",
            report.spread(dump["vs_forward"]),
            report.verdict([dump["vs_forward"]], at_least=0.9),
        ),
        (
            "the ceiling of lightning-iocatch / SAELens: forward alone / SAELens",
            report.spread(dump["forward_vs_saelens"]),
            "",
        ),
        (
            "bytes on disk, lightning-iocatch / SAELens (activations alone)",
            f"{disk['iocatch']:,} / {disk['saelens']:,} ({disk['activations']:,})",
            "",
        ),
        ("shuffled read, `StoreRows`", rate(rps["iocatch"], "rows/s"), ""),
        (
            "shuffled read, `StoreRows`, torch set to 1 thread (diagnostic)",
            rate(rps["iocatch_1_thread"], "rows/s"),
            "",
        ),
        (
            "shuffled read, `datasets` iterable: shard order + buffer",
            rate(rps["hf_iterable"], "rows/s"),
            "",
        ),
        (
            "shuffled read, `datasets` `ds.shuffle()`: full permutation",
            rate(rps["hf_map"], "rows/s"),
            "",
        ),
        (
            "read throughput, `StoreRows` / `datasets` iterable (the same shuffle)",
            report.spread(read["vs_hf_iterable"]),
            report.verdict([read["vs_hf_iterable"]], at_least=1.0),
        ),
        (
            "read throughput, `StoreRows` / `datasets` `ds.shuffle()`",
            report.spread(read["vs_hf_map"]),
            report.verdict([read["vs_hf_map"]], at_least=1.0),
        ),
        (
            "diagnostic: `StoreRows` with 1 torch thread / `datasets` iterable",
            report.spread(read["1_thread_vs_hf_iterable"]),
            "",
        ),
    ]
    lines = ["| measurement | median (min to max) | target |", "|---|---|---|"]
    lines += [f"| {name} | {result} | {target} |" for name, result, target in rows]
    check, load = results["check"], results["load_average_at_start"]
    same = check["max_abs_diff"] == 0.0 and check["same_token_ids"]
    lines.append(
        f"\n{sizes['sequences']} sequences of {sizes['context']} tokens, "
        f"`{sizes['hook']}` (width {sizes['width']}, float32) of a 4-block "
        f"`HookedTransformer` with random weights, batches of {sizes['batch_sequences']} "
        f"sequences, shards of {sizes['shard_sequences']}; reads of {read['epochs']} epochs "
        f"of {read['rows']:,} rows in batches of {read['batch_rows']:,}. {sizes['rounds']} "
        "rounds of fresh processes each, order alternating, ratios taken within a round; a "
        "target is met only when the whole spread is on its side. Both dumps hold "
        + ("the same values and token ids. " if same else f"DIFFERENT data: {check}. ")
        + ", ".join(f"{name} {v}" for name, v in results["versions"].items())
        + f", {results['threads']} CPU threads; load average {load:.2f} at the start."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (smoke test)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    import torch

    root = Path(tempfile.mkdtemp(prefix="iocatch-tokens-"))
    # other work on the machine shows in the spread: say how busy it was when this began
    load = os.getloadavg()[0]
    try:
        results = {
            "versions": versions(),
            "threads": torch.get_num_threads(),
            **benchmark(root, args.quick),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["load_average_at_start"] = load
    print(table(results) if args.markdown else json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
