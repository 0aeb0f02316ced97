"""A process's peak resident memory, and resetting it: what the memory benchmarks measure
(stdlib only, so it adds nothing to the process it measures)."""

from __future__ import annotations

import resource
from pathlib import Path


def peak() -> int:
    """The peak resident bytes of this process since the last :func:`reset_peak` (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Let VmHWM start from the RSS of now (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
