"""Runtime stage, checkpoints: a trainer's state <-> one file, written atomically, verified on read.

Write: torch.save to a temporary file in the target's directory, flush, fsync, rename over the
target, fsync the directory; a crash leaves either the old checkpoint or the new one. The file
carries a sha256 over every tensor's bytes (and the plain values around them).

Read: a file that does not unpickle, is not an atomc swap checkpoint, is of another format
version, or whose checksum does not match is refused with RuntimeMismatchError; nothing is
loaded and nothing is written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from atomc.errors import RuntimeMismatchError
from atomc.jsonio import write_atomic_with

FORMAT = "atomc.swap-checkpoint"
VERSION = 1


def checksum(obj: Any) -> str:
    """sha256 over a nested structure of dicts, lists, tensors and plain values, in a fixed
    order."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def digest(obj: Any) -> str:
    """A short name for the exact bits of `obj` (weights, say): `checksum`'s first 16 hex
    digits, for logs and metrics that compare copies."""
    return checksum(obj)[:16]


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                     else t.to(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(b"D")
        for key in sorted(obj, key=lambda k: (type(k).__name__, str(k))):
            h.update(repr(key).encode())
            _feed(h, obj[key])
        h.update(b"d")
    elif isinstance(obj, (list, tuple)):
        h.update(b"L")
        for x in obj:
            _feed(h, x)
        h.update(b"l")
    else:
        h.update(repr(obj).encode())


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` with its checksum; a crash leaves the old checkpoint or the new one."""
    payload = {"format": FORMAT, "version": VERSION, "checksum": checksum(state), "state": state}
    return write_atomic_with(path, lambda f: torch.save(payload, f), "wb", RuntimeMismatchError)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The verified state in a checkpoint file (RuntimeMismatchError if it is not intact)."""
    p = Path(path)
    if not p.is_file():
        raise RuntimeMismatchError(f"checkpoint {p} does not exist; give a file written by "
                                   f"SwapTrainer.save_checkpoint (or `atomc train --checkpoint`)")
    try:  # memory-mapped: the masters and optimizer states are copied from the file's pages
        payload = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: re-raised as a user error
        raise RuntimeMismatchError(
            f"checkpoint {p} is corrupt or not a torch file ({type(e).__name__}: {str(e)[:200]}); "
            f"nothing was loaded: use an intact checkpoint") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise RuntimeMismatchError(f"{p} is not an atomc swap checkpoint (format {found!r}); "
                                   f"nothing was loaded")
    if payload.get("version") != VERSION:
        raise RuntimeMismatchError(f"checkpoint {p} has format version "
                                   f"{payload.get('version')!r}; this atomc reads version "
                                   f"{VERSION}; nothing was loaded")
    state = payload.get("state")
    if not isinstance(state, dict) or checksum(state) != payload.get("checksum"):
        raise RuntimeMismatchError(f"checkpoint {p} fails its checksum: the file is damaged; "
                                   f"nothing was loaded: use an intact checkpoint")
    return state
