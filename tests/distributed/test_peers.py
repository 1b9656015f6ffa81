"""Peers (ATOM's decentralized mode on hivemind): three local peers average after every global
batch; one is killed (its whole process group), the other two keep averaging, a new peer joins
through a survivor and downloads the state; the survivors end with the same weights and a
falling loss. And a peer address that never answers is a clear error in bounded time.

Everything binds to 127.0.0.1 with NAT traversal and relays off; every peer runs in a process
group of its own, killed as a whole afterwards; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.runtime.checkpoint import load_checkpoint
from atomc.trace import trace_model

from processes import SERIAL, kill_tree

pytestmark = SERIAL
ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"
SCRIPT = ROOT / "examples" / "train_peer.py"
ROUNDS = 16


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("peers")
    traced = trace_model(GPT, "tiny", 2)
    generate(plan_from_cuts(traced, [9, 39]), d / "pkg", traced=traced)
    return d / "pkg"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HIVEMIND_LOGLEVEL": "ERROR", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def _peer(pkg: Path, d: Path, name: str, initial: list[str], *,
          via_cli: bool = False) -> subprocess.Popen:
    args = ["--package", str(pkg), "--name", name, "--rounds", str(ROUNDS),
            "--target-batch-size", "24", "--accum", "2", "--lr", "3e-3",
            "--matchmaking-time", "1.5", "--averaging-timeout", "20",
            "--connect-timeout", "20", "--max-seconds", "150",
            "--metrics", str(d / f"{name}.jsonl"),
            "--final", str(d / f"{name}.pt"), "--maddr-file", str(d / f"{name}.maddr")]
    if via_cli:
        argv = [sys.executable, "-m", "atomc.cli", "peer",
                *[x for a in initial for x in ("--initial-peers", a)], str(SCRIPT), *args]
    else:
        argv = [sys.executable, str(SCRIPT), *args, "--initial-peers", *initial]
    log = open(d / f"{name}.log", "w")  # the peer writes to it until it ends
    return subprocess.Popen(argv, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _events(d: Path, name: str) -> list[dict]:
    path = d / f"{name}.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


@pytest.mark.slow
def test_peers_average_survive_a_death_and_a_join(pkg: Path, tmp_path: Path) -> None:
    d = tmp_path
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["A"] = _peer(pkg, d, "A", [], via_cli=True)  # `atomc peer` starts the run
        _wait_for(lambda: (d / "A.maddr").exists() or procs["A"].poll() is not None, 60,
                  "peer A's address")
        assert procs["A"].poll() is None, (d / "A.log").read_text()
        a_addr = (d / "A.maddr").read_text().split()[0]
        procs["B"] = _peer(pkg, d, "B", [a_addr])
        procs["C"] = _peer(pkg, d, "C", [a_addr])

        def c_averaged() -> bool:
            return any(e["event"] == "round" and e["ok"] and "C" in e["group"]
                       for e in _events(d, "C"))

        _wait_for(c_averaged, 90, "peer C to average with the others")
        os.killpg(procs["C"].pid, signal.SIGKILL)  # C dies mid-run, with its DHT and p2p daemon
        procs["C"].wait(timeout=10)
        killed_at = time.time()
        # B writes its address once its DHT is up, which may be after C's first round
        _wait_for(lambda: (d / "B.maddr").exists() or procs["B"].poll() is not None, 60,
                  "peer B's address")
        assert procs["B"].poll() is None, (d / "B.log").read_text()[-3000:]
        b_addr = (d / "B.maddr").read_text().split()[0]
        procs["D"] = _peer(pkg, d, "D", [b_addr])  # joins through any live peer

        for name in ("A", "B", "D"):
            try:
                procs[name].wait(timeout=170)
            except subprocess.TimeoutExpired:
                log = (d / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"peer {name} did not finish:\n{log}") from None
            assert procs[name].returncode == 0, (d / f"{name}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            kill_tree(p)

    ev = {n: _events(d, n) for n in "ABCD"}
    # the survivors kept averaging with each other after C died
    after = [e for e in ev["A"] if e["event"] == "round" and e["time"] > killed_at + 1]
    assert sum(1 for e in after
               if e["ok"] and {"A", "B"} <= set(e["group"]) and "C" not in e["group"]) >= 2
    # D joined through B, downloaded the state of a round in progress, and averaged with the others
    joined = [e for e in ev["D"] if e["event"] == "joined"]
    assert joined and joined[0]["epoch"] >= 1
    assert any(e["event"] == "round" and e["ok"] and len(e["group"]) >= 2 for e in ev["D"])
    # every survivor did all rounds and ends with the same weights
    finals = {n: load_checkpoint(d / f"{n}.pt") for n in "ABD"}
    assert all(f["epoch"] == ROUNDS for f in finals.values())
    ref = finals["A"]["params"]
    for n in "BD":
        worst = max((finals[n]["params"][k] - v).abs().max().item() for k, v in ref.items())
        assert worst <= 1e-6, (n, worst)
    # and the loss fell
    for n in "AB":
        losses = [e["loss"] for e in ev[n] if e["event"] == "step"]
        assert len(losses) >= 10
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_peer_address_that_never_answers(pkg: Path, tmp_path: Path) -> None:
    """An initial peer that accepts TCP connections but never speaks: a clear error, bounded."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWStBjA5fhZQM3jdJjBFgEfGkFqkgvTDi39aX6Bchtd9gy"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--package", str(pkg), "--name", "lonely",
                             "--connect-timeout", "5", "--initial-peers", addr], env=_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_tree(proc)
        stop.set()
        th.join(2)
        for c in held:
            c.close()
        server.close()
    assert proc.returncode == 2, out
    assert "could not join the peers through" in out and str(port) in out
    assert time.monotonic() - t0 < 90


def test_peer_cli_checks_addresses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from atomc.cli import main

    assert main(["peer", "--initial-peers", "not-an-address", str(SCRIPT), "--package", "x"]) == 2
    assert "not a multiaddress" in capsys.readouterr().err
    assert main(["peer", "--print", "--run-id", "r1", "--target-batch-size", "64",
                 "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/Qm", str(SCRIPT),
                 "--package", "x"]) == 0
    out = capsys.readouterr().out
    assert ("ATOMC_PEER_RUN_ID=r1" in out and "ATOMC_PEER_TARGET_BATCH_SIZE=64" in out
            and "--package x" in out)

