"""Attribution patching equals TransformerLens' own, and exact patching where it must.

The checks of ``benchmarks/atp_anchor.py`` as tests: on a small ``HookedTransformer`` with
random weights, our denoising scores equal those of TransformerLens' ``attribution_patch``
(per head via ``hook_z``, per MLP output, and per residual stream entry through its
``cache_activation_and_gradient``), our noising scores equal its scores of the swapped
pair, both conventions equal exact patching where the metric is affine in the activation,
and ``exact_patching`` equals TransformerLens' ``run_with_hooks`` patch; in float32 (to
1e-5) and float64 (to 1e-10). Skipped where transformer-lens 3.x is not installed (it is
not in the test extra; ``make test-peers-atp`` runs it in ``.venv-bench/atp``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

# HookedTransformer left TransformerLens in 4.0; 3.9.0 has it and attribution_patch.
pytest.importorskip("transformer_lens.HookedTransformer")
pytest.importorskip("transformer_lens.tools.analysis.attribution_patching")

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated")

ANCHOR = Path(__file__).resolve().parents[2] / "benchmarks" / "atp_anchor.py"
DTYPES = [torch.float32, torch.float64]


def _anchor() -> ModuleType:
    """``benchmarks/atp_anchor.py`` (a script, not a package), loaded once."""
    spec = importlib.util.spec_from_file_location("atp_anchor", ANCHOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


anchor = _anchor()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """A model this small gains nothing from threads, and on a busy machine two threads
    waiting for each other made these tests 20x slower (10 s instead of 0.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _assert_all_ok(rows: list) -> None:
    failed = [row.markdown() for row in rows if not row.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_conventions_equal_transformer_lens_attribution_patch(dtype: torch.dtype) -> None:
    rows = anchor.anchor_rows(dtype)
    assert [row.check for row in rows] == [
        f"{convention}: {kind}"
        for convention in ("denoising vs TL", "noising vs TL swapped")
        for kind in ("attn.hook_z", "hook_mlp_out", "hook_resid_pre")
    ]
    _assert_all_ok(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_conventions_equal_exact_patching_where_the_metric_is_linear(
    dtype: torch.dtype,
) -> None:
    rows = anchor.linear_rows(dtype)
    assert len(rows) == 3 * 2 * 2  # components x conventions x (whole, masked)
    _assert_all_ok(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_patching_equals_transformer_lens_patch_and_differs_from_atp_elsewhere(
    dtype: torch.dtype,
) -> None:
    rows = anchor.exact_rows(dtype)
    assert rows[-1].floor  # the gap row: AtP is not exact where the model is not linear
    _assert_all_ok(rows)


def test_the_anchor_pairs_differ_where_said_and_the_metric_is_per_pair() -> None:
    clean, corrupted, answer, wrong = anchor.prompt_pairs()
    changed = (clean != corrupted).nonzero()[:, 1].unique().tolist()
    assert changed == list(anchor.CHANGED)
    assert bool((answer != wrong).all())
    logits = torch.randn(len(answer), 3, anchor.D_VOCAB, dtype=torch.float64)
    by_hand = [logits[i, -1, answer[i]] - logits[i, -1, wrong[i]] for i in range(len(answer))]
    metric = anchor.logit_difference(answer, wrong)(logits)
    assert torch.equal(metric, torch.stack(by_hand))
