"""lr_factor and sparsity_factor against values worked out by hand from SAELens 6's
schedule (``get_lr_scheduler``): ``LinearLR(1/W -> 1 over W - 1 steps)`` for the warmup,
``CosineAnnealingLR(T_max=main, eta_min=lr_end)`` or a constant, then
``LinearLR(lr_end/lr -> 0 over D steps)`` for the decay; the sparsity coefficient rising
linearly from 0 over its own warmup."""

from __future__ import annotations

import math

import pytest

from lightning_iocatch.lightning.sae.schedule import lr_factor, sparsity_factor


def test_warmup_cosine_and_decay() -> None:
    # warmup 4, decay 3, 15 steps: 8 cosine steps from 1 to lr_end / lr = 0.1
    factor = lr_factor(warmup=4, decay=3, total=15, schedule="cosine", end_ratio=0.1)
    by_hand = {
        0: 0.25,  # 1 / 4
        1: 0.5,  # 1/4 + 3/4 * 1/3
        2: 0.75,
        3: 1.0,  # the warmup ends at lr on its last step
        4: 1.0,  # cos(0)
        6: 0.1 + 0.9 * (1 + math.cos(math.pi * 2 / 8)) / 2,
        8: 0.55,  # cos(pi / 2): halfway between 1 and 0.1
        11: 0.1 + 0.9 * (1 + math.cos(math.pi * 7 / 8)) / 2,
        12: 0.1,  # the decay starts at lr_end
        13: 0.1 * 2 / 3,
        14: 0.1 / 3,
    }
    for step, value in by_hand.items():
        assert factor(step) == pytest.approx(value, rel=1e-12, abs=1e-15), step


def test_constant_with_decay_starts_the_decay_at_lr() -> None:
    # SAELens' constant scheduler ignores lr_end: its decay starts at lr (SAEModule passes 1.0)
    factor = lr_factor(warmup=0, decay=4, total=10, schedule="constant", end_ratio=1.0)
    expected = [1.0] * 6 + [1.0, 0.75, 0.5, 0.25]
    assert [factor(step) for step in range(10)] == pytest.approx(expected, rel=1e-12)


def test_constant_without_total_steps() -> None:
    factor = lr_factor(warmup=2, decay=0, total=None, schedule="constant", end_ratio=0.1)
    assert [factor(step) for step in (0, 1, 2, 1000)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    one = lr_factor(warmup=1, decay=0, total=None, schedule="constant", end_ratio=0.1)
    assert one(0) == 1.0  # LinearLR from 1/1: no warmup at all


def test_cosine_without_warmup_or_decay() -> None:
    factor = lr_factor(warmup=0, decay=0, total=10, schedule="cosine", end_ratio=0.0)
    for step in range(10):
        assert factor(step) == pytest.approx((1 + math.cos(math.pi * step / 10)) / 2, abs=1e-15)


@pytest.mark.parametrize(("schedule", "decay"), [("cosine", 0), ("constant", 5), ("cosine", 5)])
def test_a_cosine_or_a_decay_needs_the_number_of_steps(schedule, decay) -> None:
    with pytest.raises(ValueError, match=r"needs the number of steps: give `total_steps` "
                       r"\(or Trainer\(max_steps=...\)\)"):  # fmt: skip
        lr_factor(warmup=0, decay=decay, total=None, schedule=schedule, end_ratio=0.1)


def test_sparsity_factor_rises_linearly() -> None:
    assert [sparsity_factor(step, warmup=4) for step in range(6)] == [0, 0.25, 0.5, 0.75, 1, 1]
    assert sparsity_factor(0, warmup=0) == 1.0
