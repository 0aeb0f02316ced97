"""lightning-iocatch: capture inputs and outputs of named submodules inside Lightning's loops.

Public names load on first use (PEP 562), so ``import lightning_iocatch`` and the
command line stay quick when Lightning itself is not needed.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch import ModelIOCatcher
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> with ModelIOCatcher(net, "cpu").from_spec("outputs[0]", early_exit=False) as buf:
    ...     _ = net(torch.ones(1, 4))
    >>> len(buf["0"]["outputs"])
    1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_iocatch.capture import (
        CaptureBuffer,
        CaptureSession,
        CaptureSpec,
        ModelIOCatcher,
        NotCaptured,
        format_io_spec,
        parse_io_spec,
        transfer_to_device,
    )
    from lightning_iocatch.errors import CaptureError, SpecError, StoreError, UnknownModuleError
    from lightning_iocatch.lightning import (
        ActivationMonitor,
        AttributionPatching,
        BatchCaptures,
        CaptureSink,
        FeatureWriter,
        InterventionEffects,
        IOCaptureCallback,
        LiveActivations,
        MemorySink,
        SAEGroup,
        SAEModule,
        StoreDataModule,
    )
    from lightning_iocatch.store import FeatureStore, StoreRows, TokenRows

_HOMES = {
    "ActivationMonitor": "lightning",
    "AttributionPatching": "lightning",
    "IOCaptureCallback": "lightning",
    "InterventionEffects": "lightning",
    "CaptureBuffer": "capture",
    "CaptureSession": "capture",
    "ModelIOCatcher": "capture",
    "CaptureError": "errors",
    "SpecError": "errors",
    "StoreError": "errors",
    "UnknownModuleError": "errors",
    "BatchCaptures": "lightning",
    "CaptureSink": "lightning",
    "MemorySink": "lightning",
    "CaptureSpec": "capture",
    "format_io_spec": "capture",
    "parse_io_spec": "capture",
    "FeatureStore": "store",
    "StoreDataModule": "lightning",
    "SAEModule": "lightning",
    "SAEGroup": "lightning",
    "LiveActivations": "lightning",
    "StoreRows": "store",
    "TokenRows": "store",
    "NotCaptured": "capture",
    "transfer_to_device": "capture",
    "FeatureWriter": "lightning",
}

__all__ = [
    "ActivationMonitor",
    "AttributionPatching",
    "BatchCaptures",
    "CaptureBuffer",
    "CaptureError",
    "CaptureSession",
    "CaptureSink",
    "CaptureSpec",
    "FeatureStore",
    "FeatureWriter",
    "IOCaptureCallback",
    "InterventionEffects",
    "LiveActivations",
    "MemorySink",
    "ModelIOCatcher",
    "NotCaptured",
    "SAEGroup",
    "SAEModule",
    "SpecError",
    "StoreDataModule",
    "StoreError",
    "StoreRows",
    "TokenRows",
    "UnknownModuleError",
    "format_io_spec",
    "parse_io_spec",
    "transfer_to_device",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lightning_iocatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_iocatch.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
