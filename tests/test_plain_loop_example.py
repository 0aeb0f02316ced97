"""examples/plain_loop_dump.py: the store's writing core from a plain PyTorch loop."""

from __future__ import annotations

from pathlib import Path

import torch

from examples.plain_loop_dump import dump, model, tokens
from lightning_iocatch import FeatureStore


def test_a_plain_loop_dump_resumes_and_equals_a_hand_written_hook(tmp_path: Path) -> None:
    out = tmp_path / "features"
    assert dump(out, samples=40, batch_size=8) == 40  # a first run over part of the data
    assert dump(out, samples=64, batch_size=12, resume=True) == 24  # only what is missing
    net, ids, seen = model(), tokens(64), []
    net.h[1].register_forward_hook(lambda module, args, output: seen.append(output.clone()))
    with torch.no_grad():
        for start in range(0, 64, 8):
            net(ids[start : start + 8])
    store = FeatureStore(out)
    assert store.indices.tolist() == list(range(64))
    assert torch.allclose(store["h.1/outputs"], torch.cat(seen), atol=1e-6)
