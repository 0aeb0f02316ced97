"""Live activations: a frozen model's activations as training batches, without a dump
(:class:`LiveActivations`), and the mixing buffer they are drawn from."""

from lightning_iocatch.lightning.live.datamodule import LiveActivations

__all__ = ["LiveActivations"]
