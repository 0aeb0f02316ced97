"""The resume rules of a store's record of functions (an edit's, a token selection's): a
function whose behaviour cannot be read from it (see :mod:`lightning_iocatch.fingerprint`)
refuses a resume, unless the user gives it a ``__fingerprint__``, taken as their word.

Examples:
    >>> adopted({"function": "f", "undecidable": "a Foo object"},
    ...         {"function": "f", "fingerprint": "sae-v2"})
    ({'function': 'f', 'fingerprint': 'sae-v2'}, True)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

from lightning_iocatch.errors import StoreError
from lightning_iocatch.fingerprint import undecidable_functions
from lightning_iocatch.store.backends.base import StoreBackend
from lightning_iocatch.store.plan import StorePlan

__all__ = ["adopt_fingerprints", "adopted", "refuse_undecidable"]

_RECORDED = ("edits", "tokens")  # the settings that hold functions


def adopted(stored: Any, now: Any) -> tuple[Any, bool]:
    """``stored`` with each function recorded as undecidable replaced by ``now``'s record
    of it where ``now`` gives it a fingerprint (same function name, same place); and
    whether any was."""
    if isinstance(stored, dict) and isinstance(now, dict):
        if (
            "undecidable" in stored
            and "fingerprint" in now
            and stored.get("function") == now.get("function")
        ):
            return now, True
        if set(stored) != set(now):
            return stored, False
        pairs = {key: adopted(stored[key], now[key]) for key in stored}
        return {key: pair[0] for key, pair in pairs.items()}, any(p[1] for p in pairs.values())
    if isinstance(stored, list) and isinstance(now, list) and len(stored) == len(now):
        items = [adopted(one, other) for one, other in zip(stored, now, strict=True)]
        return [item[0] for item in items], any(item[1] for item in items)
    return stored, False


def adopt_fingerprints(backend: StoreBackend, mode: str, settings: Mapping[str, Any]) -> None:
    """Before a resume: where the store recorded a function as undecidable and this run
    gives it a ``__fingerprint__``, record the fingerprint (the user's word that it is the
    same function), so that the resume compares it from now on."""
    if mode != "resume" or not backend.has_info():
        return
    info = backend.read_info()
    changed = False
    for name in _RECORDED:
        now = json.loads(json.dumps(settings.get(name)))  # as a store reads it back
        record, adopted_here = adopted(info.get(name), now)
        if adopted_here:
            info[name], changed = record, True
    if changed:
        backend.write_info(info)


def refuse_undecidable(backend: object, settings: Mapping[str, Any], plan: StorePlan) -> None:
    """Refuse to add rows to a store whose rows were captured under a function that cannot
    be compared with this run's; a dump that starts empty only warns that it cannot be
    resumed."""
    found = [
        f"{name}: {function}"
        for name in _RECORDED
        for function in undecidable_functions(settings.get(name))
    ]
    if not found:
        return
    listed = "; ".join(found)
    fix = (
        "give each such function (or callable object) a `__fingerprint__` string that "
        'changes when what it computes does (`fn.__fingerprint__ = "my-sae-v2"`): it is '
        "recorded instead"
    )
    if not any(plan.committed.values()):
        warnings.warn(
            f"this dump to {backend} cannot be resumed: what these functions compute cannot "
            f"be read from them, so a resume could not tell it is the same ({listed}); {fix}",
            UserWarning,
            stacklevel=3,
        )
        return
    raise StoreError(
        f"cannot resume {backend}: its rows were captured under functions whose behaviour "
        f"cannot be read from them ({listed}), so this run's could differ and the store "
        f"would mix rows of two different computations. If they are the same, {fix}, and "
        "the resume takes it as your word; else use mode='overwrite' (or another path)"
    )
