"""Destroy a gloo process group before the interpreter shuts down.

After a collective over gloo (the writer's end-of-dump agreement, the probes' gather, the
data module's check), gloo's worker threads may still hold the collective's work when
Python exits; freeing it while the interpreter is finalized takes the GIL and aborts the
process ("terminate called without an active exception", SIGABRT) about once in six runs
of a 2-process CPU dump (PyTorch issue 190489). ``destroy_process_group()`` at exit, while
the interpreter is whole, prevents it. Lightning registers that for NCCL only; the
library's Lightning hooks call :func:`destroy_gloo_group_at_exit` for gloo.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_gloo_group_at_exit"]

_registered = False


def destroy_gloo_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit if it is a gloo group then.

    Registered once per process, and only where a process group is initialized; a group
    destroyed earlier (by the user, by Lightning) is left alone.
    """
    global _registered
    if _registered or not (dist.is_available() and dist.is_initialized()):
        return
    atexit.register(_destroy_gloo_group)
    _registered = True


def _destroy_gloo_group() -> None:
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
