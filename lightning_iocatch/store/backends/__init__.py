"""Where a store lives: a local directory, or a prefix on object storage through fsspec.

:func:`open_backend` turns a path or URL into a :class:`StoreBackend`; everything above
the backends works through that interface (:mod:`~lightning_iocatch.store.backends.base`)
and its :class:`Shard`, never asking where a store is.
"""

from lightning_iocatch.store.backends.base import Shard, StoreBackend
from lightning_iocatch.store.backends.local import LocalBackend
from lightning_iocatch.store.backends.location import open_backend
from lightning_iocatch.store.backends.object_location import ObjectLocation
from lightning_iocatch.store.backends.objects import ObjectBackend

__all__ = [
    "LocalBackend",
    "ObjectBackend",
    "ObjectLocation",
    "Shard",
    "StoreBackend",
    "open_backend",
]
