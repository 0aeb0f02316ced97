"""The flat key of every captured tensor: ``{module}/{inputs|outputs}[/{path}]``.

One function names captured values for the feature store, the probes' metric names and
the CLI alike. The path walks the captured structure: tuple and list positions, mapping
keys and dataclass fields, e.g. ``model.h.0/outputs/0``, ``model.h.0/inputs/args/0``,
``model.h.0/inputs/kwargs/attention_mask``. A module called more than once in one forward
gets ``@{call}`` after the kind for every call after the first: ``block/outputs@1``.
Leaves that are not tensors (``None``, flags, strings) have no key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from lightning_iocatch.errors import CaptureError

__all__ = ["entry_prefix", "flatten_captures", "flatten_value"]


def entry_prefix(name: str, kind: str, call: int) -> str:
    """The key of call ``call`` of module ``name``'s ``kind``: ``h.0/outputs``, ``h.0/outputs@1``.

    Examples:
        >>> entry_prefix("h.0", "outputs", 0), entry_prefix("h.0", "inputs", 2)
        ('h.0/outputs', 'h.0/inputs@2')
    """
    return f"{name}/{kind}" if call == 0 else f"{name}/{kind}@{call}"


def flatten_value(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for every tensor inside ``value``, keys starting with ``prefix``.

    Examples:
        >>> x = torch.zeros(1)
        >>> [k for k, _ in flatten_value({"args": (x,), "kwargs": {"mask": x}}, "m/inputs")]
        ['m/inputs/args/0', 'm/inputs/kwargs/mask']
    """
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten_value(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from flatten_value(item, f"{prefix}/{position}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from flatten_value(getattr(value, field.name), f"{prefix}/{field.name}")


def flatten_captures(
    captures: Mapping[str, Mapping[str, Iterable[Any]]],
) -> dict[str, torch.Tensor]:
    """Every captured tensor of one batch under its flat key.

    Two captured values that flatten to the same key (a mapping key with ``/``, a key
    equal to a position, a module name with ``/``) are refused with a ``CaptureError``
    naming the key, never overwritten.

    Examples:
        >>> buf = {"h.0": {"inputs": [], "outputs": [(torch.zeros(2, 3), None)]}}
        >>> {k: tuple(v.shape) for k, v in flatten_captures(buf).items()}
        {'h.0/outputs/0': (2, 3)}
    """
    flat: dict[str, torch.Tensor] = {}
    for name, kinds in captures.items():
        for kind, entries in kinds.items():
            for call, entry in enumerate(entries):
                prefix = entry_prefix(name, kind, call)
                for key, tensor in flatten_value(entry, prefix):
                    if key in flat:
                        raise CaptureError(
                            f"two captured values of {name!r} ({kind}, call {call}) flatten to "
                            f"the same key path {key.removeprefix(prefix)!r} (key {key!r}: a "
                            "mapping key with '/', a key equal to a position, or a module name "
                            "with '/'); refusing to overwrite one with the other: rename the "
                            "keys in the model's inputs or outputs"
                        )
                    flat[key] = tensor
    return flat
