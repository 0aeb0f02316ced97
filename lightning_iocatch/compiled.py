"""torch.compile support: make compiled code see the catcher's hooks.

The catcher calls :func:`prepare_for_hooks` on its model before it registers hooks.
"""

from __future__ import annotations

from torch import nn

__all__ = ["prepare_for_hooks"]


def _has_compiled_parts(model: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) for m in model.modules())


def _make_dynamo_guard_on_hooks() -> None:
    """Let compiled code notice hooks added or removed after compilation.

    By default Dynamo does not guard on module hooks, so hooks registered after the first
    compiled call are silently ignored (pytorch#117758). Turning the guards on is
    process-wide; code compiled before is dropped once so that it is recompiled with them.
    """
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset_code_caches()


def prepare_for_hooks(model: nn.Module) -> None:
    """Called before hooks are registered on ``model``'s submodules."""
    if _has_compiled_parts(model):
        _make_dynamo_guard_on_hooks()
