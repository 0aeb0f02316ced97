"""The store: what a dump is, wherever it lives, with no Lightning and no capture.

The format (:mod:`~lightning_iocatch.store.names`, :mod:`~lightning_iocatch.store.records`,
:mod:`~lightning_iocatch.store.commits`, :mod:`~lightning_iocatch.store.shard_file`), the
places a store lives (:mod:`lightning_iocatch.store.backends`), the writing core
(:mod:`~lightning_iocatch.store.plan`, :mod:`~lightning_iocatch.store.exactly_once`,
:mod:`~lightning_iocatch.store.writer`), reading (:mod:`~lightning_iocatch.store.reader`),
the training reader (:mod:`~lightning_iocatch.store.training`), export
(:mod:`~lightning_iocatch.store.export`) and token rows
(:mod:`~lightning_iocatch.store.tokens`).
"""

from lightning_iocatch.store.export import ExportError, export_dataset
from lightning_iocatch.store.plan import MODES, Mode, StorePlan, prepare_store
from lightning_iocatch.store.reader import FeatureStore, OnDuplicate
from lightning_iocatch.store.sample_rows import SampleRows
from lightning_iocatch.store.tokens import TokenRows, TokenSelection
from lightning_iocatch.store.training import StoreRows
from lightning_iocatch.store.writer import ShardWriter

__all__ = [
    "MODES",
    "ExportError",
    "FeatureStore",
    "Mode",
    "OnDuplicate",
    "SampleRows",
    "ShardWriter",
    "StorePlan",
    "StoreRows",
    "TokenRows",
    "TokenSelection",
    "export_dataset",
    "prepare_store",
]
