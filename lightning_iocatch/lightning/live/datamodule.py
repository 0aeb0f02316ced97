"""LiveActivations: a frozen model's activations as training batches, without a dump.

Examples:
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> inputs = DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=4)
    >>> live = LiveActivations(net, "outputs[1]", inputs, batch_size=3, buffer_rows=8)
    >>> batches = list(live.train_dataloader())  # outside a Trainer: one process, epoch 0
    >>> [len(batch["index"]) for batch in batches], sorted(batches[0])
    ([3, 3, 2, 2], ['1/outputs', 'index'])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from lightning_iocatch.capture.spec import parse_io_spec
from lightning_iocatch.lightning.epoch_loader import _Deferred
from lightning_iocatch.lightning.live.stream import captured_rows, epoch_batches
from lightning_iocatch.store.tokens import TokenRows

__all__ = ["LiveActivations"]


class LiveActivations(pl.LightningDataModule):
    """Batches of a frozen model's activations, captured as its forwards run, for any
    LightningModule that reads ``batch[key]`` (an :class:`~lightning_iocatch.SAEModule`, a
    probe): the rows a dump of the same inputs would hold, never written anywhere.

    Each epoch the model runs over ``inputs`` once (under ``inference_mode``, in the
    Trainer's precision, on its device, stopping after the last module the spec names);
    the rows go into a mixing buffer of ``buffer_rows`` rows, drawn at random in batches of
    about ``batch_size`` rows, each row once (see :mod:`~lightning_iocatch.lightning.live.mixing`
    and :mod:`~lightning_iocatch.lightning.live.stream`). Under DDP each process runs its own
    copy of the model over its share of the inputs, and a resumed epoch (``Trainer.fit(
    ckpt_path=...)``, mid-epoch) uses the rows it has not used yet, derived again from the
    inputs and the seed: the same processes, batch size, buffer and seed are needed.

    Args:
        model: the frozen model (an ``nn.Module`` or a LightningModule), called as
            ``model(**batch)`` for a mapping, ``model(batch[0])`` for a tuple,
            ``model(batch)`` otherwise. It is put in eval mode, on the Trainer's device, and
            in a ``"*-true"`` precision's dtype (Lightning's conversion, as for a dump).
        spec: what to capture, in the capture grammar (``"outputs[model.layers.6]"``); each
            captured value's flat key is a key of the batches, as in a store.
        inputs: a DataLoader of the model's inputs. Its dataset, batch size, collate function
            and worker settings are used; its sampler is replaced by one that reads the
            dataset in order, each process its share.
        batch_size: rows per batch (per process).
        buffer_rows: rows the mixing buffer holds before they are drawn.
        tokens: one row per selected token (:class:`~lightning_iocatch.TokenRows`' rules);
            by default one row per sample.
        seed: the seed of the draws.
        validation: a DataLoader given to the Trainer as this data module's validation
            loader, unchanged (e.g. tokenized held-out text for
            ``SAEModule(language_model=...)``); ``fit`` takes no validation loader beside a
            data module.

    Batches hold each key's rows, ``"index"`` (each row's dataset index) and, for token
    rows, ``"position"``.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: str,
        inputs: DataLoader,
        *,
        batch_size: int,
        buffer_rows: int = 65536,
        tokens: TokenRows | None = None,
        seed: int = 0,
        validation: DataLoader | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}")
        if not isinstance(inputs, DataLoader):
            raise TypeError(
                f"`inputs` must be a DataLoader of the model's inputs, got {type(inputs).__name__}"
            )
        if isinstance(inputs.dataset, IterableDataset):
            raise TypeError(
                "`inputs` must be a DataLoader over a map-style dataset (each row's dataset "
                "index, each process's share), got one over an IterableDataset"
            )
        if inputs.batch_size is None:
            raise ValueError(
                "`inputs` must batch samples (a DataLoader with a batch_size), got "
                "batch_size=None: its dataset's items would be taken for samples"
            )
        for name, value in (("batch_size", batch_size), ("buffer_rows", buffer_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if tokens is not None and not isinstance(tokens, TokenRows):
            raise TypeError(f"`tokens` must be a TokenRows, got {type(tokens).__name__}")
        if tokens is not None and tokens.reduce is not None:
            raise ValueError(
                f"`tokens` must give one row per token (reduce=None), got reduce="
                f"{tokens.reduce!r}: LiveActivations draws token rows, or one row per "
                "sample without tokens= (a model's per-sample output)"
            )
        parse_io_spec(spec)  # a bad spec fails here, not in the first forward
        self.model = model.requires_grad_(False).eval()
        self.spec, self.inputs, self.tokens = spec, inputs, tokens
        self.batch_size, self.buffer_rows, self.seed = batch_size, buffer_rows, seed
        self._saved: dict[str, Any] = {}
        self._empty: dict[str, Tensor] | None = None
        if validation is not None:  # as LightningDataModule.from_datasets does
            if not isinstance(validation, DataLoader):
                raise TypeError(
                    f"`validation` must be a DataLoader, got {type(validation).__name__}"
                )
            self.val_dataloader = lambda: validation  # type: ignore[method-assign]

    # -- Lightning hooks ---------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # in the Trainer's precision: a "*-true" one converts the model (Lightning's own
        # conversion, as a dump under that precision runs it), a "*-mixed" one autocasts
        if self.trainer is not None:
            self.model = self.trainer.precision_plugin.convert_module(self.model)
        self.model.to(self.device)

    def train_dataloader(self) -> Any:
        return _LiveLoader(self)

    def state_dict(self) -> dict[str, Any]:
        return self._layout()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict)

    # -- what the stream asks of it -----------------------------------------------------

    @property
    def device(self) -> torch.device:
        trainer = self.trainer
        return torch.device("cpu") if trainer is None else trainer.strategy.root_device

    @property
    def rank(self) -> int:
        return 0 if self.trainer is None else self.trainer.global_rank

    @property
    def world(self) -> int:
        return 1 if self.trainer is None else self.trainer.world_size

    def inputs_of_this_process(self) -> _Inputs:
        """This process's share of the inputs, in order, with each batch's dataset indices."""
        dataset = self.inputs.dataset
        sampler: Any = SequentialSampler(dataset)  # type: ignore[arg-type]
        if self.world > 1:  # UnrepeatedDistributedSampler's share, and none for a process
            # beyond the samples (which that sampler refuses): it then takes empty batches
            sampler = range(self.rank, len(dataset), self.world)  # type: ignore[arg-type]
        batch_sampler = BatchSampler(sampler, self.inputs.batch_size or 1, drop_last=False)
        given = self.inputs
        loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=given.collate_fn,
                            num_workers=given.num_workers, pin_memory=given.pin_memory,
                            timeout=given.timeout, worker_init_fn=given.worker_init_fn,
                            multiprocessing_context=given.multiprocessing_context,
                            generator=given.generator, prefetch_factor=given.prefetch_factor,
                            persistent_workers=given.persistent_workers)  # fmt: skip
        return _Inputs(zip(list(batch_sampler), loader, strict=True))

    def count_rows(self, batch: Any) -> int:
        """The rows a batch of inputs gives, from its token mask or its samples."""
        if self.tokens is not None:
            return int(self.tokens.keep(batch).sum())
        first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch
        first = first[0] if isinstance(first, list | tuple) else first
        return int(first.shape[0])

    def run_model(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self.model(**batch)
        if isinstance(batch, list | tuple):
            return self.model(batch[0])
        return self.model(batch)

    def convert_input(self, batch: Any) -> Any:
        """The batch's floating tensors in a "*-true" precision's dtype (as Lightning's)."""
        return batch if self.trainer is None else self.trainer.precision_plugin.convert_input(batch)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The Trainer's precision (autocast under ``bf16-mixed``)."""
        if self.trainer is None:
            return contextlib.nullcontext()
        return self.trainer.precision_plugin.forward_context()

    def agree(self, rows: int, more: bool) -> tuple[int, bool]:
        """The largest fill of the processes and whether any has inputs left."""
        if self.world == 1:
            return rows, more
        local = torch.tensor([rows, int(more)], device=self.device)
        gathered = self.trainer.strategy.all_gather(local)  # type: ignore[union-attr]
        return int(gathered[:, 0].max()), bool(gathered[:, 1].max())

    def empty_batch(self) -> dict[str, Tensor]:
        """A batch of no rows with every key of the others (a process whose inputs have run
        out while others' have not): the rows of a forward of the dataset's first sample,
        none of them kept."""
        if self._empty is None:
            first = self.inputs.collate_fn([self.inputs.dataset[0]])
            rows = captured_rows(self, first, [0])
            self._empty = {key: value[:0] for key, value in rows.items()}
        return dict(self._empty)

    def _layout(self) -> dict[str, Any]:
        """What a fill's rows and order depend on (a fill is whole input batches)."""
        dataset = self.inputs.dataset
        return {"world": self.world, "batch_size": self.batch_size,
                "buffer_rows": self.buffer_rows, "seed": self.seed,
                "inputs_batch_size": self.inputs.batch_size,
                "inputs": len(dataset) if isinstance(dataset, Sized) else None,
                "tokens": None if self.tokens is None else self.tokens.settings()}  # fmt: skip

    def check_resume(self) -> None:
        """A resume must draw the same batches as the run it continues."""
        if self._saved and self._saved != self._layout():
            raise ValueError(
                f"LiveActivations: the checkpoint was made with {self._saved}, this run has "
                f"{self._layout()}: a resumed epoch derives its remaining rows from the inputs "
                "and these settings, so they must be the same (resume at an epoch's end to "
                "change them)"
            )


@dataclass
class _Inputs:
    batches: Iterator[tuple[list[int], Any]]


class _LiveLoader:
    """The train loader: an iterable of one epoch's batches, started at the first batch
    (after Lightning has restored a checkpoint), with the (empty) ``state_dict`` that makes
    Lightning take it for resumable: the position is Lightning's own count of batches."""

    def __init__(self, data: LiveActivations) -> None:
        self.data = data

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return _Deferred(self._start)

    def _start(self) -> Iterator[dict[str, Tensor]]:
        trainer = self.data.trainer
        if trainer is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    "LiveActivations' loader is read outside a Trainer's data module on "
                    f"{dist.get_world_size()} processes: every process would read every row; "
                    "give it as trainer.fit(module, datamodule=live)"
                )
            return epoch_batches(self.data, epoch=0, done=0)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        epoch, done = trainer.current_epoch, _batches_done(progress.current)
        if done and progress.is_last_batch:
            # restored from a checkpoint of a finished epoch (at its end, after its last
            # batch, or after the fit): Lightning keeps this iterator for the epoch it starts
            started: Any = trainer.fit_loop.epoch_progress.current
            epoch, done = started.started, 0
        if done:
            self.data.check_resume()
        return epoch_batches(self.data, epoch=epoch, done=done)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


def _batches_done(current: Any) -> int:
    """The batches of the epoch Lightning will not run again: those it completed, and the
    one a checkpoint saved at its end (``on_train_batch_end``: processed, not yet counted
    completed); a checkpoint saved during a step (an exception's) runs that step again."""
    ready, started, processed, completed = (
        current.ready,
        current.started,
        current.processed,
        current.completed,
    )
    return completed + 1 if ready == started == processed == completed + 1 else completed
