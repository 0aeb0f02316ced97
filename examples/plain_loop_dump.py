"""Dump activations from a plain PyTorch loop: no Trainer, no Lightning.

    python examples/plain_loop_dump.py [OUT_DIR] [--resume]

``ModelIOCatcher`` captures the output of one block of a small GPT-2-style model (random
weights, nothing downloaded) with early exit, and the store's Trainer-free writing core
(``prepare_store`` + ``ShardWriter``) writes it: the same crash-safe, exactly-once store
that ``FeatureWriter`` writes inside ``trainer.predict``, read back with ``FeatureStore``.
Under another launcher (Fabric, Accelerate, torchrun), make the plan on rank 0, hand it
to every rank (it pickles), and pass each rank's ``rank``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2Model

from lightning_iocatch import FeatureStore, ModelIOCatcher
from lightning_iocatch.store import ShardWriter, prepare_store

SPEC = "outputs[h.1]"


def model() -> GPT2Model:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2Model(config).eval()


def tokens(samples: int) -> torch.Tensor:
    return torch.randint(0, 256, (samples, 32), generator=torch.Generator().manual_seed(1))


def dump(out: Path, samples: int = 96, batch_size: int = 16, resume: bool = False) -> int:
    """Dump block 1's output for every sample; return the rows written by this run."""
    net = model()
    ids = tokens(samples)
    loader = DataLoader(TensorDataset(torch.arange(samples), ids), batch_size=batch_size)
    settings = {"spec": SPEC, "stage": "predict", "dtype": None, "world_size": 1}
    plan = prepare_store(out, "resume" if resume else "create", settings)
    writer = ShardWriter(out, rank=0, plan=plan, max_shard_bytes=1 << 20)
    catcher = ModelIOCatcher(net, "cpu")
    session = catcher.from_spec(SPEC, early_exit=True)
    try:
        with torch.no_grad(), session:
            for index, batch in loader:
                if writer.has(0, index.tolist()):
                    continue  # every sample committed by an earlier run: skip the forward
                catcher.run(batch)  # stops right after block 1
                captured = session.take()["h.1"]["outputs"][0]
                writer.write({"h.1/outputs": captured}, indices=index.tolist())
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.rows_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp()) / "features"
    rows = dump(out, resume=args.resume)
    store = FeatureStore(out)
    print(f"wrote {rows} rows; the store holds {len(store)} samples of {store.keys()}")
    print(f"{SPEC}: {tuple(store['h.1/outputs'].shape)} in {out}")


if __name__ == "__main__":
    main()
