"""Validation-time activation probes: torchmetrics metrics, usable without Lightning.

Pass prototypes to ``IOCaptureCallback(spec, probes=[...])``: its
:class:`~lightning_iocatch.lightning.probe_sink.ProbeSink` clones a per-tensor probe
(:class:`ActivationStats`, :class:`LinearProbe`) for every captured tensor and dataloader
and a cross-tensor probe (:class:`LayerCKA`) for every dataloader, feeds them each
validation (or test) batch, and computes, logs and resets them at the end of the epoch.
This module never imports Lightning: the metrics can be used and tested on their own.

A probe's ``update(features, batch=None, indices=None, repeated=None, tokens=None)``
takes a captured tensor (or, when ``per_tensor`` is False, a mapping of them by flat key),
the batch as the step received it, the samples' dataset indices, per sample whether it is
padding that repeats a sample seen elsewhere, and the batch's bool ``(batch, seq)`` mask
of real tokens (``ProbeSink`` passes the batch's ``attention_mask`` by default; see its
``tokens``); ``compute()`` returns a dict of named scalars.

Real tokens: a tensor of at least three dimensions whose first two are the mask's
``(batch, seq)`` (hidden states; a ``(batch, d)`` tensor is one vector per sample) counts
only the real tokens' values (:class:`ActivationStats`), and is pooled over them
(:func:`pool_features`: ``"mean"`` over each sample's real tokens, ``"last"`` its last
real token under right or left padding); other tensors are counted whole. A sample
without a real token is left out of every tensor, as a ``repeated`` one is.

What probes consume (:func:`usable`): floating-point tensors with a batch dimension, that
is whose first dimension equals the batch's number of samples (``len(indices)``, else
``len(repeated)``; with neither, every floating tensor of at least one dimension counts).
Everything else is ignored without error: bool masks, integer ids, ``None``, objects
without tensors, and tensors without a batch dimension such as rotary ``cos``/``sin``
of shape ``(1, seq, dim)``. A tensor whose first dimension happens to equal the number
of samples cannot be told apart from a batched one; through ``IOCaptureCallback``, a key
is only probed when its tensor had the batch dimension in every batch (of every process)
that captured it, so a rotary table is left out as soon as one batch has two samples.
Rows flagged in ``repeated`` are dropped before anything is counted.

Every count and sum is accumulated in float64 from the values themselves (float16 and
bfloat16 captures are cast before any arithmetic), so reduced-precision captures neither
overflow nor lose precision.

Across processes, state tensors that torchmetrics syncs have shapes that do not depend on
the data, except where they cannot (feature widths, unit counts, the keys
:class:`LayerCKA` pairs): there, before any state is synced, the processes exchange
those shapes (``torch.distributed.all_gather_object``) and every process pads or
restricts its states to the agreed ones. A process that saw no data takes part with
empty states. Every value then equals the one a single process computes on the same
samples, up to the rounding of another summation order. Not protected against: padding
that is not flagged (a shuffling or custom sampler, whose indices are unknown, is padded
too) is counted twice, and a value that depends on which samples share a batch (a module
called for a whole batch when one of its samples needs it) differs with the batching.
"""

from lightning_iocatch.probes.base import POOLS, pool_features, usable
from lightning_iocatch.probes.cka import LayerCKA
from lightning_iocatch.probes.health import HealthFigures, health_statistics, merge_statistics
from lightning_iocatch.probes.linear import LinearProbe
from lightning_iocatch.probes.stats import ActivationStats
from lightning_iocatch.probes.unit_summary import UnitSummary
from lightning_iocatch.probes.units import UnitActivations

__all__ = [
    "POOLS",
    "ActivationStats",
    "HealthFigures",
    "LayerCKA",
    "LinearProbe",
    "UnitActivations",
    "UnitSummary",
    "health_statistics",
    "merge_statistics",
    "pool_features",
    "usable",
]
