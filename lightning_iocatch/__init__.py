"""lightning-iocatch: capture inputs and outputs of named submodules inside Lightning's loops.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_iocatch import ModelIOCatcher
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> with ModelIOCatcher(net, "cpu").for_product("outputs[0]", early_exit=False) as buf:
    ...     _ = net(torch.ones(1, 4))
    >>> len(buf["0"]["outputs"])
    1
"""

from lightning_iocatch.callback import IOCaptureCallback
from lightning_iocatch.catcher import CaptureBuffer, CaptureSession, ModelIOCatcher
from lightning_iocatch.errors import CaptureError, SpecError, StoreError, UnknownModuleError
from lightning_iocatch.sinks import BatchCaptures, CaptureSink, MemorySink
from lightning_iocatch.spec import CaptureSpec, format_io_spec, parse_io_spec
from lightning_iocatch.store import FeatureStore
from lightning_iocatch.transfer import transfer_to_device
from lightning_iocatch.writer import FeatureWriter

__all__ = [
    "BatchCaptures",
    "CaptureBuffer",
    "CaptureError",
    "CaptureSession",
    "CaptureSink",
    "CaptureSpec",
    "FeatureStore",
    "FeatureWriter",
    "IOCaptureCallback",
    "MemorySink",
    "ModelIOCatcher",
    "SpecError",
    "StoreError",
    "UnknownModuleError",
    "format_io_spec",
    "parse_io_spec",
    "transfer_to_device",
]
