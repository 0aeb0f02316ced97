"""What the compact-store study shares: a small byte-level GPT-2 trained on real text, the
text, and a dump of one block's output as token rows in a chosen storage variant.

The text is the Python standard library of the running interpreter (its ``.py`` files,
``sysconfig.get_paths()["stdlib"]``, ``site-packages`` left out, in sorted order): every
tenth file is held out for evaluation, the others are the training and dumping text. The
model (byte vocabulary, 256 tokens) is trained once per :class:`Setup` and seed, and its
weights cached in ``.cache/compact-study/`` (ignored by git): a rerun loads them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import FeatureWriter, IOCaptureCallback, TokenRows

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "compact-study"
DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
CODECS: tuple[str | None, ...] = (None, "zstd")


@dataclass(frozen=True)
class Setup:
    """The model, its training and the text sizes of one run of the study."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 128
    train_steps: int = 300
    train_batch: int = 16
    lr: float = 3e-3
    block: int = 2  # the dumped block: its output is the residual stream after it
    dump_sequences: int = 1024
    eval_sequences: int = 64
    text_bytes: int = 8 << 20  # of training text read (the held-out text: a quarter)
    seed: int = 0

    @property
    def module(self) -> str:
        return f"model.transformer.h.{self.block}"

    @property
    def key(self) -> str:
        return f"{self.module}/outputs"

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


FULL = Setup()
QUICK = Setup(layers=2, width=32, heads=2, context=32, train_steps=30, train_batch=8, block=0,
              dump_sequences=48, eval_sequences=8, text_bytes=1 << 20)  # fmt: skip


def quiet() -> None:
    """Silence Lightning's notes on workers and the like (the output is the tables)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*LeafSpec.*", ".*IterableDataset.*",
                    ".*GPU available but not used.*"):  # fmt: skip
        warnings.filterwarnings("ignore", message)


@functools.lru_cache(maxsize=4)
def texts(setup: Setup) -> tuple[bytes, bytes]:
    """The training text and the held-out text (other files), as bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts),
        key=lambda f: f.relative_to(stdlib).as_posix(),
    )
    train, held_out = bytearray(), bytearray()
    for number, file in enumerate(files):
        target = held_out if number % 10 == 9 else train
        limit = setup.text_bytes // 4 if target is held_out else setup.text_bytes
        if len(target) < limit:
            target += file.read_bytes()[: limit - len(target)]
    return bytes(train), bytes(held_out)


def sequences(text: bytes, count: int, context: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``context`` bytes at random offsets, int64 ``[count, context]``."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context, (count,), generator=generator)
    return torch.stack([data[s : s + context] for s in starts.tolist()])


def loader(ids: torch.Tensor, batch_size: int) -> DataLoader:
    """Batches ``{"input_ids", "attention_mask"}`` in order, as a tokenizer's collator."""
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    return DataLoader(rows, batch_size=batch_size)


class ByteLM(pl.LightningModule):
    """A GPT-2 over bytes as ``self.model``; ``self(input_ids, attention_mask)``."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        config = GPT2Config(n_layer=setup.layers, n_embd=setup.width, n_head=setup.heads,
                            vocab_size=256, n_positions=setup.context, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return self(**batch).logits

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(**batch)


def held_out_loss(lm: ByteLM, ids: torch.Tensor) -> float:
    """Mean next-byte cross entropy (nats) over ``ids``."""
    with torch.no_grad():
        return float(lm.model(input_ids=ids, labels=ids).loss)


def trained_lm(setup: Setup, cache: Path = CACHE) -> tuple[ByteLM, dict[str, Any]]:
    """The model trained on the training text (AdamW, cosine decay), loaded from the cache
    when it holds this setup's weights; with what the training measured."""
    path = cache / f"byte-gpt2-{setup.digest()}.pt"
    torch.manual_seed(setup.seed)
    lm = ByteLM(setup)
    train, held_out = texts(setup)
    eval_ids = sequences(held_out, setup.eval_sequences, setup.context, seed=setup.seed + 1)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        lm.model.load_state_dict(saved["weights"])
        return lm.eval(), saved["facts"]
    start = time.perf_counter()
    ids = sequences(train, setup.train_steps * setup.train_batch, setup.context, setup.seed)
    before = held_out_loss(lm.eval(), eval_ids)
    lm.train()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=setup.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, setup.train_steps)
    for step, batch in enumerate(ids.split(setup.train_batch)):
        loss = lm.model(input_ids=batch, labels=batch).loss
        if step % 50 == 0:
            print(f"training the byte-level GPT-2: step {step}, loss {loss.item():.3f}", flush=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    lm.eval()
    facts = {
        "held_out_loss_before": round(before, 4),
        "held_out_loss_after": round(held_out_loss(lm, eval_ids), 4),
        "train_seconds": round(time.perf_counter() - start, 1),
        "setup": asdict(setup),
    }
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": lm.model.state_dict(), "facts": facts}, path)
    return lm, facts


def dump_ids(setup: Setup) -> torch.Tensor:
    """The training-text sequences that are dumped (not those the model trained on)."""
    train, _ = texts(setup)
    return sequences(train, setup.dump_sequences, setup.context, seed=setup.seed + 2)


def eval_ids(setup: Setup) -> torch.Tensor:
    """Held-out sequences: the SAEs' evaluation text."""
    _, held_out = texts(setup)
    return sequences(held_out, setup.eval_sequences, setup.context, seed=setup.seed + 1)


def writer(path: Path, dtype: str, codec: str | None) -> FeatureWriter | str:
    """A writer of token rows in ``dtype`` (and ``codec``), or why this library refuses it."""
    options: dict[str, Any] = {"dtype": dtype, "mode": "overwrite", "tokens": TokenRows()}
    if codec is not None:
        options["codec"] = codec
    try:
        return FeatureWriter(path, **options)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def variant_name(dtype: str, codec: str | None) -> str:
    return dtype if codec is None else f"{dtype}+{codec}"


def accepted_variants(
    work: Path, dtypes: tuple[str, ...], codecs: tuple[str | None, ...]
) -> tuple[dict[str, FeatureWriter], dict[str, str]]:
    """A writer into ``work/{variant}`` for every dtype and codec this library accepts, and
    why it refuses the others (each refusal printed)."""
    writers: dict[str, FeatureWriter] = {}
    refused: dict[str, str] = {}
    for dtype in dtypes:
        for codec in codecs:
            name = variant_name(dtype, codec)
            made = writer(work / name, dtype, codec)
            if isinstance(made, str):
                refused[name] = made
                print(f"skipped {name}: the writer refuses it ({made})")
            else:
                writers[name] = made
    return writers, refused


def dump(lm: ByteLM, setup: Setup, ids: torch.Tensor, out: FeatureWriter) -> float:
    """Dump the block's output of ``ids`` with ``out``; the predict run's seconds."""
    capture = IOCaptureCallback(f"outputs[{setup.module}]", early_exit=True, writer=out)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[capture])  # fmt: skip
    data = loader(ids, batch_size=32)
    start = time.perf_counter()
    trainer.predict(lm, data, return_predictions=False)
    return time.perf_counter() - start


def store_bytes(path: Path) -> int:
    """Bytes of every file of the store (shards, ledger, metadata)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def block_outputs(lm: ByteLM, setup: Setup, ids: torch.Tensor) -> torch.Tensor:
    """The block's output for every token of ``ids`` in float32, ``[tokens, width]``, from
    Hugging Face's ``output_hidden_states`` (not from this library's capture)."""
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
    return hidden[setup.block + 1].reshape(-1, setup.width).float()


def records_scale(path: Path) -> bool:
    """Whether the store holds keys in 8-bit floats and each of them with a scale per row
    (its records' ``scaled``, which FeatureStore's metadata gives as ``"scaled": "row"``),
    as opposed to a plain cast to fp8."""
    from lightning_iocatch import FeatureStore

    keys = FeatureStore(path).metadata["keys"]
    eight_bit = [info for info in keys.values() if info["dtype"].startswith("float8")]
    return bool(eight_bit) and all(info.get("scaled") == "row" for info in eight_bit)


def synthetic_rows(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Float32 rows like a residual stream's: each unit Gaussian with its own spread
    (0.5 to 1.5), and 4 outlier units 40 times wider, offset by 20."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    x *= 0.5 + torch.rand(width, generator=generator)
    outliers = torch.randperm(width, generator=generator)[:4]
    x[:, outliers] = x[:, outliers] * 40 + 20
    return x


def write_rows(
    path: Path, key: str, x: torch.Tensor, dtype: str, codec: str | None, batch: int = 4096
) -> float:
    """Seconds for ``ShardWriter`` (durable) to write ``x`` as ``key`` in ``dtype`` and
    ``codec``, ``batch`` rows a batch, over any store at ``path``."""
    from lightning_iocatch.store.plan import prepare_store
    from lightning_iocatch.store.writer import ShardWriter

    settings = {"spec": None, "stage": "predict", "dtype": dtype}
    start = time.perf_counter()
    out = ShardWriter(path, rank=0, plan=prepare_store(path, "overwrite", settings),
                      dtype=dtype, codec=codec)  # fmt: skip
    for first in range(0, len(x), batch):
        out.write({key: x[first : first + batch]}, range(first, min(first + batch, len(x))))
    out.close()
    return time.perf_counter() - start
