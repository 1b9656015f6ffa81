"""Processes of a SWARM benchmark run: `atomc swarm serve/train`, each in its own process group
(and optionally a network namespace), all killed with what they started.

    python bench/_swarm_procs.py train OUT.jsonl ARGS...   # atomc swarm train ARGS, logging
                                                          # every message

`train` runs `atomc swarm train` and appends one JSON line per message the trainer sends or receives
(request or response, the call's stage, forward or backward, its encoded bytes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from processes import child_env, kill_tree


class Procs:
    """Named processes started for one run; `close` kills them all (with their children)."""

    def __init__(self, d: Path):
        self.d = d
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []

    def start(self, name: str, argv: list[str], prefix: list[str] | None = None
              ) -> subprocess.Popen:
        log = open(self.d / f"{name}.log", "w")  # closed in close()
        self.logs.append(log)
        proc = subprocess.Popen([*(prefix or []), *argv], env=child_env(), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def atomc(self, name: str, args: list[str], prefix: list[str] | None = None
              ) -> subprocess.Popen:
        return self.start(name, [sys.executable, "-m", "atomc.cli", *args], prefix)

    def wait_file(self, name: str, path: Path, timeout_s: float = 90.0) -> str:
        """The first line of `path` once process `name` has written it."""
        proc, deadline = self.procs[name], time.monotonic() + timeout_s
        while not path.is_file() or not path.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{self.log(name)}")
            time.sleep(0.1)
        return path.read_text().split()[0]

    def wait_entered(self, name: str, metrics: Path, timeout_s: float = 90.0) -> None:
        """Until server `name` serves its stage (its "enter" line in `metrics`): a server
        writes its address before it has its stage's state, and one that failed to get it
        exits; a run that went on without it measured a swarm it did not mean to."""
        proc, deadline = self.procs[name], time.monotonic() + timeout_s
        while not any(x.get("server") == name and x.get("event") == "enter"
                      for x in lines(metrics)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not enter its stage:\n{self.log(name)}")
            time.sleep(0.1)

    def log(self, name: str) -> str:
        p = self.d / f"{name}.log"
        return p.read_text()[-3000:] if p.is_file() else ""

    def kill(self, name: str) -> None:
        """SIGKILL `name`'s process group (p2pd and helpers with it), then its tree."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tree(proc)
        proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.procs):
            try:
                self.kill(name)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for log in self.logs:
            log.close()


def lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for x in path.read_text().splitlines():
        try:
            out.append(json.loads(x))
        except ValueError:
            pass  # a line cut short by a kill
    return out


def train_logged(out: str, argv: list[str]) -> int:
    from atomc import cli
    from atomc.swarm import client

    count = client.message_bytes
    stages = int(argv[argv.index("--stages") + 1])
    f = open(out, "a", buffering=1)
    last: dict = {}

    def logged(messages) -> int:
        (msg,) = messages  # the client counts one message at a time
        n = count(messages)
        header = json.loads(msg.metadata.decode())
        names = [e[0] for e in header["entries"]]
        if type(msg).__name__ == "ExpertRequest":
            stage = header["meta"]["stage"]
            backward = stage == stages - 1 or any(x.startswith("atomc.grad.") for x in names)
            last["call"] = {"stage": stage, "kind": "backward" if backward else "forward"}
            f.write(json.dumps({**last["call"], "msg": "request", "bytes": n}) + "\n")
        else:  # the response to the request counted just before (no await in between)
            f.write(json.dumps({**last["call"], "msg": "response", "bytes": n}) + "\n")
        return n

    client.message_bytes = logged
    return cli.main(["swarm", "train", *argv])


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "train":
        sys.exit(train_logged(sys.argv[2], sys.argv[3:]))
    else:
        sys.exit(__doc__)
