"""Targets for `lightning-iocatch modules` in tests, importable without Lightning (fast)."""

from __future__ import annotations

from torch import nn

WIDTH = 8


class Net(nn.Module):
    """``layers.{i}`` Linear+Tanh blocks and a ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)


def needs_arguments(width: int) -> nn.Module:
    return nn.Linear(width, width)


def not_a_model() -> list[int]:
    return [1, 2]
