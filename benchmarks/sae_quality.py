"""SAEModule against SAELens' trainer as users run each: quality over seeds, and speed.

    .venv-bench/bin/python benchmarks/sae_quality.py [--quick] [--seeds 3] [--epochs 2]

The activations: the residual stream after block 2 of the compact-store study's byte-level
GPT-2 (4 blocks, width 128, trained 300 steps on the Python standard library's text;
benchmarks/compact_common.py, cached in .cache/compact-study/), 1,024 sequences of 128
bytes dumped once as float32 token rows (131,072 rows). Held out: 64 sequences of other
files (8,192 rows), from Hugging Face's ``output_hidden_states``.

For each architecture both tools have (TopK k=32, BatchTopK k=32, JumpReLU, ReLU+L1;
1,024 latents, batches of 1,024 rows, lr 1e-3, a latent dead after 32 steps without
firing, L1 coefficient 2 and L0 coefficient 0.05 warmed up over a tenth of the run;
SAELens' defaults otherwise) and each
seed, each tool trains from its own initial weights (``seed``) on its own shuffled order
of the rows for ``epochs`` passes: SAELens through ``SAETrainer.step`` on batches drawn
from the rows in memory (a permutation per epoch, its most favourable case: no reading),
ours through ``Trainer.fit`` with ``StoreDataModule`` reading the store (``shuffle_rows`` all
the rows: the same randomness as a permutation). Then, on the
held-out rows, each SAE as its tool exports it (SAELens' ``save_inference_model`` and
``SAE.load_from_disk``: a BatchTopK becomes a JumpReLU at its learned threshold; ours in
eval mode, the same): MSE (per row, summed over inputs), explained variance, L0 and the fraction
of latents that never fire. Printed per architecture: each figure's mean and range over
the seeds for both tools, the control (our module on SAELens' own batches and initial
weights of seed 0, by default and with ``saelens_arithmetic=True``: the same figures,
which leaves the data order as the tools' only difference; and SAELens with every encoder
weight moved by one float32 step, how far rounding differences carry), SAELens fed our
order of each seed (from its own initial weights of that seed, which are ours: the largest
difference of each figure from ours, float rounding's where the tools differ only in the
order), and the training throughput (rows per CPU-second of the process, rows per second)
with its ratio per seed (interleaved: the tools alternate). Ours runs with its default
arithmetic (the same step as SAELens' with fewer operations, equal to float rounding).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from compact_common import FULL, QUICK, Setup, block_outputs, dump, eval_ids, quiet, trained_lm
from compact_common import dump_ids as dumped_ids
from compact_common import writer as store_writer
from torch.utils.data import DataLoader

from lightning_iocatch import StoreDataModule
from lightning_iocatch.lightning.sae import SAEModule
from lightning_iocatch.sae import SparseAutoencoder
from lightning_iocatch.store.training import StoreRows

HERE = Path(__file__).resolve().parent
LATENTS, K, BATCH, LR = 1024, 32, 1024, 1e-3  # --quick: 256 latents, k 8, batches of 128
SPARSITY = {"jumprelu": 0.05, "relu": 2.0}  # l0 and l1 coefficients, warmed up over 1/10
WINDOW = 32  # steps without firing after which a latent is dead (SAELens' 1,000 > a run)
ARCHITECTURES = ("topk", "batchtopk", "jumprelu", "relu")


def rows_store(setup: Setup, work: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The dumped store, its rows in memory (for SAELens), and the held-out rows."""
    lm, _ = trained_lm(setup)
    path = work / f"sae-quality-{setup.digest()}"
    if not (path / "store.json").exists():
        made = store_writer(path, "float32", None)
        assert not isinstance(made, str), made
        dump(lm, setup, dumped_ids(setup), made)
    from lightning_iocatch import FeatureStore

    rows = FeatureStore(path)[setup.key].float()
    return path, rows, block_outputs(lm, setup, eval_ids(setup))


def saelens_sae(architecture: str, seed: int, warmup: int, width: int, sparse: bool = False) -> Any:
    """SAELens' training SAE (``sparse``: TopK's ``use_sparse_activations``)."""
    from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig
    from sae_lens.saes.jumprelu_sae import JumpReLUTrainingSAE, JumpReLUTrainingSAEConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.topk_sae import TopKTrainingSAE, TopKTrainingSAEConfig

    torch.manual_seed(seed)
    common = {"d_in": width, "d_sae": LATENTS}
    if architecture == "topk":
        return TopKTrainingSAE(TopKTrainingSAEConfig(k=K, use_sparse_activations=sparse,
                                                     **common))  # fmt: skip
    if architecture == "batchtopk":
        return BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(k=K, **common))
    if architecture == "jumprelu":
        return JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(
            l0_coefficient=SPARSITY["jumprelu"], l0_warm_up_steps=warmup, **common))  # fmt: skip
    return StandardTrainingSAE(StandardTrainingSAEConfig(
        l1_coefficient=SPARSITY["relu"], l1_warm_up_steps=warmup, **common))  # fmt: skip


def train_saelens(
    architecture: str, seed: int, rows: torch.Tensor, epochs: int, nudged: bool = False
) -> Any:
    """SAELens trained on its permutation of ``rows`` (``nudged``: every encoder weight
    moved by one float32 step before training, differences of a rounding's size)."""
    batches = permuted_batches(rows, seed, epochs)
    sae, trainer = saelens_trainer(architecture, seed, batches)
    if nudged:
        with torch.no_grad():
            sae.W_enc.copy_(torch.nextafter(sae.W_enc, torch.full_like(sae.W_enc, torch.inf)))
    step_all(trainer, batches)
    return _as_users_load(sae)


def permuted_batches(rows: torch.Tensor, seed: int, epochs: int) -> list[torch.Tensor]:
    """SAELens' batches: a permutation of the rows in memory per epoch, whole batches."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(rows.shape[0], generator=generator)
        batches += [rows[order[i : i + BATCH]] for i in range(0, rows.shape[0] - BATCH + 1, BATCH)]
    return batches


def saelens_trainer(
    architecture: str, seed: int, batches: list[torch.Tensor], sparse: bool = False
) -> tuple[Any, Any]:
    """SAELens' training SAE and its ``SAETrainer`` over ``batches`` (not stepped yet)."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    steps = len(batches)
    sae = saelens_sae(architecture, seed, warmup=steps // 10, width=batches[0].shape[1],
                      sparse=sparse)  # fmt: skip
    config = SAETrainerConfig(total_training_samples=steps * BATCH, lr=LR, lr_end=LR / 10,
                              train_batch_size_samples=BATCH,
                              dead_feature_window=WINDOW)  # fmt: skip
    return sae, SAETrainer(config, sae, data_provider=iter(batches))


def step_all(trainer: Any, batches: list[torch.Tensor]) -> None:
    """``batches`` through a :func:`saelens_trainer`'s ``SAETrainer.step``, counting the
    steps as SAELens' own loop does."""
    for batch in batches:
        trainer.step(batch)
        trainer.n_training_steps += 1


def _as_users_load(sae: Any) -> Any:
    """The SAE SAELens' own export saves and its loader gives back (a BatchTopK becomes a
    JumpReLU at its learned threshold), as a user evaluates it."""
    import tempfile

    from sae_lens import SAE

    with tempfile.TemporaryDirectory() as folder:
        sae.save_inference_model(folder)
        return SAE.load_from_disk(folder).eval()


def train_ours(
    architecture: str, seed: int, path: Path, key: str, epochs: int, shape: tuple[int, int]
) -> SparseAutoencoder:
    # every row shuffled with every other, as SAELens' permutation of the rows in memory
    data = StoreDataModule(path, key, batch_size=BATCH, seed=seed, drop_last=True,
                           shuffle_rows=shape[0])  # fmt: skip
    module = our_module(architecture, seed, shape[1], epochs * (shape[0] // BATCH), key=key)
    fit_trainer(epochs).fit(module, datamodule=data)
    return module.sae.eval()


def our_module(
    architecture: str,
    seed: int,
    width: int,
    steps: int,
    key: str | None = None,
    saelens_arithmetic: bool = False,
) -> SAEModule:
    """Our module with the settings SAELens' side gets (``steps``: the run's length)."""
    k = K if "topk" in architecture else None
    return SAEModule(
        width, LATENTS, architecture, k, key=key, lr=LR, seed=seed,  # type: ignore[arg-type]
        sparsity_coefficient=SPARSITY.get(architecture, 1.0), sparsity_warmup_steps=steps // 10,
        dead_after_tokens=WINDOW * BATCH, saelens_arithmetic=saelens_arithmetic,
    )  # fmt: skip


def fit_trainer(
    epochs: int, callbacks: list[pl.Callback] | None = None, max_steps: int = -1
) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_epochs=epochs, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)  # fmt: skip


def held_out(encode: Any, decode: Any, x: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        latents = encode(x)
        error = (decode(latents) - x).double().pow(2).sum(-1)
    spread = (x.double() - x.double().mean(0)).pow(2).sum(-1)
    return {
        "mse": float(error.mean()),
        "explained_variance": float(1 - error.mean() / spread.mean()),
        "l0": float((latents != 0).double().sum(-1).mean()),
        "dead_fraction": float(((latents != 0).sum(0) == 0).double().mean()),
    }


def timed(run: Any) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = run()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def same_batches(
    architecture: str, rows: torch.Tensor, evaluation: torch.Tensor, epochs: int
) -> dict[str, dict[str, float]]:
    """The control: our module fed SAELens' own batches of seed 0 (its permutation), from
    SAELens' initial weights' seed: what is left of a gap between the tools is then theirs.
    Ours by default (float rounding apart from SAELens' products) and with
    ``saelens_arithmetic=True`` (SAELens' products)."""
    batches = permuted_batches(rows, 0, epochs)
    found = {}
    for name, exact in (("ours", False), ("ours_saelens_arithmetic", True)):
        module = our_module(architecture, 0, rows.shape[1], len(batches), saelens_arithmetic=exact)
        fit_trainer(1).fit(module, DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
        ours = module.sae.eval()
        found[name] = held_out(ours.encode, ours.decode, evaluation)
    for name, nudged in (("saelens", False), ("saelens_one_step_apart", True)):
        theirs = train_saelens(architecture, 0, rows, epochs, nudged)
        found[name] = held_out(theirs.encode, theirs.decode, evaluation)
    return found


def our_order(path: Path, key: str, seed: int, rows: int, epochs: int) -> list[dict]:
    """The batches our run of ``seed`` reads (``StoreRows`` as ``train_ours``'s data module
    reads it, epoch by epoch), with each row's dataset index."""
    data = StoreRows(path, key, batch_size=BATCH, seed=seed, drop_last=True,
                     shuffle_rows=rows, with_indices=True)  # fmt: skip
    batches = []
    for epoch in range(epochs):
        data.set_epoch(epoch)
        batches += list(data)
    return batches


def saelens_on_our_order(
    architecture: str, seed: int, path: Path, key: str, rows: torch.Tensor, epochs: int
) -> Any:
    """SAELens' trainer (initial weights of ``seed``) fed the batches our run of ``seed``
    reads."""
    batches = [batch[key] for batch in our_order(path, key, seed, rows.shape[0], epochs)]
    sae, trainer = saelens_trainer(architecture, seed, batches)
    step_all(trainer, batches)
    return _as_users_load(sae)


def order_statistics(path: Any, key: str, rows: torch.Tensor, seed: int) -> dict[str, list]:
    """How alike our reader's order of ``seed`` and SAELens' permutation are, over two
    epochs, ``[ours, permutation]`` per figure: the distinct sequences in a batch, the
    sequences two consecutive batches share, the batches of the first epoch a batch of the
    second draws rows from, and the batches of an epoch a sequence spreads over. Our rows'
    sequences are their dataset indices, the permutation's its row numbers // the rows a
    sequence has (the dump's sequences in order, all of one length); our rows are told
    apart across epochs by their values (rows of identical values, as the first tokens of
    sequences starting alike, as one)."""
    count = rows.shape[0]
    number = {bytes(row.numpy()): i for i, row in enumerate(rows)}
    batches = our_order(path, key, seed, count, 2)
    ours = (
        [batch["index"] for batch in batches],
        [torch.tensor([number[bytes(row.numpy())] for row in batch[key]]) for batch in batches],
    )
    generator = torch.Generator().manual_seed(seed)  # as quality.permuted_batches draws
    order = torch.cat([torch.randperm(count, generator=generator) for _ in range(2)])
    theirs_rows = list(order.split(BATCH))
    tokens = count // len(set(torch.cat(ours[0][: len(batches) // 2]).tolist()))
    theirs = ([batch // tokens for batch in theirs_rows], theirs_rows)
    found: dict[str, list] = {}
    for sequence_of, row_of in (ours, theirs):
        half = len(row_of) // 2
        sequences = [set(batch.tolist()) for batch in sequence_of[:half]]
        first = torch.empty(count, dtype=torch.long)
        for place, batch in enumerate(row_of[:half]):
            first[batch] = place
        spread = [len(set(first[batch].tolist())) for batch in row_of[half:]]
        for name, value in (
            ("distinct_sequences_a_batch", statistics.fmean(map(len, sequences))),
            ("sequences_shared_by_consecutive_batches",
             statistics.fmean(len(a & b) for a, b in itertools.pairwise(sequences))),
            ("first_epoch_batches_a_second_epoch_batch_draws_from", statistics.fmean(spread)),
            ("batches_a_sequence_spreads_over",
             sum(map(len, sequences)) / (count // tokens)),
        ):  # fmt: skip
            found.setdefault(name, []).append(round(value, 1))
    return found


def _shown(figure: dict[str, float]) -> str:
    return f"{figure['mean']:.4g} [{figure['min']:.4g}, {figure['max']:.4g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--only", default=",".join(ARCHITECTURES))
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(1)
    setup = QUICK if args.quick else FULL
    if args.quick:
        global LATENTS, K, BATCH
        LATENTS, K, BATCH = 256, 8, 128
    path, rows, evaluation = rows_store(setup, HERE / ".stores")
    import sae_lens

    report: dict[str, Any] = {
        "sae_lens": sae_lens.__version__, "torch": torch.__version__,
        "rows": rows.shape[0], "held_out_rows": evaluation.shape[0],
        "order_statistics": order_statistics(path, setup.key, rows, 0),
    }  # fmt: skip
    print(f"ours / SAELens' permutation, seed 0: {report['order_statistics']}", flush=True)
    for architecture in args.only.split(","):
        found: dict[str, dict[str, list[float]]] = {
            "saelens": {},
            "ours": {},
            "saelens_our_order": {},
        }
        for seed in range(args.seeds):
            runs = {
                "saelens": functools.partial(train_saelens, architecture, seed, rows, args.epochs),
                "ours": functools.partial(
                    train_ours, architecture, seed, path, setup.key, args.epochs, tuple(rows.shape)
                ),
            }
            for tool in runs if seed % 2 else list(runs)[::-1]:
                sae, cpu, wall = timed(runs[tool])
                figures = held_out(sae.encode, sae.decode, evaluation)
                trained = args.epochs * (rows.shape[0] // BATCH) * BATCH
                figures |= {"rows_per_cpu_s": trained / cpu, "rows_per_s": trained / wall}
                for name, value in figures.items():
                    found[tool].setdefault(name, []).append(value)
            # the tools apart from the order: SAELens fed the rows in our order of this seed
            swapped = saelens_on_our_order(architecture, seed, path, setup.key, rows, args.epochs)
            figures = held_out(swapped.encode, swapped.decode, evaluation)
            for name, value in figures.items():
                found["saelens_our_order"].setdefault(name, []).append(value)
        pairs = zip(
            found["ours"]["rows_per_cpu_s"], found["saelens"]["rows_per_cpu_s"], strict=True
        )
        ratios = [ours / theirs for ours, theirs in pairs]
        control = same_batches(architecture, rows, evaluation, args.epochs)
        report[architecture] = {tool: {name: spread(values) for name, values in figures.items()}
                                for tool, figures in found.items()}  # fmt: skip
        report[architecture]["throughput_ratio_cpu"] = spread(ratios)
        report[architecture]["same_batches_seed_0"] = control
        line = [f"{architecture:9}"]
        for name in ("mse", "explained_variance", "l0", "dead_fraction"):
            ours = report[architecture]["ours"][name]
            theirs = report[architecture]["saelens"][name]
            line.append(f"{name} {_shown(ours)} vs {_shown(theirs)}")
        line.append(f"rows/CPU-s ours/SAELens {statistics.median(ratios):.2f}x "
                    f"[{min(ratios):.2f}, {max(ratios):.2f}]")  # fmt: skip
        print(" | ".join(line), flush=True)
        print(f"{architecture:9} | seed 0 on SAELens' own batches: ours {control['ours']}, "
              f"ours with SAELens' arithmetic {control['ours_saelens_arithmetic']}, "
              f"SAELens {control['saelens']}, SAELens with its encoder one float32 step "
              f"apart {control['saelens_one_step_apart']}", flush=True)  # fmt: skip
        apart = {
            name: max(abs(a - b) for a, b in zip(found["ours"][name],
                                                 found["saelens_our_order"][name], strict=True))
            for name in ("mse", "explained_variance", "l0", "dead_fraction")
        }  # fmt: skip
        report[architecture]["ours_vs_saelens_on_our_order_max_abs"] = apart
        print(f"{architecture:9} | SAELens on our orders: mse "
              f"{_shown(report[architecture]['saelens_our_order']['mse'])}; ours minus it, "
              f"largest over seeds: {apart}", flush=True)  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
