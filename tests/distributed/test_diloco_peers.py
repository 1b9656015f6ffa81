"""DiLoCo on `atomc peer`, live (hivemind on loopback, every peer in a process group of its own,
killed as a whole afterwards, every wait bounded):

- two peers with `--outer nesterov`, H = 4, 3 rounds, float64, end with the weights a plain
  torch reference gives (two AdamW models, DiLoCo's outer step by hand);
- two peers with `--outer sgd --outer-lr 1` in float32 end with today's peers' weights bit for
  bit: two swap trainers whose weights are averaged with hivemind's arithmetic every H steps;
- a peer whose outer options differ from the run's is refused in one line naming both
  (beside the two Nesterov peers, who keep their rounds);
- three peers with int8 rounds over three fragments: one dies, the others lose no round, a new
  one joins (weights, inner and outer state) and takes part; the survivors end with the same
  weights and a falling loss.
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

pytest.importorskip("hivemind")

import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.runtime.checkpoint import load_checkpoint
from atomc.trace import trace_model

from processes import SERIAL, child_env, kill_tree

pytestmark = SERIAL
ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"
SCRIPT = ROOT / "examples" / "train_peer.py"
C, MICRO, SEQ, VOCAB = 2, 2, 16, 256  # the tiny GPT at C = 2 (micro-batch 2)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("diloco")
    traced = trace_model(GPT, "tiny", MICRO)
    generate(plan_from_cuts(traced, [9, 39]), d / "pkg", traced=traced)  # 3 sub-models
    return d / "pkg"


def _peer(pkg: Path, d: Path, name: str, initial: list[str], args: list[str]
          ) -> subprocess.Popen:
    argv = [sys.executable, str(SCRIPT), "--package", str(pkg), "--name", name,
            "--accum", str(C), "--lr", "3e-3", "--matchmaking-time", "1.0",
            "--averaging-timeout", "20", "--connect-timeout", "20", "--max-seconds", "170",
            "--metrics", str(d / f"{name}.jsonl"), "--final", str(d / f"{name}.pt"),
            "--maddr-file", str(d / f"{name}.maddr"), *args]
    if initial:
        argv += ["--initial-peers", *initial]
    log = open(d / f"{name}.log", "w")  # the peer writes to it until it ends
    return subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _address(d: Path, name: str, proc: subprocess.Popen) -> str:
    _wait_for(lambda: (d / f"{name}.maddr").exists() or proc.poll() is not None, 60,
              f"peer {name}'s address")
    assert proc.poll() is None, (d / f"{name}.log").read_text()[-3000:]
    return (d / f"{name}.maddr").read_text().split()[0]


def _finish(d: Path, procs: dict[str, subprocess.Popen], names: str, timeout_s: float) -> None:
    for name in names:
        try:
            procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"peer {name} did not finish:\n"
                                 f"{(d / f'{name}.log').read_text()[-3000:]}") from None
        assert procs[name].returncode == 0, (d / f"{name}.log").read_text()[-3000:]


def _events(d: Path, name: str) -> list[dict]:
    path = d / f"{name}.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def counting_batch(data_seed: int, step: int) -> torch.Tensor:
    """examples/train_peer.py's `--data counting` batch of a step."""
    g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    start = torch.randint(0, VOCAB, (C * MICRO, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def reference(pkg: Path, seeds: dict[str, int], inner: int, rounds: int, outer: str,
              lr: float, momentum: float) -> dict[str, torch.Tensor]:
    """Two plain GPTs with torch's AdamW, H local steps each, then DiLoCo's outer step by hand
    on the mean pseudo-gradient; returns the final weights (what both copies hold)."""
    sys.path.insert(0, str(GPT.parent))
    import gpt

    from atomc.runtime.package import load_swap_package
    from atomc.runtime.rng import micro_batch_rng

    init = load_swap_package(pkg).initial_state_dict(0)
    copies = {}
    for name in seeds:
        model = gpt.build_model("tiny")
        model.load_state_dict(init)
        model = model.double()
        copies[name] = (model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0,
                                                 fused=True))
    start = {k: v.detach().clone() for k, v in copies[next(iter(seeds))][0].named_parameters()}
    momentum_buffer: dict[str, torch.Tensor] | None = None
    step = 0
    for _ in range(rounds):
        for _ in range(inner):
            for name, (model, opt) in copies.items():
                x = counting_batch(seeds[name], step)
                opt.zero_grad()
                for m, xm in enumerate(x.chunk(C)):
                    with micro_batch_rng(0, step, m):
                        loss = gpt.loss_fn(model(xm), (xm,))
                    (loss / C).backward()
                opt.step()
            step += 1
        weights = [dict(model.named_parameters()) for model, _ in copies.values()]
        delta = {k: sum(start[k] - w[k].detach() for w in weights) / len(weights) for k in start}
        if outer == "nesterov":  # torch.optim.SGD(nesterov=True)'s rule, written out
            if momentum_buffer is None:
                momentum_buffer = {k: v.clone() for k, v in delta.items()}
            else:
                momentum_buffer = {k: momentum * momentum_buffer[k] + delta[k] for k in delta}
            start = {k: start[k] - lr * (delta[k] + momentum * momentum_buffer[k]) for k in start}
        else:
            start = {k: start[k] - lr * delta[k] for k in start}
        with torch.no_grad():
            for model, _ in copies.values():
                for k, p in model.named_parameters():
                    p.copy_(start[k])
    return start


def atom_reference(pkg: Path, seeds: dict[str, int], inner: int, rounds: int,
                   finals: int) -> dict[str, dict[str, torch.Tensor]]:
    """Today's peers by hand: two swap trainers (as each peer makes its own, one torch thread
    as the peers run), their weight vectors averaged every H steps with hivemind's arithmetic
    (a float32 accumulator adds each member's vector times its weight, divides by the weights'
    sum, and each member adds the average minus its vector to its vector), then `finals` final
    rounds of weight 1; the final weights of each."""
    sys.path.insert(0, str(GPT.parent))
    import gpt

    from atomc.distributed.averaging import round_vector, set_round_vector
    from atomc.runtime import SwapTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainers = {n: SwapTrainer.from_package(pkg, device="cpu", accum=C, seed=0,
                                            optimizer={"lr": 3e-3, "weight_decay": 0.0},
                                            loss_fn=gpt.loss_fn) for n in seeds}
    try:
        def average(weight: float) -> None:
            xs = {n: round_vector(t) for n, t in trainers.items()}
            acc = torch.zeros_like(xs[next(iter(xs))])
            for x in xs.values():
                acc.add_(x, alpha=weight)
            avg = acc.div_(weight * len(xs))
            for n, t in trainers.items():
                set_round_vector(t, xs[n].clone().add_(avg - xs[n]))

        step = 0
        for _ in range(rounds):
            for _ in range(inner):
                for n, t in trainers.items():
                    t.step((counting_batch(seeds[n], step),))
                step += 1
            average(float(inner * C * MICRO))
        for _ in range(finals):
            average(1.0)
        return {n: t.export_state_dict() for n, t in trainers.items()}
    finally:
        for t in trainers.values():
            t.close()
        torch.set_num_threads(threads)


def _two_peers(pkg: Path, d: Path, args: list[str], seeds: dict[str, int],
               refused: list[str] | None = None) -> None:
    """Peers A and B train together; with `refused`, a peer C of those arguments tries to
    join them as B does (and is refused before it counts as present for --min-peers)."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["A"] = _peer(pkg, d, "A", [], [*args, "--data-seed", str(seeds["A"])])
        a_addr = _address(d, "A", procs["A"])
        procs["B"] = _peer(pkg, d, "B", [a_addr], [*args, "--data-seed", str(seeds["B"])])
        if refused is not None:
            procs["C"] = _peer(pkg, d, "C", [a_addr], refused)
            procs["C"].wait(timeout=90)
        _finish(d, procs, "AB", 170)
    finally:
        for p in procs.values():
            kill_tree(p)
    if refused is not None:
        out = (d / "C.log").read_text()
        assert procs["C"].returncode == 2, out
        lines = [x for x in out.splitlines() if x.strip() and not x.startswith("[C]")]
        assert len(lines) == 1 and "Traceback" not in out, out
        assert ("--outer sgd --outer-lr 1 --outer-momentum 0 here, --outer nesterov --outer-lr "
                "0.7 --outer-momentum 0.9 there") in lines[0], lines[0]


def _rounds_held_both(d: Path, rounds: int) -> list[dict]:
    """Every training round of either peer held both (the references' rounds); A's events."""
    for name in "AB":
        rounds_seen = [e for e in _events(d, name) if e["event"] == "round" and not e["final"]]
        assert [e["group"] for e in rounds_seen] == [["A", "B"]] * rounds, rounds_seen
        assert all(e["sent_bytes"] > 0 for e in rounds_seen)
    return _events(d, "A")


@pytest.mark.slow
def test_two_nesterov_peers_equal_a_plain_torch_reference(pkg: Path, tmp_path: Path) -> None:
    """... and a peer whose outer options differ from the run's is refused in one line that
    names both, leaving the two to their rounds."""
    inner, rounds = 4, 3
    seeds = {"A": 7, "B": 8}
    _two_peers(pkg, tmp_path, ["--dtype", "float64", "--rounds", str(rounds), "--inner-steps",
                               str(inner), "--outer", "nesterov", "--min-peers", "2"], seeds,
               refused=["--dtype", "float64", "--rounds", str(rounds), "--outer", "sgd",
                        "--inner-steps", str(inner), "--min-peers", "2"])
    _rounds_held_both(tmp_path, rounds)
    ref = reference(pkg, seeds, inner, rounds, "nesterov", 0.7, 0.9)
    for name in "AB":
        final = load_checkpoint(tmp_path / f"{name}.pt")["params"]
        for k, v in ref.items():
            torch.testing.assert_close(final[k], v, rtol=0, atol=1e-10, msg=f"{name} {k}")


@pytest.mark.slow
def test_outer_sgd_at_lr_1_is_today_s_averaging_bit_for_bit(pkg: Path, tmp_path: Path) -> None:
    """`--outer sgd --outer-lr 1` in float32, through `atomc peer`'s flags: the weights are
    averaged as today's peers average them (not an outer step on pseudo-gradients, which
    differs in the last bits), every bit the same."""
    inner, rounds = 4, 3
    seeds = {"A": 7, "B": 8}
    _two_peers(pkg, tmp_path, ["--rounds", str(rounds), "--inner-steps", str(inner), "--outer",
                               "sgd", "--outer-lr", "1", "--min-peers", "2"], seeds)
    events = _rounds_held_both(tmp_path, rounds)
    finals = [e for e in events if e["event"] == "round" and e["final"] and e["ok"]]
    ref = atom_reference(pkg, seeds, inner, rounds, len(finals))
    for name in "AB":
        final = load_checkpoint(tmp_path / f"{name}.pt")["params"]
        assert final.keys() == ref[name].keys()
        for k, v in ref[name].items():
            assert torch.equal(final[k], v), (name, k, float((final[k] - v).abs().max()))
    # the weights averager alone: no outer state
    assert next(e for e in events if e["event"] == "start")["host_bytes"]["outer_state"] == 0


@pytest.mark.long  # a death and a join: test_peers; int8 rounds and fragments: test_diloco
def test_int8_fragments_survive_a_death_and_a_join(pkg: Path, tmp_path: Path) -> None:
    d = tmp_path
    rounds = 18
    args = ["--rounds", str(rounds), "--outer", "nesterov", "--inner-steps", "6",
            "--fragments", "3", "--round-dtype", "int8", "--lr", "1e-2", "--min-peers", "3"]
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["A"] = _peer(pkg, d, "A", [], args)
        a_addr = _address(d, "A", procs["A"])
        procs["B"] = _peer(pkg, d, "B", [a_addr], args)
        procs["C"] = _peer(pkg, d, "C", [a_addr], args)

        def c_averaged() -> bool:
            return any(e["event"] == "round" and e["ok"] and "C" in e["group"]
                       for e in _events(d, "C"))

        _wait_for(c_averaged, 90, "peer C to average with the others")
        os.killpg(procs["C"].pid, signal.SIGKILL)  # C dies mid-run, with its DHT and p2p daemon
        procs["C"].wait(timeout=10)
        killed_at = time.time()
        b_addr = _address(d, "B", procs["B"])
        procs["D"] = _peer(pkg, d, "D", [b_addr], args)  # joins through any live peer
        _finish(d, procs, "ABD", 170)
    finally:
        for p in procs.values():
            kill_tree(p)
    ev = {n: _events(d, n) for n in "ABCD"}
    for n in "AB":  # the survivors did every round, each with a group: none was lost
        done = [e for e in ev[n] if e["event"] == "round" and not e["final"]]
        assert sorted(e["epoch"] for e in done) == list(range(rounds))
        after = [e for e in done if e["time"] > killed_at + 1]
        assert after and all(e["ok"] and "C" not in e["group"] for e in after), after
        assert all(e["round_dtype"] == "int8" and e["sent_bytes"] > 0 for e in done if e["ok"])
    joined = [e for e in ev["D"] if e["event"] in ("joined", "caught_up")]
    assert joined and joined[0]["epoch"] >= 1
    assert any(e["event"] == "round" and e["ok"] and len(e["group"]) >= 2 and not e["final"]
               for e in ev["D"])
    finals = {n: load_checkpoint(d / f"{n}.pt") for n in "ABD"}
    ref = finals["A"]["params"]
    for n in "BD":
        worst = max((finals[n]["params"][k] - v).abs().max().item() for k, v in ref.items())
        assert worst <= 1e-6, (n, worst)
    for n in "AB":
        losses = [e["loss"] for e in ev[n] if e["event"] == "step"]
        assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.3, losses
