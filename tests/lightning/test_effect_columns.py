"""effect_columns: every forward's loss and each variant's KL from one log-softmax per
forward and chunk, against a hand-written computation (cross-entropy and KL one sample and
256 positions at a time, as the effects were computed before the log-softmax was shared),
bit for bit, and against NumPy in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_iocatch.lightning.effect_terms import (
    effect_columns,
    kl_per_sample,
    next_token_loss,
)

CHUNK = 256


def loss_by_hand(logits: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(len(ids), dtype=torch.float64)
    for row in range(len(ids)):
        for start in range(0, ids.shape[1] - 1, CHUNK):
            end = min(start + CHUNK, ids.shape[1] - 1)
            terms = torch.nn.functional.cross_entropy(
                logits[row, start:end].double(), ids[row, start + 1 : end + 1],
                reduction="none", ignore_index=-100,
            )  # fmt: skip
            sums[row] += terms[keep[row, start:end]].sum()
    return sums


def kl_by_hand(p_logits: torch.Tensor, q_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(len(p_logits), dtype=torch.float64)
    for row in range(len(p_logits)):
        for start in range(0, p_logits.shape[1], CHUNK):
            p = torch.log_softmax(p_logits[row, start : start + CHUNK].double(), -1)
            q = torch.log_softmax(q_logits[row, start : start + CHUNK].double(), -1)
            kl = torch.where(torch.isneginf(p), 0.0, p.exp() * (p - q)).sum(-1)
            sums[row] += kl[keep[row, start : start + CHUNK]].sum()
    return sums


def numpy_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, keep: torch.Tensor) -> np.ndarray:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    p = log_softmax(p_logits.double().numpy())
    q = log_softmax(q_logits.double().numpy())
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(p), 0.0, np.exp(p) * (p - q)).sum(-1)
    return (terms * keep.numpy()).sum(1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.dtype == torch.float64 else t


@pytest.mark.parametrize("case", ["ids", "mask", "labels", "ruled_out", "bf16"])
def test_columns_equal_the_hand_computation_bit_for_bit(case: str):
    g = torch.Generator().manual_seed(3)
    rows, positions, vocab = 3, 2 * CHUNK + 1, 7  # three chunks, the last of one position
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    clean, *variants = [(3 * torch.randn(rows, positions, vocab, generator=g)).to(dtype)
                        for _ in range(3)]  # fmt: skip
    ids = torch.randint(0, vocab, (rows, positions), generator=g)
    mask = (torch.rand(rows, positions, generator=g) > 0.2).long()
    batch: dict[str, torch.Tensor] = {"input_ids": ids}
    targets, keep = ids, torch.ones(rows, positions - 1, dtype=torch.bool)
    if case in ("mask", "ruled_out"):
        batch["attention_mask"] = mask
        keep = mask[:, 1:].bool() & mask[:, :-1].bool()
    if case == "labels":
        labels = ids.masked_fill(mask == 0, -100)
        batch |= {"labels": labels, "attention_mask": mask}
        targets, keep = labels, labels[:, 1:] != -100
    if case == "ruled_out":
        clean[..., :2] = float("-inf")  # classes the clean logits rule out: 0 log 0 = 0
    with torch.inference_mode():
        columns = effect_columns(clean, variants, batch, next_token_loss)
    kl_keep = mask.bool() if "attention_mask" in batch else torch.ones(rows, positions, dtype=bool)
    kl_count = kl_keep.sum(1).double()
    expected = [loss_by_hand(clean, targets, keep), keep.sum(1).double()]
    for variant in variants:
        expected += [loss_by_hand(variant, targets, keep), keep.sum(1).double()]
        expected += [kl_by_hand(clean, variant, kl_keep), kl_count]
    assert len(columns) == len(expected) == 2 + 4 * len(variants)
    for k, (found, truth) in enumerate(zip(columns, expected, strict=True)):
        assert found.dtype == torch.float64, k
        assert torch.equal(bits(found), bits(truth)), k
    for k, variant in enumerate(variants):  # NumPy float64: the KL itself
        kl = numpy_kl(clean, variant, kl_keep)
        np.testing.assert_allclose(columns[4 + 4 * k].numpy(), kl, rtol=1e-9, atol=1e-9)
        alone = kl_per_sample(clean, variant, batch)
        assert torch.equal(bits(alone[0]), bits(columns[4 + 4 * k])), k


def test_another_loss_is_called_per_forward_and_the_kl_shares_the_clean_softmax():
    g = torch.Generator().manual_seed(4)
    clean, variant = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    seen: list[torch.Tensor] = []

    def loss(logits: torch.Tensor, batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits)
        return logits.sum(1), torch.full((len(logits),), 2)

    columns = effect_columns(clean, [variant], (clean, y), loss)
    assert [t is s for t, s in zip(seen, [clean, variant], strict=True)] == [True, True]
    expected = [clean.sum(1).double(), torch.full((4,), 2.0, dtype=torch.float64)]
    expected += [variant.sum(1).double(), expected[1]]
    expected += [kl_by_hand(clean[:, None], variant[:, None], torch.ones(4, 1, dtype=bool))]
    expected += [torch.ones(4, dtype=torch.float64)]
    for k, (found, truth) in enumerate(zip(columns, expected, strict=True)):
        assert torch.equal(bits(found), bits(truth)), k
    # (x, y) with the default loss: the cross-entropy of y, one term per sample
    columns = effect_columns(clean, [variant], (clean, y), next_token_loss)
    ce = torch.nn.functional.cross_entropy(clean.double(), y, reduction="none")
    assert torch.equal(bits(columns[0]), bits(ce))


def test_shapes_the_default_loss_cannot_read_are_refused_as_before():
    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="one position per token"):
        effect_columns(torch.zeros(2, 12, 5), [torch.zeros(2, 12, 5)], {"input_ids": ids},
                       next_token_loss)  # fmt: skip
    with pytest.raises(ValueError, match="KL is taken at the mask's positions"):
        effect_columns(torch.zeros(2, 12, 5), [torch.zeros(2, 12, 5)], {"attention_mask": ids},
                       lambda logits, batch: logits.sum((1, 2)))  # fmt: skip
