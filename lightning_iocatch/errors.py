"""The exception types lightning-iocatch raises at its users.

Every error names the offending input, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = ["CaptureError", "SpecError", "StoreError", "UnknownModuleError"]


class SpecError(ValueError):
    """A capture spec string is malformed (see :func:`lightning_iocatch.parse_io_spec`)."""


class UnknownModuleError(KeyError):
    """A module name or glob in a capture request matches no submodule of the model."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class CaptureError(RuntimeError):
    """A capture session is used the wrong way (nested sessions, early exit outside ``run``)."""


class StoreError(RuntimeError):
    """A feature store on disk is missing, incomplete, corrupted, or cannot be written."""
