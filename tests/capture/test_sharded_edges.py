"""Edge cases of whole tensor-parallel values (``capture/sharded.py``), found by a review,
each against the same model unsharded in the same process (two gloo processes, one
launch of ``tests/scripts/sharded_edges.py``, no Lightning):

- an edit, or a gradient site, on an elementwise module's input (a local shard) hands the
  forward a tensor that keeps its layout: the module's output is gathered whole, not taken
  for a replicated value (it was captured as the rank's half, silently);
- a module called on a replicated value and then on a shard is refused at the second call
  (the check was made once per module, and the shard passed as whole);
- a local part of a sum (``Partial``): its gradient is the whole value's (it was summed
  over the ranks: 2x), and an edit of it is refused on every rank alike (one rank failed
  alone);
- a DTensor value in a model without a parallel style is captured whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT
from tests.gloo_pair import run_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_edges")
    run_pair(ROOT / "tests" / "scripts" / "sharded_edges.py", out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def pairs(result: dict[str, Any], *names: str) -> None:
    """Each named ``(got, truth)`` pair is equal, got a plain tensor of the truth's shape."""
    assert "error" not in result, result
    for name in names:
        got, truth = result[name]
        assert type(got) is torch.Tensor and got.shape == truth.shape, (name, got.shape)
        torch.testing.assert_close(got, truth.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_edit_of_an_elementwise_input_keeps_its_layout(ranks: list[Any], rank: int) -> None:
    pairs(ranks[rank]["steer_act_inputs"], "outputs", "inputs")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gradient_site_on_an_elementwise_input_keeps_its_layout(
    ranks: list[Any], rank: int
) -> None:
    pairs(ranks[rank]["grad_act_inputs"], "grad", "outputs")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_call_of_a_shared_module_is_checked(ranks: list[Any], rank: int) -> None:
    error = ranks[rank]["shared_module"].get("error", "")
    assert "CaptureError" in error and "'scale'" in error and "call 1" in error, error
    assert "shard_layouts" in error


@pytest.mark.parametrize("rank", [0, 1])
def test_a_local_part_of_a_sum(ranks: list[Any], rank: int) -> None:
    result = ranks[rank]["local_partial"]
    pairs({"grad": result["grad"]}, "grad")
    assert "CaptureError" in result["edit"].get("error", ""), result["edit"]
    assert "part of a sum" in result["edit"]["error"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dtensor_without_a_parallel_style_is_whole(ranks: list[Any], rank: int) -> None:
    pairs(ranks[rank]["dtensor_without_style"], "outputs")


def test_the_launch_script_is_where_the_test_says() -> None:
    assert Path(ROOT / "tests" / "scripts" / "sharded_edges.py").is_file()
