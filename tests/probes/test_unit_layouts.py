"""UnitActivations on layouts a real pipeline hands it: a mask sliced from a longer one
(not contiguous) and batches with no values, each against the same rows given plainly."""

from __future__ import annotations

import torch

from lightning_iocatch.probes import UnitActivations


def summary_of(hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, list]:
    probe = UnitActivations(k=2, window=1)
    batch = {"input_ids": torch.arange(mask.numel()).reshape(mask.shape) + 100,
             "attention_mask": mask.contiguous().long()}  # fmt: skip
    probe.update(hidden, batch=batch, indices=list(range(len(hidden))), tokens=mask)
    found = probe.compute()
    return {name: getattr(found, name).tolist()
            for name in ("top_values", "top_index", "top_position", "active")}  # fmt: skip


def test_a_mask_sliced_from_a_longer_one_counts_as_its_contiguous_copy() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 4, generator=generator).relu()
    longer = torch.tensor([[1, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]).bool()
    sliced = longer[:, :5]  # attention_mask[:, :seq]: not contiguous
    assert not sliced.is_contiguous()
    assert summary_of(hidden, sliced) == summary_of(hidden, sliced.contiguous())


def test_batches_without_values_count_nothing() -> None:
    for shape in ((0, 4, 3), (2, 0, 3)):
        probe = UnitActivations(k=2, window=1)
        mask = torch.ones(shape[:2], dtype=torch.bool)
        probe.update(torch.zeros(shape), indices=list(range(shape[0])), tokens=mask)
        probe.update(torch.ones(1, 2, 3), indices=[7], tokens=torch.ones(1, 2).bool())
        found = probe.compute()
        assert found.rows == 2 and found.active.tolist() == [2, 2, 2]
