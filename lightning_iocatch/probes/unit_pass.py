"""One pass over a batch's values for both unit statistics: the density and the top
examples from the same active entries.

A unit's active entries (its values above ``threshold``) are found once
(:func:`~lightning_iocatch.probes.unit_density.above_cut`, a chunk of rows at a time);
the density counts them and, when every value that may fill a slot is active (``above``
at or above ``threshold``, as by default), the top examples take their candidates from
them instead of from a scan of every value. Otherwise each statistic looks at the values
itself. The results are those of :func:`~lightning_iocatch.probes.top_examples.update_top`
and :func:`~lightning_iocatch.probes.unit_density.update_density`, exactly.

Examples:
    >>> import torch
    >>> from lightning_iocatch.probes.top_examples import Rows, empty_top
    >>> from lightning_iocatch.probes.unit_density import empty_density
    >>> rows = Rows(torch.tensor([[0.0, 2.0], [3.0, 1.0]]), torch.tensor([4, 5]), torch.tensor([-1, -1]))
    >>> top, density = update_units(empty_top(2, k=1, width=0), empty_density(2, bins=3), rows,
    ...                             above=0.0, threshold=0.0, log10_range=(-1.0, 2.0))
    >>> top.indices.tolist(), density.active.tolist(), density.histogram.tolist()
    ([[5], [4]], [1, 2], [[0, 1, 0], [0, 2, 0]])
"""  # noqa: E501

from __future__ import annotations

from lightning_iocatch.probes.top_examples import (
    Rows,
    Top,
    begin_top,
    candidates,
    finish_top,
    join_entries,
    update_top,
)
from lightning_iocatch.probes.unit_density import (
    Density,
    above_cut,
    chunks,
    count_active,
    lowest_above,
    update_density,
)

__all__ = ["update_units"]


def update_units(
    top: Top,
    density: Density,
    rows: Rows,
    *,
    above: float | None,
    threshold: float,
    log10_range: tuple[float, float],
) -> tuple[Top, Density]:
    """``top`` (updated in place) and ``density`` with the rows of one batch taken in."""
    values = rows.values
    if top.values.shape[1] == 0 or values.shape[0] == 0:
        return top, update_density(density, values, threshold, log10_range)
    if above is None or above < threshold:  # a slot may take a value that is not active
        top = update_top(top, rows, above)
        return top, update_density(density, values, threshold, log10_range)
    cut = float(lowest_above(threshold, values.dtype))  # exact in the values' dtype
    batch = begin_top(top, rows, above)
    parts = []
    for start, chunk in chunks(values):
        row, unit, value = above_cut(chunk, cut)
        density = count_active(density, unit, value, log10_range)
        parts.append(candidates(batch, chunk, start, row, unit, value))
    density = density._replace(rows=density.rows + values.shape[0])
    return finish_top(top, values, batch, *join_entries(parts)), density
