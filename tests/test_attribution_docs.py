"""The claims of docs/attribution.md's "One head, exactly", against hand-written hooks."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import cross_entropy
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_iocatch.capture.attribution import exact_patching

HEADS, WIDTH = 2, 8  # GPT-2 of width 16 with 2 heads: each head 8 wide


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=16, n_head=HEADS, vocab_size=50, n_positions=16)
    return GPT2LMHeadModel(config).eval()


def loss(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1].transpose(1, 2)
    return cross_entropy(logits, ids[:, 1:], reduction="none").sum(1)


@pytest.mark.parametrize(("head", "at"), [(0, 3), (1, 5), (1, 6)])
def test_a_mask_of_the_value_shape_patches_one_head_at_one_position(
    gpt2: GPT2LMHeadModel, head: int, at: int
) -> None:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    corrupted = ids.clone()
    corrupted[:, 3] = (ids[:, 3] + 1) % 50
    o_proj = gpt2.transformer.h[1].attn.c_proj
    columns = slice(head * WIDTH, (head + 1) * WIDTH)
    seen: list[torch.Tensor] = []
    handle = o_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        with torch.no_grad():
            loss(gpt2, ids)
    finally:
        handle.remove()

    def patch(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        value = args[0].clone()
        value[:, at, columns] = seen[0][:, at, columns]
        return (value, *args[1:])

    handle = o_proj.register_forward_pre_hook(patch)
    try:
        with torch.no_grad():
            by_hand = loss(gpt2, corrupted)
    finally:
        handle.remove()
    with torch.no_grad():
        by_hand = by_hand - loss(gpt2, corrupted)

    mask = torch.zeros(2, 8, 16, dtype=torch.bool)
    mask[:, at, columns] = True
    key = "transformer.h.1.attn.c_proj/inputs"
    exact = exact_patching(gpt2, key, lambda x: loss(gpt2, x), ids, corrupted, positions=mask)
    torch.testing.assert_close(exact, by_hand)
    assert by_hand.abs().max() > 0  # the patch changed something (from position 3 on)
