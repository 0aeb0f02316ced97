"""Run by tests/capture/test_sharded_values.py: a tensor-parallel model's values, whole.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python tests/scripts/sharded_values.py OUT

Two gloo processes, no Lightning: each builds :class:`Net` from the same seed, shards it
with torch's parallel styles (:func:`plan`) on a 1-D CPU mesh of both ranks, and runs
every case of the test through ``ModelIOCatcher(model, "cpu")``: captures
(:data:`CAPTURES`), the hand-written layer ``rogue`` refused and then given its placement,
edits (:data:`EDITS`), :class:`~lightning_iocatch.capture.Variants` (:data:`VARIANTS`) and
gradients (:data:`GRADIENTS`). A case that raises gives ``{"error": message}`` in its
place. Rank 0 saves both ranks' results to OUT/results.pt as ``[rank0, rank1]``.

The truth is the same :class:`Net` and weights unsharded (``Net()``, one process): the
test runs it with hand-written hooks. Everything a case needs is defined here once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B, S, H, WIDE, ODD = 2, 4, 8, 16, 5  # batch, sequence, hidden, MLP width, rogue's width


def _fixed(seed: int, *shape: int) -> torch.Tensor:
    """A tensor drawn from its own generator: the same in every process."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


X = _fixed(1, B, S, H)  # the batch, whole (each rank of the model gets its sequence half)
STEER_WIDE, STEER_H, STEER_ODD = _fixed(2, WIDE), _fixed(3, H), _fixed(4, ODD)
MEAN_WIDE = _fixed(5, WIDE)
PATCH_WIDE = _fixed(6, B, S, WIDE)
POSITIONS = torch.tensor([[True, False, False, True], [False, True, True, False]])


class _CopyToRanks(torch.autograd.Function):
    """Identity forward, gradients summed over the ranks (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad


class _SumOverRanks(torch.autograd.Function):
    """Sum over the ranks forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        torch.distributed.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _HandSplit(nn.Module):
    """A replicated Linear of which this rank computes its chunk (``torch.chunk``'s, uneven
    for an odd width); whole with ``world=1``."""

    def __init__(self, d_in: int, d_out: int, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.rank, self.world = rank, world

    def mine(self, size: int) -> torch.Tensor:
        """This rank's indices of ``size`` features."""
        return torch.arange(size).chunk(self.world)[self.rank]


class ColumnHalf(_HandSplit):
    """A hand-written column-parallel layer: this rank's chunk of the output features,
    returned as a plain local tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return self.linear(x)
        rows = self.mine(self.linear.out_features)
        weight, bias = self.linear.weight[rows], self.linear.bias[rows]
        return F.linear(_CopyToRanks.apply(x), weight, bias)


class RowHalf(_HandSplit):
    """The hand-written row-parallel layer after :class:`ColumnHalf`: this rank's chunk of
    the input features in, the sum over the ranks out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return self.linear(x)
        part = F.linear(x, self.linear.weight[:, self.mine(self.linear.in_features)])
        return _SumOverRanks.apply(part) + self.linear.bias


class Tap(nn.Module):
    """Hands its input on (a parallel style on it changes the layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Net(nn.Module):
    """Every layout of :func:`plan` in one forward; ``Net()`` is the unsharded truth."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)  # sequence-parallel
        self.gather = Tap()  # sequence shards in, whole out
        self.up, self.act, self.down = nn.Linear(H, WIDE), nn.GELU(), nn.Linear(WIDE, H)
        self.block2 = nn.Sequential(nn.Linear(H, WIDE), nn.GELU(), nn.Linear(WIDE, H))
        self.column = ColumnHalf(H, H, rank, world)  # declared by PrepareModuleOutput
        self.split, self.join = Tap(), Tap()  # whole -> last-dim shards -> whole
        self.rogue = ColumnHalf(H, ODD, rank, world)  # declared by nothing
        self.back = RowHalf(ODD, H, rank, world)
        self.head = nn.Linear(H, 3)  # plain, replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gather(self.norm(x))
        h = h + self.down(self.act(self.up(h)))
        h = h + self.block2(h)
        h = h + self.column(h)
        h = self.join(self.split(h))
        h = h + self.back(self.rogue(h))
        return self.head(h)


def build(rank: int = 0, world: int = 1) -> Net:
    """The model with the weights of seed 0 (in eval mode: nothing random)."""
    torch.manual_seed(0)
    return Net(rank, world).eval()


def plan() -> dict[str, Any]:
    """The parallel style of each module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    def module_input(given: Any, wanted: Any) -> PrepareModuleInput:
        return PrepareModuleInput(
            input_layouts=(given,), desired_input_layouts=(wanted,), use_local_output=True
        )

    def module_output(given: Any, wanted: Any) -> PrepareModuleOutput:
        return PrepareModuleOutput(
            output_layouts=(given,), desired_output_layouts=(wanted,), use_local_output=True
        )

    return {
        "norm": SequenceParallel(use_local_output=True),
        "gather": module_input(Shard(1), Replicate()),
        "up": ColwiseParallel(use_local_output=True),
        "down": RowwiseParallel(use_local_output=True),
        "block2": module_output(Replicate(), Replicate()),
        "block2.0": ColwiseParallel(use_local_output=False),
        "block2.2": RowwiseParallel(use_local_output=False),
        "column": module_output(Shard(-1), Replicate()),
        "split": module_output(Replicate(), Shard(-1)),
        "join": module_input(Shard(-1), Replicate()),
    }


# (kind, module) captured, all in one session.
CAPTURES: list[tuple[str, str]] = [
    *[("outputs", name) for name in ["norm", "gather", "up", "act", "down", "block2.0"]],
    *[("outputs", name) for name in ["block2.1", "block2.2", "block2", "column", "split"]],
    *[("outputs", name) for name in ["join", "head"]],
    *[("inputs", name) for name in ["norm", "gather", "up", "act", "down", "block2.2"]],
    *[("inputs", name) for name in ["join", "head"]],
]


def flip(h: torch.Tensor) -> torch.Tensor:
    """A function of the whole last dimension: a shard's flip is not the whole's."""
    return h.flip(-1) * 0.5


def reverse(h: torch.Tensor) -> torch.Tensor:
    """A function of the whole sequence."""
    return h.flip(1) - h.mean(1, keepdim=True)


Fn = Callable[[torch.Tensor], torch.Tensor]


def _cases() -> dict[str, tuple[Callable[[], Any], str, str, Fn, Any]]:
    """name -> (the edit, its module, its kind, the hand-written edit of the whole value,
    the mask of places it edits or ``None``)."""
    from lightning_iocatch.capture import Mean, Patch, Replace, Steer, StorePatch, Zero
    from lightning_iocatch.capture.transform import Kind

    class Rows:  # a stand-in store of one row per sample: PATCH_WIDE's
        path = "rows"

        def rows_at(self, key: str, indices: Sequence[int]) -> Any:
            return PATCH_WIDE[list(indices)], torch.arange(len(indices)), None

    cases: dict[str, tuple[Callable[[], Any], str, str, Fn, Any]] = {}
    # the five edits on a column-split Linear's output (a DTensor before the style's hook,
    # a local shard after it), a DTensor output, and a row-split Linear's local input
    sites: list[tuple[str, Kind]] = [("up", "outputs"), ("block2.0", "outputs"), ("down", "inputs")]
    for module, kind in sites:
        cases |= {
            f"zero-{module}": (partial(Zero, module, kind=kind), module, kind,
                               torch.zeros_like, None),
            f"steer-{module}": (partial(Steer, module, STEER_WIDE, 0.5, kind=kind), module,
                                kind, lambda h: h + 0.5 * STEER_WIDE, None),
            f"replace-{module}": (partial(Replace, module, flip, kind=kind), module, kind,
                                  flip, None),
            f"mean-{module}": (partial(Mean, module, MEAN_WIDE, kind=kind), module, kind,
                               lambda h: MEAN_WIDE.expand_as(h).clone(), None),
            f"patch-{module}": (partial(Patch, module, PATCH_WIDE, kind=kind), module, kind,
                                lambda h: PATCH_WIDE.clone(), None),
        }  # fmt: skip
    cases |= {
        "storepatch-up": (lambda: StorePatch("up", Rows(), "up/outputs"), "up", "outputs",
                          lambda h: PATCH_WIDE.clone(), None),
        "steer-act": (lambda: Steer("act", STEER_WIDE, 2.0), "act", "outputs",
                      lambda h: h + 2.0 * STEER_WIDE, None),
        "replace-norm": (lambda: Replace("norm", reverse), "norm", "outputs", reverse, None),
        "zero-norm-positions": (lambda: Zero("norm", positions=POSITIONS), "norm", "outputs",
                                torch.zeros_like, POSITIONS),
        "steer-gather-positions": (
            lambda: Steer("gather", STEER_H, kind="inputs", positions=POSITIONS), "gather",
            "inputs", lambda h: h + STEER_H, POSITIONS),
        "replace-block2.2-inputs": (lambda: Replace("block2.2", flip, kind="inputs"),
                                    "block2.2", "inputs", flip, None),
        "replace-down": (lambda: Replace("down", flip), "down", "outputs", flip, None),
        "steer-column": (lambda: Steer("column", STEER_H), "column", "outputs",
                       lambda h: h + STEER_H, None),
        "replace-split": (lambda: Replace("split", flip), "split", "outputs", flip, None),
        "steer-join-inputs": (lambda: Steer("join", STEER_H, kind="inputs"), "join",
                              "inputs", lambda h: h + STEER_H, None),
        "steer-rogue-given": (lambda: Steer("rogue", STEER_ODD), "rogue", "outputs",
                              lambda h: h + STEER_ODD, None),
        "replace-rogue-given": (lambda: Replace("rogue", flip), "rogue", "outputs", flip, None),
    }  # fmt: skip
    return cases


EDITS = _cases()
GIVEN = "rogue"  # the cases on it run with its placement given in `shard_layouts`
MODES = ("no_grad", "grad")  # every edit runs in both: a plain forward records gradients

# Variants: name -> the names of its EDITS.
VARIANTS: dict[str, tuple[str, ...]] = {
    "zero": ("zero-up",),
    "steer": ("steer-act",),
    "both": ("replace-norm", "steer-down"),
}

# Gradients: name -> (the spec, the names of the EDITS applied in the same session).
GRADIENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "up": ("grad_outputs[up]", ()),
    "block2.0": ("grad_outputs[block2.0]", ()),
    "act": ("grad_outputs[act]", ()),
    "down-inputs": ("grad_inputs[down]", ()),
    "gather-inputs": ("grad_inputs[gather]", ()),
    "norm": ("grad_outputs[norm]", ()),
    "rogue-given": ("grad_outputs[rogue]", ()),
    "up-under-steer-act": ("grad_outputs[up]", ("steer-act",)),
    "norm-under-steer-up": ("grad_outputs[norm]", ("steer-up",)),
    "norm-under-steer-block2.0": ("grad_outputs[norm]", ("steer-block2.0",)),
}


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """The loss every gradient case takes (the same on every rank: the output is whole)."""
    return (output * torch.linspace(-1, 1, output.shape[-1])).pow(2).sum()


def _outcome(run: Callable[[], Any]) -> Any:
    """What ``run()`` gave, or ``{"error": message}``."""
    try:
        return run()
    except Exception as error:  # each case's failure is its result
        return {"error": f"{type(error).__name__}: {error}"}


def main(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_iocatch.capture import ModelIOCatcher, Variants, recording_gradients
    from tests.conftest import hook_count

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(build(rank, world), mesh, plan())
    x = X.chunk(world, dim=1)[rank].contiguous()  # the sequence-parallel input
    given = {"outputs[rogue]": Shard(-1), "inputs[back]": Shard(-1)}
    plain = ModelIOCatcher(model, "cpu")
    layouts = ModelIOCatcher(model, "cpu", shard_layouts=given)

    def catcher_of(names: tuple[str, ...]) -> ModelIOCatcher:
        return layouts if any(GIVEN in name for name in names) else plain

    results: dict[str, Any] = {"output": model(x).detach(), "hooks": [hook_count(model)]}

    def captures() -> dict[tuple[str, str], Any]:
        inputs = [name for kind, name in CAPTURES if kind == "inputs"]
        outputs = [name for kind, name in CAPTURES if kind == "outputs"]
        with plain(outputs=outputs, inputs=inputs) as buf:
            model(x)
        return {
            (kind, name): buf[name][kind][0]["args"][0] if kind == "inputs" else buf[name][kind][0]
            for kind, name in CAPTURES
        }

    results["captures"] = _outcome(captures)

    def rogue(catcher: ModelIOCatcher, **edits: Any) -> Any:
        with catcher(outputs=["rogue"], inputs=["back"], **edits) as buf:
            out = model(x)
        return {"rogue": buf["rogue"]["outputs"][0], "back": buf["back"]["inputs"][0]["args"][0],
                "output": out.detach()}  # fmt: skip

    results["refused"] = _outcome(lambda: rogue(plain))
    steer_rogue = EDITS["steer-rogue-given"][0]
    results["refused-edit"] = _outcome(lambda: rogue(plain, edits=[steer_rogue()]))
    results["after-refused"] = _outcome(lambda: model(x).detach())
    results["given"] = _outcome(lambda: rogue(layouts))

    def edited(name: str, mode: str) -> torch.Tensor:
        session = catcher_of((name,))(edits=[EDITS[name][0]()])
        with session, torch.set_grad_enabled(mode == "grad"):
            session.set_batch_indices(list(range(B)))
            return model(x).detach()

    results["edits"] = {
        mode: {name: _outcome(partial(edited, name, mode)) for name in EDITS} for mode in MODES
    }

    def variants() -> dict[str, Any]:
        chosen = {name: [EDITS[e][0]() for e in cases] for name, cases in VARIANTS.items()}
        runner = Variants(plain, chosen)
        outputs = runner(lambda: model(x))  # under no_grad, as it runs
        return {"outputs": outputs, "fallbacks": [*runner.fallbacks, *runner.notes]}

    results["variants"] = _outcome(variants)

    def gradient(spec: str, edits: tuple[str, ...]) -> Any:
        catcher = catcher_of((spec, *edits))
        session = catcher.from_spec(spec, edits=[EDITS[e][0]() for e in edits])
        with session as buf, recording_gradients():
            loss = loss_of(model(x))
            torch.autograd.grad(loss, session.gradient_edges())
        kind, name = spec[:-1].split("[")
        got = buf[name][kind][0]
        return got["args"][0] if kind == "grad_inputs" else got

    results["gradients"] = {
        name: _outcome(partial(gradient, spec, edits)) for name, (spec, edits) in GRADIENTS.items()
    }

    results["hooks"].append(hook_count(model))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        torch.save(every, out / "results.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
