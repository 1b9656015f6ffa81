"""Atomic JSON and text writes, and checked JSON reads.

Nothing a user wrote or trained is lost: every write goes to a temporary file in the same
directory and is renamed over the target, so a crash leaves either the old file or the new.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from atomc.errors import IRError


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    target = Path(path)
    if target.is_dir():
        raise IRError(f"cannot write {target}: it is a directory; give a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike, kind: str) -> Any:
    """Parse `path`, naming the file and the kind of document expected when it fails."""
    p = Path(path)
    if not p.exists():
        raise IRError(f"{kind} file {p} does not exist; check the path")
    if p.is_dir():
        raise IRError(f"{kind} file {p} is a directory; give the JSON file inside it")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IRError(f"{p} is not valid JSON ({e}); expected a {kind} file written by atomc") from None
