"""A griffe extension for the docs site: the docstrings' Sphinx roles as code.

The docstrings name objects the Sphinx way (``:class:`~lightning_iocatch.FeatureStore```),
which Markdown would show as ``:class:`` followed by the path. This shows the name as code
(``FeatureStore``: the last component where the role has ``~``, else the whole path).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    short, target = match.groups()
    if "<" in target and target.endswith(">"):  # :meth:`shown <target>`
        return f"`{target.split('<')[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class RstRoles(griffe.Extension):
    """Rewrites each loaded object's docstring once."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
