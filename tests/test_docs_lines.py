"""No code line of the README or the docs is wider than 88 characters.

At 1280 px the site's code column shows about 88 characters; a longer line is cut and
needs a sideways scroll (a cut comment on the command-line page hid half of each
command's meaning). Every line inside a fenced block counts, measured from the fence's
own indentation (a block inside an admonition is indented by it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WIDTH = 88
FENCE = re.compile(r"^(\s*)(```|~~~)")


def long_code_lines(text: str) -> list[tuple[int, int]]:
    """``(line number, width)`` of each line in a fenced block wider than ``WIDTH``."""
    found = []
    fence: tuple[str, str] | None = None  # (indentation, marker) of the open block
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = (match.group(1), match.group(2))
            continue
        if match and match.group(2) == fence[1] and not line.strip()[3:].strip():
            fence = None
            continue
        indent = fence[0]
        code = line[len(indent) :] if line.startswith(indent) else line.lstrip()
        if len(code) > WIDTH:
            found.append((number, len(code)))
    assert fence is None, "a fenced block is never closed"
    return found


def test_the_line_counter_against_hand_counted_lines() -> None:
    text = "\n".join(
        [
            "prose " * 30,  # outside a block: free
            "```python",
            "x" * 88,  # exactly the limit
            "y" * 89,  # line 4: one over
            "```",
            '??? note "details"',
            "    ```bash",
            "    " + "z" * 88,  # indented by the admonition: 88 once the indent is off
            "    " + "w" * 90,  # line 9
            "    ```",
        ]
    )
    assert long_code_lines(text) == [(4, 89), (9, 90)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_code_line_fits_the_column(page: Path) -> None:
    long = long_code_lines(page.read_text())
    where = ", ".join(f"line {number} ({width} chars)" for number, width in long)
    assert not long, f"{page.relative_to(ROOT)}: code wider than {WIDTH} characters: {where}"
