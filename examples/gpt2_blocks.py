"""Capture the block outputs of an offline GPT-2 and print their names and shapes.

    python examples/gpt2_blocks.py

The model is built from a config with random weights: nothing is downloaded.
"""

from __future__ import annotations

import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch import ModelIOCatcher


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=6, n_embd=128, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 32))
    catcher = ModelIOCatcher(model, "cpu")

    with torch.no_grad(), catcher.from_spec("outputs[transformer.h.*]", early_exit=False) as buf:
        model(ids)
    print("spec: outputs[transformer.h.*]")
    for name, kinds in buf.items():
        print(f"  {name:<16} {tuple(kinds['outputs'][0].shape)}")

    start = time.perf_counter()
    with torch.no_grad(), catcher.from_spec("outputs[transformer.h.1]", early_exit=True) as buf:
        result = catcher.run(ids)
    elapsed = time.perf_counter() - start
    hidden = buf["transformer.h.1"]["outputs"][0]
    print(
        f"early exit after transformer.h.1: run() returned {result}, "
        f"captured {tuple(hidden.shape)} in {elapsed * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
