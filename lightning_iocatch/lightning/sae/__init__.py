"""The Lightning side of sparse autoencoders: :class:`SAEModule` trains one on any
strategy, counting what SAELens counts in one process over every process's rows;
:class:`SAEGroup` trains several from the same batches."""

from lightning_iocatch.lightning.sae.group import SAEGroup
from lightning_iocatch.lightning.sae.module import SAEModule

__all__ = ["SAEGroup", "SAEModule"]
