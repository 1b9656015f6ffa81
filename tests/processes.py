"""Process-tree helpers for tests that start torchrun or hivemind: kill everything they started.

torchrun starts each worker in a session of its own and hivemind starts its DHT, averager and
p2p daemon as children, so killing the launcher's process group alone leaves processes behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import forkserver

ROOT = Path(__file__).resolve().parents[1]
# make test's pytest-xdist workers (tests/conftest.py) run the tests marked with this one after
# another on one worker: tests that start processes by the handful, and tests whose assertions
# time the machine, which those processes would slow. The other worker runs one torch thread.
SERIAL = pytest.mark.xdist_group("serial")


def child_env() -> dict[str, str]:
    """The environment of an `atomc` child process: this checkout importable, one torch thread
    each (several share the cores), hivemind's errors only."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="ERROR",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _parents() -> dict[int, int]:
    """Each process's parent; a child of the tests' fork server counts as its launcher's."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    parent.update((c, p) for c, p in forkserver.launchers().items() if c in parent)
    return parent


def children(pid: int) -> list[int]:
    return [c for c, p in _parents().items() if p == pid]


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    parent = _parents()
    out, todo = {pid}, [pid]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in out:
                out.add(c)
                todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` and of every descendant, then each process itself."""
    for pid in descendants(proc.pid):
        for kill in (lambda p=pid: os.killpg(os.getpgid(p), signal.SIGKILL),
                     lambda p=pid: os.kill(p, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
