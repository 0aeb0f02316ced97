"""Our attribution patching against TransformerLens' own, on one small HookedTransformer.

Runs in the bench environment (``make bench-atp`` builds ``.venv-bench/atp`` with
transformer-lens 3.9.0, never in the test extra). Version 3.9.0 is the last with
``HookedTransformer`` (4.0 removed it for ``TransformerBridge``) and already ships
``transformer_lens.tools.analysis.attribution_patching``: its node-level code
(``attribution_patch``, ``cache_activation_and_gradient``, ``_node_effects``) is the same in
4.3.0 but for one error message. The reference here is that function itself, not a copy:

- per head (``blocks.L.attn.hook_z``) and MLP output (``blocks.L.hook_mlp_out``): the node
  scores of ``attribution_patch``, one prompt pair per call (it averages over the pairs it
  is given: a pair alone gives that pair's scores);
- the residual stream (``blocks.L.hook_resid_pre``, not one of its nodes): its
  ``cache_activation_and_gradient`` on the corrupted run (gradient) and the clean run, and
  ``(a_clean - a_corrupted) . g`` over ``d_model`` as its ``_node_effects`` computes it.

Checks (each prints a row; the script exits 1 if one fails), in float32 and float64:

1. ``denoising``: ours equal to TransformerLens' on the same pairs, per head, per MLP
   output and per residual stream entry, at every position.
2. ``noising``: ours equal to TransformerLens' with the two batches swapped. The algebra:
   noising(clean, corrupted) = (a_corr - a_clean) . g(clean), and TransformerLens'
   denoising of the swapped pair, TL(clean'=corrupted, corrupt'=clean), is
   (a_clean' - a_corrupt') . g(corrupt') = (a_corr - a_clean) . g(clean): the same number,
   with no sign change (swapping the batches already flips the difference).
3. ``linear``: both conventions equal to ``exact_patching`` where the metric is affine in
   the patched activation, so the first-order estimate is exact: ``ln_final.hook_normalized``
   of a LayerNorm model (only the unembedding after it), and the last block's
   ``attn.hook_z`` and ``hook_resid_post`` of an attention-only model without normalization;
   whole component and a random position mask (the AtP scores summed over the masked
   positions).
4. ``exact``: ``exact_patching`` itself against TransformerLens' ``run_with_hooks`` patch
   on components downstream of which the model is not linear, and ``linear gap``: there AtP
   and exact patching differ (shows that check 3 is not passed by a patch that did nothing).

The bound is 1e-5 in float32 and 1e-10 in float64 (absolute); each row also prints the
largest score, which is kept of order 1 (weights drawn with a larger standard deviation)
so that the bound means something.

    python benchmarks/atp_anchor.py        # about 5 seconds
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.tools.analysis.attribution_patching import (
    attribution_patch,
    cache_activation_and_gradient,
)

from lightning_iocatch.capture.attribution import attribution_patching, exact_patching

N_LAYERS, D_MODEL, N_HEADS, D_VOCAB, N_CTX = 3, 64, 4, 50, 16
BATCH, SEQ, CHANGED = 6, 12, (2, 7)  # positions where a corrupted prompt differs
SPEC = "outputs[blocks.*.attn.hook_z|blocks.*.hook_mlp_out|blocks.*.hook_resid_pre]"
BOUND = {torch.float32: 1e-5, torch.float64: 1e-10}
Metric = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Row:
    """One comparison: the largest absolute difference against the bound."""

    check: str
    dtype: torch.dtype
    difference: float
    largest: float  # the largest |value| compared: the scale the bound is read against
    bound: float
    floor: bool = False  # the difference must reach the bound instead

    @property
    def ok(self) -> bool:
        if self.floor:
            return self.difference >= self.bound
        return self.difference <= self.bound and self.largest > 1e-2

    def markdown(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"| {self.check} | {dtype} | {self.difference:.2e} | {self.largest:.3g} "
            f"| {'>= ' if self.floor else '<= '}{self.bound:.0e} | {verdict} |"
        )


def hooked_transformer(
    dtype: torch.dtype, *, attn_only: bool = False, normalization: str | None = "LN"
) -> HookedTransformer:
    """A small HookedTransformer with random weights (offline), in eval mode.

    The weights' standard deviation makes scores of order 1: 0.3 with LayerNorm,
    0.15 without (where the residual stream is not rescaled and logits grow with it).
    """
    spread = 0.3 if normalization else 0.15
    config = HookedTransformerConfig(
        n_layers=N_LAYERS, d_model=D_MODEL, n_heads=N_HEADS, d_head=D_MODEL // N_HEADS,
        d_mlp=4 * D_MODEL, d_vocab=D_VOCAB, n_ctx=N_CTX, act_fn="gelu", attn_only=attn_only,
        normalization_type=normalization, initializer_range=spread, seed=0, dtype=dtype,
        device="cpu",
    )  # fmt: skip
    return HookedTransformer(config).eval()


def prompt_pairs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clean and corrupted token batches (the corrupted differs at ``CHANGED``), and each
    pair's answer and wrong token for the logit difference."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, D_VOCAB, (BATCH, SEQ), generator=generator)
    corrupted = clean.clone()
    shift = torch.randint(1, D_VOCAB, (BATCH, len(CHANGED)), generator=generator)
    corrupted[:, list(CHANGED)] = (clean[:, list(CHANGED)] + shift) % D_VOCAB
    answer, wrong = torch.randint(0, D_VOCAB, (2, BATCH), generator=generator)
    wrong = torch.where(wrong == answer, (wrong + 1) % D_VOCAB, wrong)
    return clean, corrupted, answer, wrong


def logit_difference(answer: torch.Tensor, wrong: torch.Tensor) -> Metric:
    """Per pair: the answer's logit minus the wrong token's, at the last position."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0])
        last = logits[:, -1]
        return last[rows, answer[: len(rows)]] - last[rows, wrong[: len(rows)]]

    return metric


def runner(model: HookedTransformer, metric: Metric) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tokens: metric(model(tokens))


def ours(
    model: HookedTransformer, pairs: tuple, spec: str = SPEC
) -> dict[str, dict[str, torch.Tensor]]:
    """Our scores in both conventions from one call, ``{convention: {hook: [batch, pos(,
    head)]}}``."""
    clean, corrupted, answer, wrong = pairs
    run = runner(model, logit_difference(answer, wrong))
    found = attribution_patching(model, spec, run, clean, corrupted, ("denoising", "noising"))
    return {
        convention: {key.removesuffix("/outputs"): value for key, value in scores.items()}
        for convention, scores in found.scores.items()
    }


def transformer_lens(
    model: HookedTransformer, clean: torch.Tensor, corrupted: torch.Tensor, answer, wrong
) -> dict[str, torch.Tensor]:
    """TransformerLens' denoising scores, pair by pair, in our layout (float64)."""
    scores: dict[str, torch.Tensor] = {}
    for layer in range(N_LAYERS):
        scores[f"blocks.{layer}.attn.hook_z"] = torch.zeros(
            BATCH, SEQ, N_HEADS, dtype=torch.float64
        )
        scores[f"blocks.{layer}.hook_mlp_out"] = torch.zeros(BATCH, SEQ, dtype=torch.float64)
    resid = [f"blocks.{layer}.hook_resid_pre" for layer in range(N_LAYERS)]
    for i in range(BATCH):
        pair_metric = logit_difference(answer[i : i + 1], wrong[i : i + 1])

        def metric(logits: torch.Tensor, pair_metric: Metric = pair_metric) -> torch.Tensor:
            return pair_metric(logits).sum()  # one pair: its scalar metric

        pair = clean[i : i + 1], corrupted[i : i + 1]
        for node, score in attribution_patch(model, *pair, metric).node_scores.items():
            if node.kind == "attn_head_out":
                scores[node.hook_name][i, node.position, node.head] = score
            elif node.kind == "mlp_out":
                scores[node.hook_name][i, node.position] = score
        at_clean = cache_activation_and_gradient(
            model, pair[0], metric, names_filter=resid, compute_gradient=False
        )
        at_corrupted = cache_activation_and_gradient(model, pair[1], metric, names_filter=resid)
        for name in resid:
            delta = at_clean.activations[name] - at_corrupted.activations[name]
            product = (delta * at_corrupted.gradients[name]).sum(-1)[0].double()
            scores.setdefault(name, torch.zeros(BATCH, SEQ, dtype=torch.float64))[i] = product
    return scores


def compare(
    check: str, dtype: torch.dtype, found: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]
) -> list[Row]:
    """One row per kind of component (heads, MLP outputs, residual stream)."""
    if sorted(found) != sorted(truth):
        raise AssertionError(f"{check}: keys {sorted(found)} != {sorted(truth)}")
    rows = []
    for kind in ("attn.hook_z", "hook_mlp_out", "hook_resid_pre"):
        names = [name for name in truth if name.endswith(kind)]
        difference = max((found[n].double() - truth[n].double()).abs().max().item() for n in names)
        largest = max(truth[n].double().abs().max().item() for n in names)
        rows.append(Row(f"{check}: {kind}", dtype, difference, largest, BOUND[dtype]))
    return rows


def anchor_rows(dtype: torch.dtype) -> list[Row]:
    """Checks 1 and 2: both conventions against TransformerLens' ``attribution_patch``."""
    model, pairs = hooked_transformer(dtype), prompt_pairs()
    clean, corrupted, answer, wrong = pairs
    found = ours(model, pairs)
    denoising = transformer_lens(model, clean, corrupted, answer, wrong)
    swapped = transformer_lens(model, corrupted, clean, answer, wrong)
    rows = compare("denoising vs TL", dtype, found["denoising"], denoising)
    return rows + compare("noising vs TL swapped", dtype, found["noising"], swapped)


def position_mask(seed: int = 2) -> torch.Tensor:
    """A random ``[batch, seq]`` mask, the last position kept in half the pairs."""
    mask = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(seed)) < 0.5
    mask[:, -1] = torch.arange(BATCH) % 2 == 0
    return mask


def linear_rows(dtype: torch.dtype) -> list[Row]:
    """Check 3: where the metric is affine in the activation, AtP is exact patching."""
    pairs = prompt_pairs()
    clean, corrupted, answer, wrong = pairs
    last = N_LAYERS - 1
    with_norm = hooked_transformer(dtype)
    without = hooked_transformer(dtype, attn_only=True, normalization=None)
    cases = [
        (with_norm, "ln_final.hook_normalized"),
        (without, f"blocks.{last}.attn.hook_z"),
        (without, f"blocks.{last}.hook_resid_post"),
    ]
    rows = []
    for model, name in cases:
        run = runner(model, logit_difference(answer, wrong))
        found = ours(model, pairs, f"outputs[{name}]")
        for convention in ("denoising", "noising"):
            atp = found[convention][name].double()
            atp = atp.flatten(2).sum(-1) if atp.dim() > 2 else atp  # heads summed
            for mask in (None, position_mask()):
                exact = exact_patching(
                    model, f"{name}/outputs", run, clean, corrupted, convention, positions=mask
                ).double()
                estimate = atp.sum(1) if mask is None else (atp * mask).sum(1)
                where = "whole" if mask is None else "masked"
                difference = (estimate - exact).abs().max().item()
                largest = exact.abs().max().item()
                check = f"linear: {name} {convention} {where}"
                rows.append(Row(check, dtype, difference, largest, BOUND[dtype]))
    return rows


def transformer_lens_patch(
    model: HookedTransformer, name: str, source: torch.Tensor, target: torch.Tensor, metric
) -> torch.Tensor:
    """TransformerLens' own exact patch: ``target`` run with ``name`` set to its value on
    ``source``, minus the plain ``target`` run."""
    _, cache = model.run_with_cache(source, names_filter=name)
    patched = model.run_with_hooks(target, fwd_hooks=[(name, lambda act, hook: cache[name])])
    return metric(patched) - metric(model(target))


def exact_rows(dtype: torch.dtype) -> list[Row]:
    """Check 4: ``exact_patching`` against TransformerLens' patch, and AtP's gap from it."""
    model, pairs = hooked_transformer(dtype), prompt_pairs()
    clean, corrupted, answer, wrong = pairs
    metric = logit_difference(answer, wrong)
    run = runner(model, metric)
    rows, gaps, largest = [], [], 0.0
    with torch.no_grad():
        for name in ("blocks.1.attn.hook_z", "blocks.0.hook_mlp_out", "blocks.1.hook_resid_pre"):
            for convention, source, target in (
                ("denoising", clean, corrupted),
                ("noising", corrupted, clean),
            ):
                truth = transformer_lens_patch(model, name, source, target, metric).double()
                exact = exact_patching(
                    model, f"{name}/outputs", run, clean, corrupted, convention
                ).double()
                with torch.enable_grad():
                    atp = ours(model, pairs, f"outputs[{name}]")[convention][name]
                difference = (exact - truth).abs().max().item()
                largest = max(largest, truth.abs().max().item())
                check = f"exact vs TL patch: {name} {convention}"
                rows.append(Row(check, dtype, difference, largest, BOUND[dtype]))
                gaps.append((atp.double().flatten(1).sum(1) - truth).abs().max().item())
    # Not a bound but a floor: AtP must differ from exact patching where the model is not
    # linear, or the linear rows would prove nothing.
    rows.append(Row("linear gap: AtP vs exact, not linear", dtype, max(gaps), largest, 1e-3, True))
    return rows


def all_rows() -> list[Row]:
    rows: list[Row] = []
    for dtype in (torch.float32, torch.float64):
        rows += anchor_rows(dtype) + linear_rows(dtype) + exact_rows(dtype)
    return rows


def main() -> int:
    warnings.filterwarnings("ignore", "HookedTransformer is deprecated", DeprecationWarning)
    torch.set_num_threads(1)  # a model this small: more threads only wait for each other
    rows = all_rows()
    print(f"transformer-lens {version('transformer-lens')}, torch {torch.__version__}; "
          f"{N_LAYERS} layers, d_model {D_MODEL}, {N_HEADS} heads, vocabulary {D_VOCAB}; "
          f"{BATCH} prompt pairs of {SEQ} tokens, positions {CHANGED} changed\n")  # fmt: skip
    print("| check | dtype | max abs difference | largest value | bound | |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row.markdown())
    failed = [row for row in rows if not row.ok]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
