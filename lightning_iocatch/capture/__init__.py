"""Capture: what happens inside a forward, with no Lightning and no store.

The spec grammar and name resolution (:mod:`~lightning_iocatch.capture.spec`), sessions
whose hooks exist only while open (:mod:`~lightning_iocatch.capture.catcher`), the
coordinator that lets sessions on one model compose and stops forwards early
(:mod:`~lightning_iocatch.capture.coordinator`), snapshots and copies off the model
(:mod:`~lightning_iocatch.capture.snapshots`, the GPU path in
:mod:`~lightning_iocatch.capture.host_copy` and :mod:`~lightning_iocatch.capture.pinned_ring`),
the settled read-only buffer (:mod:`~lightning_iocatch.capture.buffer`), the flat key of a
captured value (:mod:`~lightning_iocatch.capture.keys`), ``torch.compile`` support
(:mod:`~lightning_iocatch.capture.compiled`), edits of the forward
(:mod:`~lightning_iocatch.capture.edits`) and variants of one forward under several sets of
edits, sharing what comes before them (:mod:`~lightning_iocatch.capture.variants`).
"""

from lightning_iocatch.capture.buffer import CaptureBuffer
from lightning_iocatch.capture.catcher import CaptureSession, ModelIOCatcher, module_index
from lightning_iocatch.capture.edits import (
    Edit,
    Mean,
    Patch,
    PatchWithin,
    Replace,
    RunningMean,
    Steer,
    Zero,
)
from lightning_iocatch.capture.gradients import recording_gradients
from lightning_iocatch.capture.keys import flatten_captures, flatten_value
from lightning_iocatch.capture.snapshots import NotCaptured, snapshot, transfer_to_device
from lightning_iocatch.capture.spec import (
    CaptureSpec,
    format_io_spec,
    parse_io_spec,
    parse_sections,
)
from lightning_iocatch.capture.store_patch import PatchAt, StorePatch
from lightning_iocatch.capture.variants import Variants

__all__ = [
    "CaptureBuffer",
    "CaptureSession",
    "CaptureSpec",
    "Edit",
    "Mean",
    "ModelIOCatcher",
    "NotCaptured",
    "Patch",
    "PatchAt",
    "PatchWithin",
    "Replace",
    "RunningMean",
    "Steer",
    "StorePatch",
    "Variants",
    "Zero",
    "flatten_captures",
    "flatten_value",
    "format_io_spec",
    "module_index",
    "parse_io_spec",
    "parse_sections",
    "recording_gradients",
    "snapshot",
    "transfer_to_device",
]
