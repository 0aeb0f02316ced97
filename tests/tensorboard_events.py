"""The events of TensorBoard event files, read without TensorBoard: record by record (its
length, the length's CRC, the event, its CRC) with tensorboardX's protocol buffers."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def events(directory: Path | str) -> Iterator[Any]:
    """Every event of the event files under ``directory``, file by file, in order."""
    from tensorboardX.proto.event_pb2 import Event

    for path in Path(directory).rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            yield Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
