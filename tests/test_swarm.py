"""SWARM on loopback: servers and trainers as real processes (`atomc swarm serve/train`).

A swarm of 2 stages x 2-3 servers trains, in float64, to the weights of single-process training
on the same global batches, whatever the routing; a server SIGKILLed in the middle of a step
changes nothing (its micro-batches are sent again, none counted twice); a stage left without
servers gets one by rebalancing, from its latest state. Every process runs in its own process
group, binds to 127.0.0.1, has a bounded time and is killed with all it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import UsageError
from atomc.runtime.checkpoint import load_checkpoint
from atomc.runtime.package import load_swap_package
from atomc.runtime.rng import micro_batch_rng
from atomc.swarm.client import Router
from atomc.swarm.records import ServerRecord
from atomc.swarm.server import stage_specs
from atomc.trace import trace_model
from atomc.trace.load import load_model_file

from processes import kill_tree

hivemind = pytest.importorskip("hivemind")

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
CONFIG, MICRO, GLOBAL = "tiny-untied", 2, 8
gpt = load_model_file(GPT)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("swarm")
    traced = trace_model(GPT, CONFIG, MICRO)
    plan = plan_from_cuts(traced, [9, 25, 39, 55])
    generate(plan, d / "pkg", traced=traced)
    tied = trace_model(GPT, "tiny", MICRO)
    generate(plan_from_cuts(tied, [9, 25, 39, 55]), d / "tied", traced=tied)
    return {"dir": d, "pkg": d / "pkg", "tied": d / "tied"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="ERROR",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


class Swarm:
    """Processes started for one test; all killed (with their children) at the end."""

    def __init__(self, d: Path, pkg: Path, stages: int = 2):
        self.d, self.pkg, self.stages = d, pkg, stages
        self.procs: dict[str, subprocess.Popen] = {}
        self.first: str | None = None

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.d / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "atomc.cli", *argv], env=_env(), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def serve(self, name: str, stage: int | str, *extra: str) -> None:
        addr = self.d / f"{name}.addr"
        argv = ["swarm", "serve", str(self.pkg), "--stages", str(self.stages), "--stage",
                str(stage), "--target-batch-size", str(GLOBAL), "--dtype", "float64",
                "--name", name, "--maddr-file", str(addr), "--metrics",
                str(self.d / "servers.jsonl"), "--checkpoint-dir", str(self.d / "ckpt"),
                "--max-seconds", "240", *extra]
        if self.first:
            argv += ["--initial-peers", self.first]
        proc = self._start(name, argv)
        deadline = time.monotonic() + 60
        while not addr.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server {name} did not start:\n{self.log(name)}")
            time.sleep(0.2)
        self.first = self.first or addr.read_text().split()[0]

    def train(self, steps: int, *extra: str, timeout_s: float = 200) -> subprocess.Popen:
        return self._start("trainer", [
            "swarm", "train", str(self.pkg), "--stages", str(self.stages), "--steps", str(steps),
            "--batch-size", str(GLOBAL), "--data", "random", "--initial-peers", self.first,
            "--metrics", str(self.d / "trainer.jsonl"), "--request-timeout", "10", *extra])

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> None:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the trainer took longer than {timeout_s} s:\n"
                                 f"{self.log('trainer')}\n{self.logs()}") from None
        assert proc.returncode == 0, f"{self.log('trainer')}\n{self.logs()}"

    def log(self, name: str) -> str:
        p = self.d / f"{name}.log"
        return p.read_text()[-3000:] if p.is_file() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs if n != "trainer")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)  # the server's group: p2pd and helpers with it
        kill_tree(proc)

    def close(self) -> None:
        for proc in self.procs.values():
            kill_tree(proc)
            proc.wait(timeout=10)


@pytest.fixture
def swarm_of(work: dict, tmp_path: Path):
    made: list[Swarm] = []

    def make(pkg: Path | None = None, stages: int = 2) -> Swarm:
        s = Swarm(tmp_path, pkg or work["pkg"], stages)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process float64 training on the trainer's batches, micro-batch by micro-batch
    under the runtime's RNG rule (dropout), with the servers' AdamW."""
    torch.manual_seed(0)
    model = gpt.build_model(CONFIG).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for s in range(steps):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((0 * 1_000_003 + s) * 1_009 + 0)
            (x,) = gpt.example_inputs(model, GLOBAL)
        opt.zero_grad()
        total = 0.0
        for m in range(GLOBAL // MICRO):
            xb = x[m * MICRO:(m + 1) * MICRO]
            with micro_batch_rng(0, s, m):
                loss = gpt.loss_fn(model(xb), (xb,))
            (loss / (GLOBAL // MICRO)).backward()
            total += loss.item()
        opt.step()
        losses.append(total / (GLOBAL // MICRO))
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _check_against_reference(d: Path, steps: int, loss_tol: float = 1e-9) -> None:
    ref, ref_losses = reference(steps)
    got = {}
    for j in range(2):
        state = load_checkpoint(d / "ckpt" / f"stage{j}.pt")
        assert state["step"] == steps
        got.update(state["params"])
    assert set(got) == set(ref)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 1e-9, worst
    losses = [x["loss"] for x in _lines(d / "trainer.jsonl")]
    assert len(losses) == steps
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= loss_tol
    # every server of a stage took every step with the same weights
    digests: dict[tuple[int, int], set[str]] = {}
    for x in _lines(d / "servers.jsonl"):
        if x["event"] == "step":
            digests.setdefault((x["stage"], x["step"]), set()).add(x["digest"])
    assert all(len(v) == 1 for v in digests.values()), digests


# ---------------------------------------------------------------------------------------------
# pure parts


def test_router_weighted_round_robin_and_bans() -> None:
    r = Router(1, ban_s=1.0)
    recs = [ServerRecord(p, p, 0, 0, 0, 1.0, 0, "x", 0.0) for p in ("a", "b")]
    r.refresh(recs)
    r.report(0, "a", 1.0, 1)  # a: 1 s per sample
    r.report(0, "b", 2.0, 1)  # b: 2 s per sample
    picks = [r.choose(0, 1, now=0.0) for _ in range(30)]
    assert abs(picks.count("a") - 2 * picks.count("b")) <= 2  # twice as fast, twice the work
    assert r.ban(0, "a", now=10.0) == 1.0 and r.ban(0, "a", now=10.0) == 2.0  # backoff doubles
    assert {r.choose(0, 1, now=10.5) for _ in range(5)} == {"b"}
    assert r.choose(0, 1, now=10.5, avoid={"b"}) == "a"  # all banned: try anyway
    r.refresh([ServerRecord("a", "a", 0, 0, 0, 1.0, 0, "x", 5.0), recs[1]])  # new incarnation
    assert r.stages[0]["a"].banned_until == 0.0
    r.refresh([recs[1]])
    assert r.servers(0) == ["b"]


def test_weights_tied_across_stages_are_refused(work: dict) -> None:
    with pytest.raises(UsageError, match="tied across stages"):
        stage_specs(load_swap_package(work["tied"]), 2)
    assert len(stage_specs(load_swap_package(work["pkg"]), 2)) == 2


# ---------------------------------------------------------------------------------------------
# processes


@pytest.mark.slow
def test_swarm_equals_single_process_through_a_kill(swarm_of) -> None:
    """2 stages x 3 and 2 servers, float64: the weights of single-process training, although a
    server is SIGKILLed in the middle of a step (its micro-batches go elsewhere, none twice)."""
    sw = swarm_of()
    for name, stage in (("s0a", 0), ("s0b", 0), ("s0c", 0), ("s1a", 1), ("s1b", 1)):
        # records outlive a dead server long enough that the trainers still route to it
        sw.serve(name, stage, "--slowdown", "2", "--expiration", "30")
    steps = 4
    proc = sw.train(steps)
    deadline = time.monotonic() + 120
    while not [x for x in _lines(sw.d / "trainer.jsonl") if x["step"] >= 1]:
        assert time.monotonic() < deadline and proc.poll() is None, sw.log("trainer")
        time.sleep(0.05)
    # as step 2 begins: the router still lists s1b (its record outlives it), so some of the
    # remaining calls go to a dead server (one of two at its stage), fail and are routed
    # elsewhere
    sw.kill("s1b")
    sw.wait(proc, 150)
    _check_against_reference(sw.d, steps)
    log = sw.log("trainer")
    assert "failed" in log, log  # the kill hit calls of a step that still completed
    groups = {(x["stage"], x["step"]): x["group"] for x in _lines(sw.d / "servers.jsonl")
              if x["event"] == "step"}
    assert groups[(0, 1)] == 3 and groups[(1, 1)] == 2  # every live server of a stage averaged
    assert groups[(1, steps)] == 1  # s1a alone, though s1b's record outlives it
