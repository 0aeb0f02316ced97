"""The Lightning side of sparse autoencoders: :class:`SAEModule` trains one on any
strategy, counting what SAELens counts in one process over every process's rows."""

from lightning_iocatch.lightning.sae.module import SAEModule

__all__ = ["SAEModule"]
