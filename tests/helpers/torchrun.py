"""A layout's training script (examples/train_layout.py) launched with torchrun on loopback,
as `atomc launch` builds the command, and run to its end or killed, process tree and all, at
a time limit (test_distributed, test_layouts_equal_plain_training)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from atomc.distributed.launch import build_command

from processes import kill_tree

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_layout.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict[str, str]:
    """The environment of a launched process: this checkout importable, gloo on loopback, one
    torch thread each."""
    env = dict(os.environ)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchrun_command(layout: Path, script_args: list[str], *, max_restarts: int = 0,
                     network: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """torchrun's argv and the environment it adds, for TRAIN over `layout`."""
    cmd = build_command(layout, str(TRAIN), script_args, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                        max_restarts=max_restarts, network=network)
    return list(cmd.argv), cmd.env


def run_bounded(argv: list[str], env_add: dict[str, str],
                timeout_s: float) -> subprocess.CompletedProcess:
    """`argv` run to its end in a session of its own (stdout and stderr together); past
    `timeout_s` its process tree is killed and the run fails with the output's tail."""
    env = launch_env()
    env.update(env_add)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"run exceeded {timeout_s} s:\n{out[-4000:]}") from None
    finally:
        kill_tree(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")
