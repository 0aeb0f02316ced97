"""Run by tests/capture/test_sharded_edges.py as 2 gloo processes: the edge cases of whole
values that a review found, each against the same model unsharded in the same process.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python sharded_edges.py OUT_DIR

Each rank saves ``{case: result}`` to OUT_DIR/rank{r}.pt; a result is a dict of what was
compared, or ``{"error": "Type: message"}``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

B, S, H, W = 2, 3, 4, 8
X = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
V = torch.linspace(-1, 1, W)


class Mlp(nn.Module):
    """``up`` (column-split), ``act`` (elementwise), ``down`` (row-split)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.act, self.down = nn.Linear(H, W), nn.GELU(), nn.Linear(W, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Scale(nn.Module):
    """A user's own module (not known to be elementwise), called twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Shared(nn.Module):
    """``scale`` called on a replicated value (call 0), then on a column shard (call 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale, self.up, self.down = Scale(), nn.Linear(H, W), nn.Linear(W, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.scale(self.up(self.scale(x))))


class Part(nn.Module):
    """A row-split Linear without its reduction: this rank's part of a sum."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(W, H, bias=False)
        self.rank, self.world = rank, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return self.linear(x)
        columns = torch.arange(W).chunk(self.world)[self.rank]
        return F.linear(x, self.linear.weight[:, columns])


class Summed(nn.Module):
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.act, self.part = nn.Linear(H, W), nn.GELU(), Part(rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(self.act(self.up(x)))


def loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.shape[-1])).pow(2).sum()


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as error:  # the result says which, for the test to assert
        return {"error": f"{type(error).__name__}: {error}"}


def main(out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_iocatch.capture import ModelIOCatcher, Steer, recording_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    split = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    results: dict[str, dict[str, Any]] = {}

    def steer_act_inputs() -> dict[str, Any]:
        """An edit of an elementwise module's input (a local shard it hands on)."""
        truth = Mlp()
        seen: dict[str, torch.Tensor] = {}
        truth.act.register_forward_pre_hook(lambda m, a: (a[0] + V,))
        truth.act.register_forward_hook(lambda m, a, o: seen.update(out=o, inp=a[0]))
        with torch.no_grad():
            truth(X)
        model = parallelize_module(Mlp(), mesh, split)
        catcher = ModelIOCatcher(model, "cpu")
        edits = [Steer("act", V, kind="inputs")]
        with catcher(outputs=["act"], inputs=["act"], edits=edits) as buf, torch.no_grad():
            model(X)
        got_in = buf["act"]["inputs"][0]["args"][0]
        return {"outputs": (buf["act"]["outputs"][0], seen["out"]), "inputs": (got_in, seen["inp"])}

    def grad_act_inputs() -> dict[str, Any]:
        """A gradient site on an elementwise module's input, its output captured too."""
        truth = Mlp()
        seen: dict[str, torch.Tensor] = {}
        truth.up.register_forward_hook(lambda m, a, o: seen.update(up=o))
        out = truth(X)
        (grad,) = torch.autograd.grad(loss(out), seen["up"])
        act = truth.act(seen["up"]).detach()
        model = parallelize_module(Mlp(), mesh, split)
        session = ModelIOCatcher(model, "cpu").from_spec("grad_inputs[act]|outputs[act]")
        with session as buf, recording_gradients():
            torch.autograd.grad(loss(model(X)), session.gradient_edges())
        got = buf["act"]["grad_inputs"][0]["args"][0]
        return {"grad": (got, grad), "outputs": (buf["act"]["outputs"][0], act)}

    def shared_module() -> dict[str, Any]:
        """A module called on a replicated value, then on a shard: refused at call 1."""
        model = parallelize_module(Shared(), mesh, split)
        with ModelIOCatcher(model, "cpu")(outputs=["scale"]) as buf, torch.no_grad():
            model(X)
        return {"shapes": [tuple(t.shape) for t in buf["scale"]["outputs"]]}

    def local_partial() -> dict[str, Any]:
        """A local part of a sum: its gradient is the whole value's; an edit is refused."""
        truth = Summed()
        out = truth(X)
        (grad,) = torch.autograd.grad(loss(out), out)
        style = PrepareModuleOutput(
            output_layouts=(Partial(),), desired_output_layouts=(Replicate(),)
        )
        model = parallelize_module(Summed(rank, 2), mesh, {"up": ColwiseParallel(), "part": style})
        catcher = ModelIOCatcher(model, "cpu")
        session = catcher.from_spec("grad_outputs[part]")
        with session as buf, recording_gradients():
            torch.autograd.grad(loss(model(X)), session.gradient_edges())
        edited = attempt(lambda: _edit_part(catcher, model, Steer))
        return {"grad": (buf["part"]["grad_outputs"][0], grad), "edit": edited}

    def dtensor_without_style() -> dict[str, Any]:
        """Parameters made with distribute_tensor and no parallel style: a DTensor value."""
        torch.manual_seed(0)
        linear = nn.Linear(H, W)
        truth = linear(X).detach()
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, mesh, [Shard(0)]))
        linear.bias = nn.Parameter(distribute_tensor(linear.bias.data, mesh, [Shard(0)]))
        model = nn.Sequential(linear)
        with ModelIOCatcher(model, "cpu")(outputs=["0"]) as buf, torch.no_grad():
            model(DTensor.from_local(X, mesh, [Replicate()]))
        return {"outputs": (buf["0"]["outputs"][0], truth)}

    for case in (steer_act_inputs, grad_act_inputs, shared_module, local_partial):
        results[case.__name__] = attempt(case)
    results[dtensor_without_style.__name__] = attempt(dtensor_without_style)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def _edit_part(catcher: Any, model: nn.Module, steer: Any) -> dict[str, Any]:
    with catcher(edits=[steer("part", torch.linspace(-1, 1, H), 0.5)]), torch.no_grad():
        model(X)
    return {}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
