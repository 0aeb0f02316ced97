"""What :class:`~lightning_iocatch.lightning.effects.InterventionEffects` computes of each
forward: the default loss (:func:`next_token_loss`), the KL divergence from the clean
forward (:func:`kl_per_sample`), per sample in float64, how a ``loss`` function's value is
read (:func:`loss_sums`, :func:`loss_terms`: one place for the effects, the gradient pass and
attribution patching), and how the model is called by default (:func:`default_forward`,
:func:`default_output`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = [
    "LossFn",
    "call_forward",
    "default_forward",
    "default_output",
    "effect_columns",
    "kl_per_sample",
    "loss_sums",
    "loss_terms",
    "next_token_loss",
    "ratio",
]

_CHUNK = 256  # positions turned into float64 [positions, vocab] at once

LossFn = Callable[[torch.Tensor, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
"""``loss(logits, batch)`` -> per-sample losses, or per-sample ``(sums, counts)``."""


def loss_sums(value: Any) -> Any:
    """The per-sample loss sums of a :data:`LossFn`'s value: the first of ``(sums, counts)``,
    else the value itself (its shape not checked: the caller says what it needs); a tuple
    that is not a pair is refused."""
    if not isinstance(value, tuple):
        return value
    if len(value) != 2:
        raise ValueError(
            f"`loss` returned a tuple of {len(value)} items: give per-sample losses, or "
            "a pair (per-sample sums, per-sample counts)"
        )
    return value[0]


def loss_terms(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A :data:`LossFn`'s value as per-sample ``(sums, counts)``: one term per sample where
    it gave per-sample losses.

    Examples:
        >>> sums, counts = loss_terms(torch.tensor([2.0, 3.0]))
        >>> sums.tolist(), counts.tolist()
        ([2.0, 3.0], [1.0, 1.0])
        >>> [t.tolist() for t in loss_terms((torch.tensor([4.0]), torch.tensor([2])))]
        [[4.0], [2]]
    """
    if isinstance(value, tuple):
        return loss_sums(value), value[1]
    return value, torch.ones_like(value)


def next_token_loss(logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum of next-token cross-entropies (float64) and their number.

    A batch with ``labels`` (a mapping): as Hugging Face's causal LM loss, position ``t``
    predicts ``labels[t + 1]``, where it is not -100. Else ``batch["input_ids"]`` (or a batch
    that is a ``[batch, seq]`` tensor of token ids): position ``t`` predicts token ``t + 1``,
    counted where ``batch["attention_mask"]`` (if any) is 1 at both. For a batch ``(x, y)``
    with ``logits`` of ``[batch, classes]``: the cross-entropy of ``y``, one term per sample.
    Logits of other positions than the tokens' (a prefix of soft prompts) are refused.
    """
    targets = _next_tokens(logits, batch)
    if targets is not None:
        ids, keep = targets
        sums = torch.zeros(len(ids), dtype=torch.float64, device=logits.device)
        for row in range(len(ids)):  # one sample at a time, [positions, vocab] in float64
            for start in range(0, ids.shape[1] - 1, _CHUNK):
                end = min(start + _CHUNK, ids.shape[1] - 1)
                terms = torch.nn.functional.cross_entropy(
                    logits[row, start:end].double(),
                    ids[row, start + 1 : end + 1],
                    reduction="none",
                    ignore_index=-100,
                )
                sums[row] += terms[keep[row, start:end]].sum()
        return sums, keep.sum(1).double()
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and logits.dim() == 2:
        terms = torch.nn.functional.cross_entropy(logits.double(), batch[1], reduction="none")
        return terms, torch.ones_like(terms)
    raise ValueError(
        f"no default loss for outputs of shape {tuple(logits.shape)} and a batch of type "
        f"{type(batch).__name__}: the default is next-token cross-entropy for a batch with "
        "`input_ids` (a mapping) or cross-entropy for a batch `(x, y)`; give "
        "`loss=lambda logits, batch: ...` returning per-sample losses (or per-sample sums "
        "and counts)"
    )


def _next_tokens(logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The token ids (or labels) each position's next token is read from, and where a
    term counts (``[batch, seq - 1]``), for :func:`next_token_loss`'s token case; ``None``
    where the batch or the logits are not of that case."""
    tokens = isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point()
    if not (tokens or (isinstance(batch, Mapping) and "input_ids" in batch)) or logits.dim() != 3:
        return None
    ids = batch if tokens else batch["input_ids"]
    mask = None if tokens else batch.get("attention_mask")
    labels = None if tokens else batch.get("labels")
    if labels is not None:
        ids, mask = labels, None
    if logits.shape[:2] != ids.shape[:2]:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} for tokens of shape "
            f"{tuple(ids.shape)}: the default loss needs one position per token; give "
            "`output=` returning the tokens' logits, or `loss=` your own"
        )
    keep = torch.ones_like(ids[:, 1:], dtype=torch.bool)
    if labels is not None:
        keep = ids[:, 1:] != -100
    elif mask is not None:
        keep = keep & mask[:, 1:].bool() & mask[:, :-1].bool()
    return ids, keep


def kl_per_sample(
    clean: torch.Tensor, variant: torch.Tensor, batch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum over positions of KL(clean || variant) of the softmax over the
    last dimension (float64; a class the clean logits rule out, -inf, adds nothing), and the
    number of positions (``attention_mask``'s ones)."""
    kl = _effect_sums(clean, [variant], batch, None)[1]
    return kl[0], kl[1]


def effect_columns(
    clean: torch.Tensor, variants: list[torch.Tensor], batch: Any, loss: LossFn
) -> list[torch.Tensor]:
    """Per sample in float64: the clean forward's loss sums and counts, then for each
    variant its loss sums and counts and its KL from the clean forward's sums and counts
    (:func:`kl_per_sample`), as ``loss`` and :func:`kl_per_sample` give them one by one.

    The clean forward's log-softmax is computed once for every variant's KL; with the
    default loss (:func:`next_token_loss` on token ids), each forward's log-softmax also
    gives its cross-entropies (``nll_loss`` of it, as ``cross_entropy`` computes them),
    chunk by chunk as the two functions chunk alone, so every value is theirs bit for bit.
    """
    targets = _next_tokens(clean, batch) if loss is next_token_loss else None
    if targets is not None:
        losses, *kls = _effect_sums(clean, variants, batch, targets)
    else:
        losses = [_double_terms(loss(logits, batch)) for logits in [clean, *variants]]
        kls = _effect_sums(clean, variants, batch, None)[1:]
    columns = [*losses[0]]
    for k in range(len(variants)):
        columns += [*losses[k + 1], *kls[k]]
    return columns


def _double_terms(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    sums, counts = loss_terms(value)
    return sums.double(), counts.double()


def _effect_sums(
    clean: torch.Tensor,
    variants: list[torch.Tensor],
    batch: Any,
    targets: tuple[torch.Tensor, torch.Tensor] | None,
) -> list[Any]:
    """``[losses, kl of variant 0, kl of variant 1, ...]``: each a per-sample ``(sums,
    counts)``; ``losses`` (``None`` without ``targets``) a list, the clean forward's first.

    One sample at a time, in chunks of ``_CHUNK`` positions as :func:`next_token_loss` and
    :func:`kl_per_sample` took them: the clean chunk's log-softmax (and its exponential, its
    ruled-out classes) once for every variant, each variant's once for its loss and KL."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is not None and clean.dim() == 3 and clean.shape[:2] != mask.shape[:2]:
        raise ValueError(
            f"logits of shape {tuple(clean.shape)} for an attention_mask of shape "
            f"{tuple(mask.shape)}: KL is taken at the mask's positions; give `output=` "
            "returning one position per token"
        )
    if mask is not None and clean.dim() != 3:
        mask = None  # one distribution per sample: no positions to mask
    width, device = clean.shape[-1], clean.device
    sums = torch.zeros(len(variants), len(clean), dtype=torch.float64, device=device)
    losses = torch.zeros(len(variants) + 1, len(clean), dtype=torch.float64, device=device)
    for row in range(len(clean)):
        p_row = clean[row].reshape(-1, width)
        q_rows = [variant[row].reshape(-1, width) for variant in variants]
        keep = mask[row].bool() if mask is not None else torch.ones(len(p_row), dtype=torch.bool)
        for start in range(0, len(p_row), _CHUNK):  # [positions, vocab] in float64, in parts
            p = torch.log_softmax(p_row[start : start + _CHUNK].double(), -1)
            predicts = targets if targets and start < targets[0].shape[1] - 1 else None
            if predicts is not None:
                losses[0, row] += _token_loss(p, predicts, row, start)
            exp, ruled_out = p.exp(), torch.isneginf(p)
            every = bool(ruled_out.any())  # else torch.where would change nothing
            here = keep[start : start + _CHUNK].to(device)
            for k, q_row in enumerate(q_rows):
                q = torch.log_softmax(q_row[start : start + _CHUNK].double(), -1)
                if predicts is not None:
                    losses[k + 1, row] += _token_loss(q, predicts, row, start)
                kl = exp * (p - q)
                kl = (torch.where(ruled_out, 0.0, kl) if every else kl).sum(-1)  # 0 log 0 = 0
                sums[k, row] += kl[here].sum()
    if mask is not None:
        counts = mask.sum(1).double()
    else:
        counts = torch.full_like(sums[0], float(clean[0].numel() // width))
    found: list[Any] = [None]
    if targets is not None:
        found[0] = [(losses[k], targets[1].sum(1).double()) for k in range(len(losses))]
    return found + [(sums[k], counts) for k in range(len(variants))]


def _token_loss(
    logp: torch.Tensor, targets: tuple[torch.Tensor, torch.Tensor], row: int, start: int
) -> torch.Tensor:
    """The sum of a chunk's next-token cross-entropies where they count: ``nll_loss`` of
    its log-softmax, as ``cross_entropy`` computes them."""
    ids, keep = targets
    end = min(start + _CHUNK, ids.shape[1] - 1)
    terms = torch.nn.functional.nll_loss(
        logp[: end - start], ids[row, start + 1 : end + 1], reduction="none", ignore_index=-100
    )
    return terms[keep[row, start:end]].sum()


def default_forward(module: pl.LightningModule, batch: Any) -> Any:
    """``module(**batch)`` for a mapping, ``module(batch[0])`` for ``(x, y)``, else
    ``module(batch)``."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    return module(batch)


def call_forward(
    forward: Callable[[pl.LightningModule, Any], Any],
    module: pl.LightningModule,
    batch: Any,
    owner: str,
) -> Any:
    """``forward(module, batch)``; where the default forward fails to call the model, a
    ``TypeError`` that says how ``owner`` (e.g. ``"InterventionEffects"``) called it and
    that ``forward=`` (and ``output=``) fix it."""
    try:
        return forward(module, batch)
    except TypeError as error:
        if forward is not default_forward:
            raise
        call = "pl_module(**batch)" if isinstance(batch, Mapping) else "pl_module(batch[0])"
        raise TypeError(
            f"{owner} called the model as `{call}` (its default `forward=`), which failed: "
            f"{error}. Give `forward=` calling it as your step does, and `output=` if the "
            "result is not the logits (or has no `.logits`), e.g. "
            f"{owner}(..., forward=lambda module, batch: module(batch), "
            "output=lambda out: out.logits)"
        ) from error


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN where the denominator is 0 (no terms, or a baseline
    whose loss is the clean loss).

    Examples:
        >>> ratio(3.0, 2.0), ratio(1.0, 0.0)
        (1.5, nan)
    """
    return numerator / denominator if denominator else math.nan


def default_output(output: Any) -> torch.Tensor:
    """An output's ``logits`` attribute, the output itself if a tensor, or its first value."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the forward returned a {type(output).__name__}: give `output=`")
    return output
