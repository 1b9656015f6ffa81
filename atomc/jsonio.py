"""Atomic file and directory writes, checked JSON reads, and the canonical hash of a JSON
document.

Nothing a user wrote or trained is lost: every write goes to a temporary file (or directory) in
the same directory and is renamed over the target, so a crash leaves either the old one or the
new.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from atomc.errors import AtomcError, IRError


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    mode = "wb" if isinstance(data, bytes) else "w"

    def write(f: IO) -> None:
        f.write(data)

    return write_atomic_with(path, write, mode)


def write_atomic_with(path: str | os.PathLike, write: Callable[[IO], None], mode: str = "wb",
                      error: type[AtomcError] = IRError) -> Path:
    """Write through `write(file)` into a temporary file beside `path`, then rename it over."""
    target = Path(path)
    if target.is_dir():
        raise error(f"cannot write {target}: it is a directory; give a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory that holds it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # file systems without directory fsync
        pass
    finally:
        os.close(fd)


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` into place as `out`; an existing `out` is replaced
    whole, and restored when the rename fails."""
    if not out.exists():
        os.rename(tmp, out)
    else:
        backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rmdir(backup)
        os.rename(out, backup)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(backup, out)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    _fsync_dir(out.parent)


@contextmanager
def write_dir_atomic(out: Path) -> Iterator[Path]:
    """A new temporary directory beside `out` to write into. When the block finishes, its files
    are synced, it gets normal permissions and is renamed into place (see `replace_dir`); when
    the block raises, it is removed and `out` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def umask() -> int:
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
        raise IRError(f"{p} is not valid JSON ({e}); expected a {kind} file written by "
                      f"atomc") from None


def canonical_hash(data: Any, default: Callable[[Any], Any] | None = None) -> str:
    """sha256 of `data` as canonical JSON (sorted keys, no spaces), 16 hex digits: the names
    documents go by in later stages (plan hashes, profile and graph hashes). `default` is
    json.dumps's hook for objects it cannot encode itself."""
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), default=default)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
