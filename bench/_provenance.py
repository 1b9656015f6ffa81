"""Where a bench's numbers came from: the commit and the lines that open its RESULTS section
(date, machine, load, commit, command)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's short commit, "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def provenance(t0: float) -> str:
    """Date, the time since `t0`, the machine, torch, the load at the end, the commit."""
    import torch

    return (f"Date {datetime.date.today()} ({time.time() - t0:.0f} s); machine "
            f"{platform.machine()}, {os.cpu_count()} CPU cores, Linux {platform.release()}, "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end; "
            f"commit {commit()} (with the working tree's changes).")


def header(title: str, cmd: str, t0: float) -> list[str]:
    """A RESULTS section's title, provenance and command."""
    return [f"## {title}", "", provenance(t0), "", f"Command: `{cmd}`", ""]
