"""Sparse autoencoders without Lightning: the model and its math (TopK, BatchTopK,
JumpReLU, ReLU with L1), its training losses, and SAELens' checkpoint format. The
LightningModule that trains one is :class:`~lightning_iocatch.lightning.sae.SAEModule`.

Examples:
    >>> import torch
    >>> sae = SparseAutoencoder(8, 32, "batchtopk", k=4)
    >>> sae.eval().encode(torch.randn(2, 8)).shape
    torch.Size([2, 32])
"""

from lightning_iocatch.sae.losses import TrainingObjective, TrainingStep, training_losses
from lightning_iocatch.sae.model import ARCHITECTURES, Architecture, SparseAutoencoder
from lightning_iocatch.sae.saelens_format import SAELENS_VERSION, load_saelens, save_saelens

__all__ = [
    "ARCHITECTURES",
    "SAELENS_VERSION",
    "Architecture",
    "SparseAutoencoder",
    "TrainingObjective",
    "TrainingStep",
    "load_saelens",
    "save_saelens",
    "training_losses",
]
