"""One epoch of live activations (``data`` below: a
:class:`~lightning_iocatch.lightning.live.LiveActivations`): the model's inputs in fills
of the mixing buffer, each fill's forwards run with capture, its rows drawn in batches.

Every process reads its own share of the inputs (Lightning's ``UnrepeatedDistributedSampler``:
no sample twice, the last shares uneven). Before each fill's batches the processes agree on
how many there are: as many as the largest fill needs, each process splitting its own rows
into that many near-equal batches (empty ones where a process has run out of inputs), so
that every process takes the same number of steps and every row is used once.

A resumed epoch starts after the batches Lightning has done in it
(``fit_loop.epoch_loop.batch_progress``): the fills before the resume point are only
counted (their rows from the inputs' token masks, no forward), the fill holding it runs its
forwards again and draws its rows in the same order, and the batches done are skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from lightning_iocatch.capture.catcher import ModelIOCatcher
from lightning_iocatch.capture.keys import flatten_captures
from lightning_iocatch.lightning.live.mixing import fill_order, split_rows

__all__ = ["captured_rows", "epoch_batches"]


def epoch_batches(data: Any, epoch: int, done: int) -> Iterator[dict[str, Tensor]]:
    """The batches of ``epoch`` after the first ``done`` (see the module docstring)."""
    inputs = data.inputs_of_this_process()
    fills = _fills(iter(inputs.batches), data.buffer_rows, data.count_rows)
    fill = 0
    while True:
        chunk = next(fills, None)
        rows = 0 if chunk is None else sum(count for _, _, count in chunk)
        most, more = data.agree(rows, chunk is not None)
        if not more:
            return
        batches = -(-most // data.batch_size)
        if done >= batches:  # trained on before the resume point: counted, not run
            done -= batches
            fill += 1
            continue
        found = _forwards(data, chunk or [], rows)
        chunk = None  # the inputs, no longer needed
        order = fill_order(rows, seed=data.seed, epoch=epoch, rank=data.rank, fill=fill)
        parts = split_rows(found, order, batches) if found else [{} for _ in range(batches)]
        del found  # the batches hold their own copies: one fill in memory, not two
        parts = parts[done:][::-1]
        while parts:  # each batch let go once handed out, before the next fill's forwards
            part = parts.pop()
            yield part or data.empty_batch()
        done = 0
        fill += 1


def _fills(
    batches: Iterator[tuple[list[int], Any]], capacity: int, count: Any
) -> Iterator[list[tuple[list[int], Any, int]]]:
    """Consecutive input batches ``(indices, batch, rows)`` until they hold ``capacity`` rows."""
    chunk: list[tuple[list[int], Any, int]] = []
    held = 0
    for indices, batch in batches:
        rows = count(batch)
        chunk.append((indices, batch, rows))
        held += rows
        if held >= capacity:
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


def _forwards(data: Any, chunk: list[tuple[list[int], Any, int]], rows: int) -> dict[str, Tensor]:
    """The rows of a fill's input batches: each batch's forward with capture, stacked."""
    parts: list[dict[str, Tensor]] = []
    for indices, batch, counted in chunk:
        found = captured_rows(data, batch, indices)
        got = len(found["index"])
        if got != counted:
            raise RuntimeError(
                f"LiveActivations: a batch gave {got} rows where its token mask counts "
                f"{counted}: the captured values are not one row per "
                + ("selected token" if data.tokens is not None else "sample")
            )
        parts.append(found)
    if not parts:
        return {}
    stacked = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    if len(stacked["index"]) != rows:
        raise RuntimeError(
            f"LiveActivations: a fill counted {rows} rows and holds {len(stacked['index'])}"
        )
    return stacked


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for a fill's forward, its modules' modes given back after: a
    model the trained module holds too (``SAEModule(language_model=...)``) is put in train
    mode by Lightning's fit, which would turn its dropout on in the rows."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)


def captured_rows(data: Any, batch: Any, indices: list[int]) -> dict[str, Tensor]:
    """One input batch's rows by key (the batch as the loader gives it, moved here), with
    each row's dataset ``index`` (and its ``position`` for token rows)."""
    # the tokens are chosen on the loader's (host) batch: no device sync per batch on a GPU
    selection = None if data.tokens is None else data.tokens.select(batch)
    batch = data.convert_input(move_data_to_device(batch, data.device))
    catcher = ModelIOCatcher(data.model, data.device)
    session = catcher.from_spec(data.spec, early_exit=True, transform=selection)
    with torch.inference_mode(), data.forward_context(), _evaluating(data.model), session as buffer:
        catcher.call(data.run_model, batch)
    captured = flatten_captures(buffer)
    index = torch.as_tensor(indices, dtype=torch.int64, device=data.device)
    if selection is None:
        rows = {key: value for key, value in captured.items() if value.shape[:1] == index.shape}
        found = {key: value.clone() for key, value in rows.items()}  # out of inference mode
        return {**found, "index": index}
    changed = buffer.transformed_keys()
    found = {key: captured[key].clone() for key in captured if key in changed}
    sample = selection.sample.to(data.device)
    position = torch.as_tensor(selection.position).to(data.device)
    return {**found, "index": index[sample], "position": position}
