"""The work of one process of ``benchmarks/tokens.py``: build the model, prepare one dump
or one read untimed, say ``ready``, run it when told ``go``, print its result as JSON.

    python benchmarks/token_work.py dump|read|check ARGS...
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOOK = "blocks.1.hook_resid_post"
STOP_AT_LAYER = 2  # blocks 0 and 1 run: the hook point is the output of block 1
KEY = f"model.{HOOK}/outputs"
SPEC = f"outputs[model.{HOOK}]"
CONTEXT = 128
WIDTH = 256
VOCAB = 1000
BYTES_PER_TOKEN = WIDTH * 4  # float32 activations
READ_BATCH = 4096
READY = "ready"
Timed = Callable[[], dict[str, Any]]


# What the child processes share


def hooked_transformer() -> Any:
    """The model of every process: random weights from a fixed seed, no tokenizer."""
    import torch
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    config = HookedTransformerConfig(
        n_layers=4,
        d_model=WIDTH,
        n_ctx=CONTEXT,
        d_head=32,
        n_heads=8,
        d_mlp=4 * WIDTH,
        d_vocab=VOCAB,
        act_fn="gelu",
        tokenizer_name=None,
        seed=0,
        device="cpu",
        dtype=torch.float32,
    )
    return HookedTransformer(config).eval()


def token_ids(seqs: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (seqs, CONTEXT), generator=torch.Generator().manual_seed(1))


def every_token(batch: Any) -> Any:
    """The token mask of the benchmark: every token is a row, as the runner stores them all."""
    import torch

    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


def disk_bytes(path: Path) -> int:
    """Bytes of every file below ``path`` (their sizes)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    """Make every file below ``path``, and every directory entry, durable."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# The dumps: each prepares its work untimed and returns it, to be timed


def prepare_dump(kind: str, out: Path, seqs: int, batch: int, shard_seqs: int) -> Timed:
    import torch

    model = hooked_transformer()
    tokens = token_ids(seqs)
    with torch.inference_mode():  # the same warm-up forward on every side
        model(tokens[:batch], stop_at_layer=STOP_AT_LAYER)
    side = {"iocatch": _iocatch, "saelens": _saelens, "forward": _forward}[kind]
    work = side(model, tokens, out, batch, shard_seqs * CONTEXT * BYTES_PER_TOKEN)

    def timed() -> dict[str, Any]:
        start = time.perf_counter()
        facts = work()
        return {"seconds": time.perf_counter() - start, "tokens": tokens.numel(), **facts}

    return timed


def _forward(model: Any, tokens: Any, out: Path, batch: int, shard_bytes: int) -> Timed:
    import torch

    def work() -> dict[str, Any]:
        with torch.inference_mode():
            for chunk in tokens.split(batch):
                model(chunk, stop_at_layer=STOP_AT_LAYER)
        return {}

    return work


def _iocatch(model: Any, tokens: Any, out: Path, batch: int, shard_bytes: int) -> Timed:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows

    class Sequences(Dataset):
        def __len__(self) -> int:
            return len(tokens)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"input_ids": tokens[index]}

    class HookedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return self.model(batch["input_ids"])

    module, loader = HookedLM(), DataLoader(Sequences(), batch_size=batch)

    def work() -> dict[str, Any]:
        writer = FeatureWriter(out, max_shard_bytes=shard_bytes, tokens=TokenRows(mask=every_token))
        capture = IOCaptureCallback(SPEC, early_exit=True, writer=writer)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[capture],
        )
        trainer.predict(module, loader, return_predictions=False)
        return {"rows": writer.rows_written}

    return work


def _saelens(model: Any, tokens: Any, out: Path, batch: int, shard_bytes: int) -> Timed:
    import datasets
    import sae_lens.cache_activations_runner as runner_module
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    # The runner builds its model from a name; hand it the model object instead.
    runner_module.load_model = lambda **_: model  # type: ignore[assignment]
    dataset = datasets.Dataset.from_dict({"input_ids": tokens.numpy()})
    seqs = len(tokens)

    def work() -> dict[str, Any]:
        config = CacheActivationsRunnerConfig(
            dataset_path="pretokenized-random-ids",  # unused: override_dataset is given
            model_name="random-hooked-transformer",  # unused: load_model is replaced
            model_batch_size=batch,
            hook_name=HOOK,
            d_in=WIDTH,
            training_tokens=seqs * CONTEXT,
            context_size=CONTEXT,
            new_cached_activations_path=str(out),
            shuffle=False,
            dtype="float32",
            device="cpu",
            # a buffer is a shard: lightning-iocatch's shard size (half a token spare, so
            # that float rounding cannot drop a batch)
            buffer_size_gb=(shard_bytes + BYTES_PER_TOKEN // 2) / 1e9,
            prepend_bos=False,
        )
        if config.n_buffers * config.n_seq_in_buffer != seqs:
            raise SystemExit(f"SAELens would not cache exactly {seqs} sequences: {config}")
        written = CacheActivationsRunner(config, override_dataset=dataset).run()
        fsync_tree(out)
        return {"rows": len(written) * CONTEXT}

    return work


# The readers


def prepare_read(kind: str, path: Path, epochs: int, blocks: int) -> Timed:
    """Open, read one epoch to warm up, and return the timing of ``epochs`` more."""
    import torch  # before the clock on every side: ``datasets`` imports it late

    if kind.startswith("iocatch"):
        from torch.utils.data import DataLoader

        from lightning_iocatch import StoreRows

        if kind == "iocatch_1_thread":  # a diagnostic: torch's own threads off
            torch.set_num_threads(1)
        data = StoreRows(path, KEY, batch_size=READ_BATCH, shuffle=True)
        loader = DataLoader(data, batch_size=None)

        def epoch(number: int) -> int:
            data.set_epoch(number)
            return sum(item[KEY].shape[0] for item in loader)

    elif kind == "hf_iterable":
        import datasets

        stream = datasets.load_from_disk(str(path)).to_iterable_dataset(num_shards=blocks)
        stream = stream.shuffle(seed=0, buffer_size=8 * READ_BATCH).with_format("torch")

        def epoch(number: int) -> int:
            stream.set_epoch(number)
            return sum(item["acts"].shape[0] for item in stream.iter(batch_size=READ_BATCH))

    else:
        import datasets

        dataset = datasets.load_from_disk(str(path)).with_format("torch")

        def epoch(number: int) -> int:
            shuffled = dataset.shuffle(seed=number, keep_in_memory=True)
            return sum(item["acts"].shape[0] for item in shuffled.iter(batch_size=READ_BATCH))

    epoch(0)

    def timed() -> dict[str, Any]:
        start = time.perf_counter()
        rows = sum(epoch(number) for number in range(1, epochs + 1))
        return {"seconds": time.perf_counter() - start, "rows": rows}

    return timed


def compare_and_convert(ours: Path, theirs: Path, hf_dir: Path, blocks: int) -> dict[str, Any]:
    """Check that both dumps hold the same values and token ids; save the token rows of
    SAELens' dump as an Arrow dataset of one row per token, for ``datasets`` to read."""
    import datasets
    import numpy as np

    from lightning_iocatch import FeatureStore

    saelens = datasets.load_from_disk(str(theirs)).with_format("numpy")[:]
    acts, ids = saelens[HOOK], saelens["token_ids"]  # (seqs, context, width), (seqs, context)
    stored = FeatureStore(ours)[KEY].numpy()
    diff = (
        float(np.abs(stored.reshape(acts.shape) - acts).max()) if stored.size == acts.size else None
    )
    features = datasets.Features({"acts": datasets.List(datasets.Value("float32"), length=WIDTH)})
    rows = datasets.Dataset.from_dict({"acts": acts.reshape(-1, WIDTH)}, features=features)
    rows.save_to_disk(str(hf_dir), num_shards=blocks)
    return {
        "max_abs_diff": diff,
        "stored_shape": list(stored.shape),
        "saelens_shape": list(acts.shape),
        "same_token_ids": bool((ids == token_ids(len(ids)).numpy()).all()),
    }


def run_child(role: str, args: list[str]) -> None:
    """Prepare, say ``ready``, wait for ``go`` on stdin, run the timed work, print JSON."""
    if role == "dump":
        kind, out, seqs, batch, shard_seqs = args
        timed = prepare_dump(kind, Path(out), int(seqs), int(batch), int(shard_seqs))
    elif role == "read":
        kind, path, epochs, blocks = args
        timed = prepare_read(kind, Path(path), int(epochs), int(blocks))
    else:
        ours, theirs, hf_dir, blocks = args

        def timed() -> dict[str, Any]:
            return compare_and_convert(Path(ours), Path(theirs), Path(hf_dir), int(blocks))

    print(READY, flush=True)
    if sys.stdin.readline().strip() == "go":  # not at end of input: the parent gave up
        print(json.dumps(timed()), flush=True)


if __name__ == "__main__":
    run_child(sys.argv[1], [str(arg) for arg in sys.argv[2:]])
