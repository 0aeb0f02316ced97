"""The Lightning adapter: the callback, its sinks, the writer sink, the data module, the
effects of edits and the attribution of a behaviour to components, as validation metrics,
the health of activations during training, and sparse autoencoders trained on any
strategy.

Everything here sits on the core (:mod:`lightning_iocatch.capture`,
:mod:`lightning_iocatch.store`, :mod:`lightning_iocatch.probes`); nothing in the core
imports it. :mod:`~lightning_iocatch.lightning.batch_indices` is the one module that reads
Lightning's private internals.
"""

from lightning_iocatch.lightning.attribution import AttributionPatching
from lightning_iocatch.lightning.callback import IOCaptureCallback
from lightning_iocatch.lightning.datamodule import StoreDataModule
from lightning_iocatch.lightning.effects import InterventionEffects
from lightning_iocatch.lightning.feature_writer import FeatureWriter
from lightning_iocatch.lightning.health_monitor import ActivationMonitor, NonFiniteError
from lightning_iocatch.lightning.live import LiveActivations
from lightning_iocatch.lightning.sae import SAEGroup, SAEModule
from lightning_iocatch.lightning.sinks import BatchCaptures, CaptureSink, MemorySink

__all__ = [
    "ActivationMonitor",
    "AttributionPatching",
    "BatchCaptures",
    "CaptureSink",
    "FeatureWriter",
    "IOCaptureCallback",
    "InterventionEffects",
    "MemorySink",
    "LiveActivations",
    "NonFiniteError",
    "SAEGroup",
    "SAEModule",
    "StoreDataModule",
]
