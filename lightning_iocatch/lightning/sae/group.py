"""SAEGroup: several sparse autoencoders trained from the same batches, each with its own
optimizer, schedule, counts and logs: with :class:`~lightning_iocatch.LiveActivations`,
one forward of the model feeds them all (other layers, other hyperparameters).

Examples:
    >>> group = SAEGroup({
    ...     "k16": SAEModule(32, 128, "topk", k=16, key="h"),
    ...     "k32": SAEModule(32, 128, "topk", k=32, key="h"),
    ... })
    >>> sorted(group.members)
    ['k16', 'k32']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from typing_extensions import override

from lightning_iocatch.lightning.sae.module import SAEModule

__all__ = ["SAEGroup"]


class SAEGroup(pl.LightningModule):
    """Trains each :class:`SAEModule` of ``members`` on every batch, one after the other.

    Each member reads its own ``key`` of the batch and steps its own Adam and schedule; its
    figures are logged under its name (``{name}/train/mse``, ``{name}/val/l0``...). A
    member's ``language_model=`` evaluation is not run in a group (train it alone for that).

    Args:
        members: name -> SAEModule (names without ``/``).
    """

    def __init__(self, members: Mapping[str, SAEModule]) -> None:
        super().__init__()
        if not members:
            raise ValueError("SAEGroup needs at least one member")
        for name, member in members.items():
            if not isinstance(member, SAEModule):
                raise TypeError(
                    f"SAEGroup: member {name!r} is a {type(member).__name__}, not an SAEModule"
                )
            if not name or "/" in name or "." in name:
                raise ValueError(f"SAEGroup: member names are plain words, got {name!r}")
            if member.layer is not None:
                raise ValueError(
                    f"SAEGroup: member {name!r} has a language_model to evaluate on, which a "
                    "group does not run: train it alone for that, or drop the option"
                )
        self.automatic_optimization = False
        self.members = nn.ModuleDict(dict(members))
        for name, member in members.items():
            object.__setattr__(member, "_owner", self)  # not a submodule: no cycle
            member._prefix = f"{name}/"

    def _each(self) -> list[SAEModule]:
        return list(self.members.values())  # type: ignore[arg-type]

    @override
    def setup(self, stage: str) -> None:
        for member in self._each():  # a ModuleDict stops Lightning's own propagation
            member.trainer = self.trainer
        ddp = getattr(self.trainer.strategy, "_ddp_kwargs", None)  # DDPStrategy's options
        if (
            self.trainer.world_size > 1
            and ddp is not None
            and not ddp.get("find_unused_parameters")
        ):
            raise ValueError(
                "SAEGroup: each member steps apart (its own backward), which DDP's default "
                "reducer refuses as unused parameters; use Trainer(strategy="
                '"ddp_find_unused_parameters_true")'
            )

    @override
    def configure_model(self) -> None:
        for member in self._each():
            member.configure_model()

    @override
    def configure_optimizers(self) -> Any:
        return [member.configure_optimizers() for member in self._each()]

    @override
    def on_train_start(self) -> None:
        for member in self._each():
            member.on_train_start()

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        optimizers: Any = self.optimizers()
        schedules: Any = self.lr_schedulers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedules = schedules if isinstance(schedules, list) else [schedules]
        losses = []
        for member, optimizer, schedule in zip(self._each(), optimizers, schedules, strict=True):
            member._assigned = (optimizer, schedule)
            loss = member.training_step(batch, batch_idx)
            if loss is not None:
                losses.append(loss)
        return sum(losses) if losses else None  # type: ignore[return-value]

    @override
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for member in self._each():  # the member whose optimizer this is clips its gradients
            assigned = member._assigned
            if assigned is not None and optimizer in (assigned[0], assigned[0].optimizer):
                member._clip(optimizer)

    @override
    def on_validation_epoch_start(self) -> None:
        for member in self._each():
            member.on_validation_epoch_start()

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        for member in self._each():
            member.validation_step(batch, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        for member in self._each():
            member.on_validation_epoch_end()
