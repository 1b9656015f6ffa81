"""SWARM server, its metrics file (`--metrics FILE`): one JSON line per event it reports."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Metrics:
    """Appends events to `path` (nothing when it is None), each with the server's name, its
    peer id and the wall-clock time."""

    def __init__(self, path: str | Path | None, name: str, peer: str):
        self.path, self.name, self.peer = path, name, peer

    @property
    def on(self) -> bool:
        """Whether events are written: a caller skips the work of one that is not."""
        return self.path is not None

    def write(self, line: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = {"server": self.name, "peer": self.peer, "time": time.time(), **line}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


__all__ = ["Metrics"]
