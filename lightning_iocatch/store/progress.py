"""Progress bars for the store's long work, on stderr; whether to show one is the caller's choice.

Exporting a store, verifying its checksums, and on object storage reading many commit
records (opening a store, a resume) and deleting objects (a resume, an overwrite) can take
minutes. The functions that do them take ``progress``: ``True`` shows a ``tqdm`` bar on
``sys.stderr``, ``False`` none, and ``None`` (their default) one only when ``sys.stderr``
is a terminal, so that logs, pipes and notebooks stay as they were. :func:`show_progress`
makes that decision once, where the user's call comes in; inner code receives the decided
``bool`` and opens a :func:`progress_bar` around its loop.

A bar never writes to stdout (the command line's output), is removed from the terminal when
its work ends, also when the work raises (the error passes unchanged), and changes nothing
of what the work reads, writes or returns. While Lightning's loops run, their own progress
bar owns the terminal: a :class:`~lightning_iocatch.FeatureWriter` shows the bar of its resume
or overwrite in ``setup``, before that one starts, and only where the Trainer shows one.

Examples:
    >>> with progress_bar(False, "export", total=3, unit="row") as advance:
    ...     for _ in range(3):
    ...         advance(1)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["Advance", "progress_bar", "show_progress"]

Advance = Callable[[int], object]
"""Moves a bar on by that many units (does nothing where no bar is shown)."""


def show_progress(progress: bool | None) -> bool:
    """Whether to show bars: ``progress`` itself, or for ``None`` whether stderr is a terminal.

    Raises:
        TypeError: ``progress`` is not ``True``, ``False`` or ``None``.
    """
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"`progress` must be True, False or None, got {progress!r}")
    if progress is not None:
        return progress
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed stream
        return False


@contextlib.contextmanager
def progress_bar(show: bool, what: str, *, total: int | None, unit: str) -> Iterator[Advance]:
    """A bar named ``what`` counting ``total`` ``unit`` on stderr while the block runs, if
    ``show``; it yields the function that moves it on, and is closed when the block ends."""
    if not show:
        yield _stay
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def _stay(count: int) -> None:
    """No bar: nothing to move."""
