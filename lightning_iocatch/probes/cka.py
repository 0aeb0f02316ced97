"""LayerCKA: linear CKA between every pair of captured tensors, from streamed statistics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_iocatch.probes.base import (
    _cat,
    _check_pool,
    _checked_tokens,
    _most_common_rows,
    _ProbeMetric,
    _rows,
    _samples,
    pool_features,
    usable,
)


class LayerCKA(_ProbeMetric):
    """Linear CKA between every pair of captured tensors, exact from streamed statistics.

    Features are pooled per sample (see :func:`pool_features`); for every pair of
    tensors, ``CKA(X, Y) = ||X_c^T Y_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F)`` with
    ``X_c`` the centred features, computed from the running sums of ``Z^T Z`` and ``Z``
    over the concatenated features ``Z = [X | Y | ...]``: memory is ``(sum of feature
    dims)^2`` float64 numbers. ``compute()`` returns ``cka/{a}~{b}``.

    The tensors paired are the keys present, with one pooled width, in every batch of
    every process that had batches (a batch of padding only does not count), in sorted
    order: a key missing from a batch, or whose width changes, is dropped from then on,
    never paired with another tensor. Each batch takes the usable tensors of the mapping
    (see :func:`usable`) without the rows flagged in ``repeated``. With ``tokens``, a bool
    ``(batch, seq)`` mask of real tokens, a tensor of at least three dimensions whose
    first two are the mask's is pooled over the real tokens only; a sample without a real
    token is left out of every tensor, as a ``repeated`` one is, so every pair has the
    same samples.

    Examples:
        >>> cka = LayerCKA()
        >>> x = torch.randn(50, 4)
        >>> cka.update({"a": x, "b": 3 * x @ torch.linalg.qr(torch.randn(4, 4))[0]})
        >>> round(float(cka.compute()["cka/a~b"]), 6)
        1.0
    """

    per_tensor: ClassVar[bool] = False
    gram: Tensor
    sums: Tensor
    count: Tensor
    pending: list[Tensor]

    def __init__(self, pool: str = "mean", fold_rows: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_pool(pool)
        self.pool = pool
        self.fold_rows = fold_rows
        self.layout: dict[str, int] = {}  # key -> pooled width, in sorted key order
        self.seen = False  # whether a batch (not only padding) was seen
        self.add_state("gram", torch.zeros(0, 0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sums", torch.zeros(0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        # rows not yet folded into the gram (fewer than fold_rows a process): one large
        # matrix product instead of one a batch; folded before a sync
        self.add_state("pending", [], dist_reduce_fx="cat")

    def update(
        self,
        features: Mapping[str, Tensor],
        batch: Any = None,
        indices: Sequence[int] | None = None,
        repeated: Sequence[bool] | None = None,
        tokens: Tensor | None = None,
    ) -> None:
        samples = _samples(indices, repeated)
        if samples is None:
            samples = _most_common_rows(features)
        real = _checked_tokens(tokens, samples)
        flagged = repeated is not None and len(repeated) == samples
        counted = [not r for r in repeated] if flagged and repeated is not None else None
        if real is not None:
            some = real.any(1).tolist()
            counted = [a and b for a, b in zip(counted or some, some, strict=True)]
        if counted is not None and not any(counted):
            return  # padding only, or no real token: not part of the data
        wanted = sorted(features) if not self.seen else list(self.layout)
        pooled: dict[str, Tensor] = {}
        for key in wanted:
            tensor = features.get(key)
            if not usable(tensor, samples):
                continue
            assert tensor is not None
            found = _rows(tensor, indices, repeated, real)
            assert found is not None
            values, applied = found
            pooled[key] = pool_features(values.to(torch.float64), self.pool, applied)
        widths = {key: rows.shape[1] for key, rows in pooled.items()}
        if not self.seen:
            self.seen = True
            self._restrict(widths)
        elif widths != self.layout:
            self._restrict({k: w for k, w in self.layout.items() if widths.get(k) == w})
        rows = [pooled[key] for key in self.layout]
        if not rows:
            return
        self.pending.append(torch.cat(rows, dim=1))
        if sum(part.shape[0] for part in self.pending) >= self.fold_rows:
            self.gram, self.sums, self.count = self._folded()
            self.pending = []

    def _restrict(self, layout: dict[str, int]) -> None:
        """Keep the statistics of the keys of ``layout`` (a sub-layout, or the first one)."""
        if not self.layout:
            width = sum(layout.values())
            self.gram = self.gram.new_zeros(width, width)
            self.sums = self.sums.new_zeros(width)
        else:
            self.gram, self.sums, self.count = self._folded()
            starts, start = {}, 0
            for key, width in self.layout.items():
                starts[key], start = start, start + width
            columns = [i for key in layout for i in range(starts[key], starts[key] + layout[key])]
            index = torch.tensor(columns, dtype=torch.long, device=self.gram.device)
            self.gram = self.gram[index][:, index]
            self.sums = self.sums[index]
        self.pending = []
        self.layout = dict(layout)

    def _folded(self) -> tuple[Tensor, Tensor, Tensor]:
        """The gram, sums and count with the pending rows folded in."""
        z = _cat(self.pending).to(torch.float64)
        if z.numel() == 0:
            return self.gram, self.sums, self.count
        return self.gram + z.T @ z, self.sums + z.sum(dim=0), self.count + z.shape[0]

    def _layout(self) -> dict[str, int] | None:
        return dict(self.layout) if self.seen else None

    def _align(self, layouts: list[Any]) -> None:
        seen = [layout for layout in layouts if layout is not None]
        if seen:
            common = {k: w for k, w in sorted(seen[0].items()) if all(s.get(k) == w for s in seen)}
            if not self.seen:
                self.seen, self.layout = True, {}
            self._restrict(common)
        width = self.gram.shape[0]
        self.pending = [self.gram.new_zeros(0, width)]

    def reset(self) -> None:
        super().reset()
        self.layout = {}
        self.seen = False

    def compute(self) -> dict[str, Tensor]:
        gram, sums, count = self._folded()
        if not count:
            return {}
        centred = gram - torch.outer(sums, sums) / count
        spans, start = {}, 0
        for key, width in self.layout.items():
            spans[key], start = slice(start, start + width), start + width
        norms = {key: centred[span, span].norm() for key, span in spans.items()}
        keys = list(spans)
        result = {}
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                cross = centred[spans[a], spans[b]].norm() ** 2
                result[f"cka/{a}~{b}"] = cross / (norms[a] * norms[b])
        return result
