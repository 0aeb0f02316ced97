"""Close matches for error messages: "did you mean `model.layers.1`?".

Shared by the capture spec (module names) and the store (keys), so that a suggestion
keeps every number of the request: ``layers.12`` is never "close" to ``layers.1``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = ["NUMBER", "close_names", "numbers"]

NUMBER = re.compile(r"-?\d+")  # "-1" is its own index (not 1): never suggest layer 1


def close_names(name: str, available: Iterable[str], cutoff: float = 0.6) -> list[str]:
    """Up to three names of ``available`` close to ``name`` that keep all its numbers.

    Names that end with ``"." + name`` (a prefix left out) come first; otherwise
    ``difflib`` picks among the names with the same numbers, in the same order.

    Examples:
        >>> close_names("layers.1", ["model.layers.1", "model.layers.11", "model.layer.1"])
        ['model.layers.1']
        >>> close_names("model.layers.12", ["model.layers.1", "model.layers.2"])
        []
    """
    wanted = numbers(name)
    same_numbers = [n for n in available if numbers(n) == wanted]
    close = [n for n in same_numbers if n.endswith("." + name)][:3]  # a prefix left out
    return close or difflib.get_close_matches(name, same_numbers, n=3, cutoff=cutoff)


def numbers(name: str) -> tuple[int, ...]:
    """The numbers in ``name``, in order: ``(1, 12)`` for ``"h.1.mlp.12"``."""
    return tuple(int(number) for number in NUMBER.findall(name))
