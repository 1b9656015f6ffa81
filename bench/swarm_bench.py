"""SWARM benchmark: adaptive rebalancing, by parts.

    python bench/swarm_bench.py --part b                  # prints the report (record it in
                                                          # bench/RESULTS.md)
    python bench/swarm_bench.py --part b --seeds 10 --peers 400 --jobs 2
    python bench/swarm_bench.py --part a --duration 240   # real processes (about 15 min)
    python bench/swarm_bench.py --part c                  # needs root, `ip` and `tc`

Parts (each its own flag value; run several with --part a --part b ...):

(a) real servers, processes on loopback: `atomc swarm serve` x 5 of different speeds
    (--slowdown) under a churn script (SIGKILLs and a join), one `atomc swarm train`; three
    runs: no rebalancing (newcomers on a stage drawn with seed 0), rebalancing (--rebalance-period
    T --min-gain 0.03, newcomers --stage auto) and the best static assignment (computed);
(b) simulated: the rebalancing policy (atomc.swarm.balance) in the swarm simulator
    (atomc.swarm.simulate) over 32-hour churn traces, as % of the optimal throughput,
    against SWARM's Table 5 (Ryabinin et al. 2023, App. I: no rebalancing 82.7%, T = 300 s
    95.8%, T = 60 s 97.6%). Target: T = 60 s >= 97%;
(c) bytes on the wire per micro-batch and the step time over an emulated 100 Mbit/s link,
    with and without --compress: one network namespace per process (trainer, one server per
    stage) on a bridge, `tc htb` at each sender (atomc.distributed.netem, as
    bench/layout_bench.py); without root, `ip`, `tc` or namespaces it says so and exits 0.

Part (a)'s setting: tiny-untied GPT cut after its first block (two sub-models, 2 stages; the
plan carries this machine's profile, so servers know stage 0 costs more per sample: it serves a
forward call and a backward call that recomputes it, the last stage only the backward), global
batch 64 in micro-batches of 2, one trainer; slowdowns 100 (fast) and 300 (slow): a call lasts
that many times what the plan's profile says it takes, so the servers mostly sleep at a steady
speed from their first call while the 2 cores run ~20 processes (hivemind's DHT, averager and
p2pd per server), and their compute, not the trainer's or the averaging's, bounds the pipeline.
Churn (times as fractions of --duration): fast servers a (stage 0) and c (stage 1) are SIGKILLed
at 1/4 and 3/4, a fast server e joins at 1/2. Rates: what each server announces (samples/s of
its stage's forward and backward work over its last --rate-window seconds of calls), per server
and stage, the median over the first two runs; a stage a server never served gets its rate on
the other times the stages' measured cost ratio. Optimal at a moment: the best assignment of the
servers alive then (exhaustive), as a flow model (the pipeline runs at its lowest stage's summed
rate, no moving cost). Best static: one stage per server for its whole life, the best in
hindsight over the churn script by that flow model (exhaustive search; `best_assignment` per
moment is not static: after a kill the optimum wants someone to move). Reported per run:
measured samples/s (whole steps of the trainer, from its first step's end to its last one's
within the run; per phase, linear between step ends), as % of the best static run, as % of the
optimum; and the assignment's flow throughput over time as % of the optimum (the number
comparable to SWARM's Table 5 and part (b)).

Part (b)'s setting and where each number comes from:
- 4 stages and 32 hours: SWARM App. I (its rebalancing simulation); 400 peers at the start:
  the preemptible T4 fleet of its Sec. 4.3; removals: a stage drawn uniformly among those with
  live peers, then a peer in it (App. I); 10 seeds per row, averaged (App. I);
- the paper gives its trace only as a plot (Fig. 5), and no preemption rate. The synthetic
  trace has Poisson preemptions at 1 / 12 h per live peer (a preemptible GCP VM lives at most
  24 h), each replaced with probability 0.8 after 10 min on average; the rate was calibrated
  so that no rebalancing loses what it lost in the paper (82.7% overall), which puts the
  churn at the paper's intensity. A second trace stresses the moves alone: no replacements,
  preemptions in bursts of 8 on average, 24 h mean lifetime (our assumption, no source);
- peer speeds lognormal (sigma 0.3, ours: App. I's peers are identical T4s, which only
  makes the problem easier); a stage's state 4 GB (1.01B parameters / 3 stages of Sec. 4.3,
  fp32 weights and two Adam moments), downloaded at a lognormal 500 Mbit/s per peer (Table 3:
  a T4 needs ~400 Mbit/s, Sec. 4.3: about 100 Mbit/s more in training);
- "none": no rebalancing, newcomers take a random stage (a swarm without the protocol);
  "joins only": newcomers take the neediest stage (choose_join_stage), nobody moves;
  "moves only": Algorithm 2 moves, newcomers random; "T = ...": both, as in SWARM;
  "min_gain 1%": a move must raise the lower of its two stages by more than 1%;
- optimal: at each moment the best assignment of the peers that hold a stage's state, with no
  moving cost; for hundreds of peers, assignment_bound, an upper bound (the report prints how
  far best_assignment is below it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atomc.swarm.balance import assignment_bound, best_assignment, min_stage_throughput
from atomc.swarm.simulate import HOUR_S, SwarmSimConfig, simulate_swarm, simulate_wiring
from bench._swarm_procs import Procs, lines

# ---------------------------------------------------------------------------------------------
# part (b): simulated

SWARM_TABLE5 = {"none": (82.7, 99.0, 45.4), "T = 300 s": (95.8, 99.4, 88.9),
                "T = 60 s": (97.6, 99.8, 91.7)}

POLICIES = {  # name -> SwarmSimConfig fields
    "none": {"rebalance_period_s": None, "join": "random"},
    "joins only": {"rebalance_period_s": None, "join": "neediest"},
    "moves only, T = 300 s": {"rebalance_period_s": 300.0, "join": "random"},
    "T = 300 s": {"rebalance_period_s": 300.0, "join": "neediest"},
    "T = 60 s": {"rebalance_period_s": 60.0, "join": "neediest"},
    "T = 60 s, min_gain 1%": {"rebalance_period_s": 60.0, "join": "neediest", "min_gain": 0.01},
}

TRACES = {  # name -> SwarmSimConfig fields over the defaults
    "calibrated: Poisson preemptions, 12 h mean lifetime, 80% replaced": {},
    "stress: no replacements, bursts of 8, 24 h mean lifetime": {
        "replace_probability": 0.0, "burst_mean": 8.0, "mean_lifetime_h": 24.0},
}
STRESS_POLICIES = ("none", "T = 300 s", "T = 60 s")


def run_one(config: SwarmSimConfig) -> tuple[float, ...]:
    r = simulate_swarm(config)
    last = config.duration_s - HOUR_S
    return (r.percent_of_optimal(), r.percent_of_optimal(0, HOUR_S),
            r.percent_of_optimal(last), r.num_moves, r.num_leaves, r.num_joins,
            float(r.num_live[-1]))


def bound_gap(num_peers: int, seeds: int) -> float:
    """Largest shortfall (%) of best_assignment below assignment_bound over the speeds of the
    simulated peers: swarms of 50 to num_peers peers."""
    worst = 0.0
    cfg = SwarmSimConfig()
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        for n in (50, 100, 200, num_peers):
            x = np.exp(rng.normal(0.0, cfg.speed_sigma, n))
            got = min_stage_throughput(x, best_assignment(x, cfg.num_stages), cfg.num_stages)
            worst = max(worst, 100.0 * (1.0 - got / assignment_bound(x, cfg.num_stages)))
    return worst


def simulated(args: argparse.Namespace) -> None:
    t0 = time.time()
    print(f"part (b): simulated swarms, {args.peers} peers at the start, 4 stages, 32 h, "
          f"{args.seeds} seeds per row, {args.jobs} processes")
    rng = np.random.default_rng(0)
    speeds = [list(np.exp(rng.normal(0.0, 0.3, 25))) for _ in range(4)]
    wiring = simulate_wiring(speeds, num_microbatches=4000)
    print(f"stochastic wiring (Algorithm 1, event level, 4 stages x 25 peers, 200 micro-batches "
          f"in flight): {100 * wiring.efficiency:.1f}% of the flow model's throughput")
    print(f"best_assignment vs assignment_bound on such speeds (50..{args.peers} peers): "
          f"at most {bound_gap(args.peers, 5):.3f}% below the bound")
    jobs: list[tuple[str, str, SwarmSimConfig]] = []
    for trace, fields in TRACES.items():
        names = POLICIES if not fields else STRESS_POLICIES
        for name in names:
            for seed in range(args.seeds):
                cfg = SwarmSimConfig(num_peers=args.peers, seed=seed, **POLICIES[name], **fields)
                jobs.append((trace, name, cfg))
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run_one, [cfg for _, _, cfg in jobs], chunksize=2))
    state_gb = SwarmSimConfig().stage_state_bytes / 1e9
    for trace in TRACES:
        rows = [(name, r) for (t, name, _), r in zip(jobs, results) if t == trace]
        first = np.mean([r[4] for _, r in rows]), np.mean([r[5] for _, r in rows]), \
            np.mean([r[6] for _, r in rows])
        print(f"\ntrace {trace}: {first[0]:.0f} preemptions, {first[1]:.0f} joins, "
              f"{args.peers} -> {first[2]:.0f} peers (means over seeds)\n")
        print("| rebalancing | % of optimal | first 1h | last 1h | worst seed | moves | "
              "moved GB/h | SWARM Table 5 (overall / first 1h / last 1h) |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for name in dict.fromkeys(n for n, _ in rows):
            mine = np.array([r for n, r in rows if n == name])
            overall, first_h, last_h = mine[:, :3].mean(axis=0)
            moves = mine[:, 3].mean()
            paper = SWARM_TABLE5.get(name) if trace.startswith("calibrated") else None
            ref = " / ".join(f"{v:.1f}" for v in paper) if paper else "-"
            print(f"| {name} | {overall:.1f} | {first_h:.1f} | {last_h:.1f} | "
                  f"{mine[:, 0].min():.1f} | {moves:.0f} | {moves * state_gb / 32:.1f} | "
                  f"{ref} |")
    print(f"\npart (b) took {time.time() - t0:.1f} s on {platform.machine()}, "
          f"{os.cpu_count()} CPUs")


# ---------------------------------------------------------------------------------------------
# part (a): real servers, processes on loopback

# the churn script: name, slowdown, stage for the runs without rebalancing (None: a random
# stage, drawn once with seed 0), join and leave (SIGKILL) as fractions of --duration
CHURN = (
    ("a", 100, 0, 0.0, 0.25), ("b", 300, 0, 0.0, None), ("c", 100, 1, 0.0, 0.75),
    ("d", 300, 1, 0.0, None), ("e", 100, None, 0.5, None),
)
A_CONFIG, A_MICRO, A_CUTS = "tiny-untied", 2, (39,)


@dataclass
class Churn:
    names: list[str]
    slowdown: dict[str, float]
    stage: dict[str, int]  # without rebalancing
    join: dict[str, float]  # seconds after the trainer's first step
    leave: dict[str, float]

    def events(self) -> list[float]:
        return sorted({*self.join.values(), *self.leave.values()} - {0.0})

    def alive(self, t: float) -> list[str]:
        return [n for n in self.names if self.join[n] <= t < self.leave[n]]


def churn_script(duration: float, num_stages: int) -> Churn:
    rng = np.random.default_rng(0)
    c = Churn([], {}, {}, {}, {})
    for name, slow, stage, join, leave in CHURN:
        c.names.append(name)
        c.slowdown[name] = float(slow)
        c.stage[name] = int(rng.integers(num_stages)) if stage is None else stage % num_stages
        c.join[name] = join * duration
        c.leave[name] = math.inf if leave is None else leave * duration
    return c


def phases(churn: Churn, duration: float) -> list[tuple[float, float]]:
    cuts = [0.0, *[t for t in churn.events() if t < duration], duration]
    return list(itertools.pairwise(cuts))


Rates = dict[str, list[float]]  # server -> its samples/s on each stage


def flow(rates: Rates, assign: dict[str, int], num_stages: int) -> float:
    """The pipeline throughput of an assignment: its lowest stage's summed rates."""
    sums = [0.0] * num_stages
    for n, s in assign.items():
        sums[s] += rates[n][s]
    return min(sums)


def optimum(rates: Rates, names: list[str], num_stages: int) -> float:
    """The best assignment's flow (exhaustive: a few servers; a server's rate depends on its
    stage, the stages' costs differ, so `best_assignment`'s one rate per server does not do)."""
    names = sorted(names)
    return max((flow(rates, dict(zip(names, a)), num_stages)
                for a in itertools.product(range(num_stages), repeat=len(names))), default=0.0)


def best_static(churn: Churn, rates: Rates, duration: float,
                num_stages: int) -> dict[str, int]:
    """One stage per server for its whole life, the best in hindsight: the most samples over
    the churn script (exhaustive; the first server's stage fixed, stages being alike)."""
    spans = phases(churn, duration)
    best, found = -1.0, {}
    for rest in itertools.product(range(num_stages), repeat=len(churn.names) - 1):
        assign = dict(zip(churn.names, (0, *rest)))
        got = sum((b - a) * flow(rates, {n: assign[n] for n in churn.alive(a)}, num_stages)
                  for a, b in spans)
        if got > best + 1e-9:
            best, found = got, assign
    return found


def _package(config: str, micro: int, cuts: tuple[int, ...] | None, out: Path,
             profiled: bool = False) -> Path:
    """A generated package of examples/gpt.py; `profiled`: its plan carries this machine's
    measured times (servers weigh stages by them when they move)."""
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model(ROOT / "examples" / "gpt.py", config, micro)
    if cuts is None:  # one sub-model per block
        cuts = tuple(i for i, n in enumerate(traced.graph.nodes) if n.op == "call_module"
                     and (n.target.endswith(".ln_1") or n.target == "ln_f"))
    source = profile_model(traced, device="cpu", progress=False) if profiled else traced
    generate(plan_from_cuts(source, list(cuts)), out, traced=traced)
    return out


def _serve_args(pkg: Path, d: Path, name: str, stage: int | str, args: argparse.Namespace,
                extra: list[str]) -> list[str]:
    return ["swarm", "serve", str(pkg), "--stages", str(args.stages), "--stage", str(stage),
            "--target-batch-size", str(args.batch), "--name", name,
            "--maddr-file", str(d / f"{name}.addr"), "--metrics", str(d / "servers.jsonl"),
            "--checkpoint-dir", str(d / "ckpt"), "--max-seconds", str(args.duration + 300),
            *extra]


def _cum_samples(trainer: list[dict], batch: int, t0: float) -> Callable[[float], float]:
    """Samples trained by time t (seconds after t0), linear between step completions."""
    ts = np.array([0.0] + [x["time"] - t0 for x in trainer[1:]])
    ns = batch * np.arange(len(ts), dtype=float)
    return lambda t: float(np.interp(t, ts, ns))  # after the last step: no more samples


def churn_run(args: argparse.Namespace, pkg: Path, d: Path, churn: Churn, policy: str,
              stages: dict[str, int] | None) -> dict:
    """One run under the churn script; `stages`: each server's stage (None: rebalancing, the
    initial servers on churn.stage and newcomers --stage auto)."""
    d.mkdir(parents=True)
    procs = Procs(d)
    rebalance = ["--rebalance-period", str(args.period), "--min-gain", str(args.min_gain)
                 ] if stages is None else []

    def stage_of(name: str) -> int | str:
        if stages is not None:
            return stages[name]
        return churn.stage[name] if churn.join[name] == 0 else "auto"

    def serve(name: str, first: str | None) -> None:
        extra = ["--slowdown", str(churn.slowdown[name]), *rebalance]
        extra += ["--initial-peers", first] if first else []
        procs.atomc(name, _serve_args(pkg, d, name, stage_of(name), args, extra))

    try:
        # the first server is one that never leaves: everyone joins through it
        names = [n for n in churn.names if churn.join[n] == 0]
        boot = next(n for n in names if churn.leave[n] == math.inf)
        serve(boot, None)
        first = procs.wait_file(boot, d / f"{boot}.addr")
        for n in names:
            if n != boot:
                serve(n, first)
        for n in names:
            procs.wait_file(n, d / f"{n}.addr")
            procs.wait_entered(n, d / "servers.jsonl")
        procs.atomc("trainer", [
            "swarm", "train", str(pkg), "--stages", str(args.stages), "--steps", "1000000",
            "--batch-size", str(args.batch), "--data", "random", "--initial-peers", first,
            "--metrics", str(d / "trainer.jsonl"), "--request-timeout", "20",
            # a static assignment may leave a stage empty for a phase: the trainer waits
            "--servers-timeout", str(args.duration)])
        deadline = time.monotonic() + 180
        while not lines(d / "trainer.jsonl"):
            if procs.procs["trainer"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not take a step:\n{procs.log('trainer')}")
            time.sleep(0.1)
        t0 = lines(d / "trainer.jsonl")[0]["time"]
        todo = sorted([(churn.join[n], "join", n) for n in churn.names if churn.join[n] > 0]
                      + [(churn.leave[n], "leave", n) for n in churn.names
                         if churn.leave[n] < args.duration])
        for at, what, name in todo:
            time.sleep(max(0.0, t0 + at - time.time()))
            if what == "join":
                serve(name, first)
            else:
                procs.kill(name)
            print(f"  {policy}: {time.time() - t0:5.1f} s {what} {name}", flush=True)
        time.sleep(max(0.0, t0 + args.duration - time.time()))
        if procs.procs["trainer"].poll() is not None:
            raise RuntimeError(f"the trainer stopped:\n{procs.log('trainer')}")
    finally:
        procs.close()
    return load_run(d)


def load_run(d: Path) -> dict:
    """A run's lines, from its directory (t0: the trainer's first step)."""
    servers = lines(d / "servers.jsonl")
    trainer = lines(d / "trainer.jsonl")
    return {"t0": trainer[0]["time"], "trainer": trainer, "servers": servers,
            "records": _snapshots(servers)}


def _snapshots(servers: list[dict]) -> list[dict]:
    """The servers' load lines (one a second each, what they announce in the DHT) as one
    snapshot a second: each server's latest line of the last 4 s (the DHT keeps a record that
    long; a server's serving loop, which writes these lines, pauses while its stage averages)."""
    loads = sorted((x for x in servers if x.get("event") == "load"), key=lambda x: x["time"])
    if not loads:
        return []
    out = []
    for t in np.arange(loads[0]["time"], loads[-1]["time"], 1.0):
        last = {x["server"]: x for x in loads if t - 4.0 < x["time"] <= t}
        out.append({"time": float(t), "servers": [{"name": n, **x} for n, x in last.items()]})
    return out


def measured_rates(runs: list[dict], churn: Churn, num_stages: int) -> Rates:
    """Each server's throughput (samples/s) on each stage, as it announced it: the median of
    its measured records there (not stand-ins, not while moving), over the runs together.
    Stages differ in cost, so a rate holds for its stage only. Where a server never served a
    stage: its rate on the stages it served, times the stages' cost ratio (the medians of rate
    x slowdown over the servers that served each), or with no rate at all the stage's median
    rate x slowdown over its slowdown."""
    seen: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        for line in run["records"]:
            for r in line["servers"]:
                if not r["moving"] and r.get("measured", True):
                    seen.setdefault((r["name"], r["stage"]), []).append(r["throughput"])
    known = {k: float(np.median(xs)) for k, xs in seen.items()}
    unit = []  # per stage: rate x slowdown, median over the servers that served it
    for s in range(num_stages):
        xs = [v * churn.slowdown[n] for (n, t), v in known.items() if t == s]
        unit.append(float(np.median(xs)) if xs else math.nan)
    if any(math.isnan(u) for u in unit):
        raise RuntimeError(f"no server measured a rate on every stage ({unit}); run longer")
    rates: Rates = {}
    for n in churn.names:
        mine = {t: v for (m, t), v in known.items() if m == n}
        rates[n] = [mine[s] if s in mine else
                    float(np.mean([v * unit[s] / unit[t] for t, v in mine.items()]))
                    if mine else unit[s] / churn.slowdown[n] for s in range(num_stages)]
    return rates


def analyse(run: dict, churn: Churn, rates: Rates, args: argparse.Namespace) -> dict:
    cum = _cum_samples(run["trainer"], args.batch, run["t0"])
    spans = phases(churn, args.duration)
    measured = [(cum(b) - cum(a)) / (b - a) for a, b in spans]
    ideal = [optimum(rates, churn.alive(a), args.stages) for a, _ in spans]
    actual = opt = 0.0
    for line in run["records"]:
        t = line["time"] - run["t0"]
        if not 0 <= t <= args.duration:
            continue
        alive = set(churn.alive(t))
        recs = [r for r in line["servers"] if r["name"] in alive]
        actual += flow(rates, {r["name"]: r["stage"] for r in recs if not r["moving"]},
                       args.stages)
        opt += optimum(rates, [r["name"] for r in recs], args.stages)
    moves = [x for x in run["servers"] if x.get("event") == "move"]
    # overall: whole steps, from the first step's end to the last one's within the run
    ends = [t for t in (x["time"] - run["t0"] for x in run["trainer"]) if t <= args.duration]
    end = ends[-1] if ends[-1] > 0 else args.duration
    return {"measured": measured, "overall": cum(end) / end, "ideal": ideal,
            "flow_pct": 100 * actual / opt if opt else math.nan, "moves": len(moves),
            "steps": len(ends) - 1}


def real_processes(args: argparse.Namespace) -> None:
    t_start = time.time()
    churn = churn_script(args.duration, args.stages)
    if args.reanalyse is not None:  # the tables again, from an earlier run's logs
        runs = {"none": load_run(args.reanalyse / "none"),
                f"T = {args.period:g} s": load_run(args.reanalyse / "rebalance")}
        rates = measured_rates(list(runs.values()), churn, args.stages)
        runs["best static"] = load_run(args.reanalyse / "static")
        report_a(runs, churn, rates, args)
        return
    work = Path(tempfile.mkdtemp(prefix="atomc-swarm-bench-a-"))
    print(f"part (a): real processes on loopback, {A_CONFIG} in {args.stages} stages, global "
          f"batch {args.batch} (micro-batch {A_MICRO}), {args.duration:.0f} s per run; "
          f"work in {work}")
    print("churn: " + "; ".join(
        f"{n} x{churn.slowdown[n]:g} " + (f"joins {churn.join[n]:.0f} s (without rebalancing: "
                                          f"stage {churn.stage[n]})" if churn.join[n]
                                          else f"stage {churn.stage[n]}")
        + (f", killed {churn.leave[n]:.0f} s" if churn.leave[n] < math.inf else "")
        for n in churn.names))
    pkg = _package(A_CONFIG, A_MICRO, A_CUTS, work / "pkg", profiled=True)
    from atomc.runtime.package import load_swap_package
    from atomc.swarm.node import call_times, stage_costs, stage_specs

    loaded = load_swap_package(pkg)
    specs = stage_specs(loaded, args.stages)
    costs = stage_costs(specs, call_times(loaded, specs))
    print("stage costs per sample from the profiled plan (relative): "
          + " / ".join(f"{c:.2f}" for c in costs))
    runs = {"none": churn_run(args, pkg, work / "none", churn, "none", dict(churn.stage))}
    runs[f"T = {args.period:g} s"] = churn_run(args, pkg, work / "rebalance", churn, "rebalance",
                                              None)
    rates = measured_rates(list(runs.values()), churn, args.stages)
    print("measured rates (samples/s, per stage): " + ", ".join(
        f"{n} " + "/".join(f"{v:.2f}" for v in rates[n]) for n in churn.names))
    static = best_static(churn, rates, args.duration, args.stages)
    print("best static assignment: " + ", ".join(f"{n} {s}" for n, s in static.items()))
    runs["best static"] = churn_run(args, pkg, work / "static", churn, "static", static)
    report_a(runs, churn, rates, args)
    print(f"\npart (a) took {time.time() - t_start:.0f} s; logs in {work}")


def report_a(runs: dict[str, dict], churn: Churn, rates: Rates,
             args: argparse.Namespace) -> None:
    out = {name: analyse(run, churn, rates, args) for name, run in runs.items()}
    ref = out["best static"]
    spans = phases(churn, args.duration)
    print("\n| run | steps | measured samples/s | measured, % of best static | measured, % of "
          "optimum | assignment, % of optimal | moves | measured per phase, % of best static |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    ideal = sum((b - a) * x for (a, b), x in zip(spans, ref["ideal"])) / args.duration
    for name, r in out.items():
        # (the best static assignment can leave a stage empty after a kill: no throughput)
        per = " / ".join(f"{100 * m / s:.0f}" if s > 0 else "-"
                         for m, s in zip(r["measured"], ref["measured"]))
        print(f"| {name} | {r['steps']} | {r['overall']:.2f} | "
              f"{100 * r['overall'] / ref['overall']:.1f} | "
              f"{100 * r['overall'] / ideal:.1f} | {r['flow_pct']:.1f} | {r['moves']} | {per} |")
    print("\nper phase, samples/s measured (flow optimum):")
    for k, (a, b) in enumerate(spans):
        cells = ", ".join(f"{name} {r['measured'][k]:.2f}" for name, r in out.items())
        print(f"  {a:3.0f}-{b:3.0f} s, {len(churn.alive(a))} servers: {cells} "
              f"(optimum {ref['ideal'][k]:.2f})")


# ---------------------------------------------------------------------------------------------
# part (c): bytes on the wire and the step time over an emulated 100 Mbit/s link

C_CONFIG = "mini-untied"


def _counters(emu, k: int) -> int:
    """Bytes through namespace k's interface, both directions (its kernel counters)."""
    stats = f"/sys/class/net/{emu.iface(k)}/statistics"
    out = subprocess.run(emu.exec_prefix(k) + ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return sum(int(x) for x in out.split())


def link_run(args: argparse.Namespace, pkg: Path, d: Path, emu, compress: bool) -> dict:
    """One trainer (namespace 0) and one server per stage (namespaces 1..S), --c-steps steps;
    bytes by the trainer's interface counters over its whole life (its DHT join and polls
    included), step times of the steps after the first."""
    d.mkdir(parents=True)
    procs = Procs(d)
    micro = args.c_batch // args.c_micro
    try:
        first = None
        for j in range(args.stages):
            name = f"s{j}"
            extra = ["--host-maddrs", f"/ip4/{emu.addr(j + 1)}/tcp/0"]
            extra += ["--initial-peers", first] if first else []
            procs.atomc(name, _serve_args(pkg, d, name, j, args, extra)
                        + ["--target-batch-size", str(args.c_batch)], emu.exec_prefix(j + 1))
            first = first or procs.wait_file(name, d / f"{name}.addr")
        for j in range(args.stages):
            procs.wait_file(f"s{j}", d / f"s{j}.addr")
        steps = d / "trainer.jsonl"
        before = _counters(emu, 0)
        procs.start("trainer", emu.exec_prefix(0) + [
            sys.executable, str(ROOT / "bench" / "_swarm_procs.py"), "train",
            str(d / "messages.jsonl"), str(pkg), "--stages", str(args.stages),
            "--steps", str(args.c_steps), "--batch-size", str(args.c_batch),
            "--micro-batch-size", str(args.c_micro), "--data", "random",
            "--host-maddrs", f"/ip4/{emu.addr(0)}/tcp/0", "--initial-peers", first,
            "--metrics", str(steps), *(["--compress"] if compress else [])])
        trainer = procs.procs["trainer"]
        deadline = time.monotonic() + args.c_timeout
        while trainer.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer took over {args.c_timeout:.0f} s:\n"
                                   f"{procs.log('trainer')}")
            time.sleep(0.05)
        after = _counters(emu, 0)
        if trainer.returncode != 0:
            raise RuntimeError(f"the trainer failed:\n{procs.log('trainer')}")
    finally:
        procs.close()
    done = lines(steps)
    msgs = lines(d / "messages.jsonl")
    per: dict[tuple, list[int]] = {}
    for m in msgs:
        per.setdefault((m["stage"], m["kind"], m["msg"]), []).append(m["bytes"])
    return {"step_s": [x["seconds"] for x in done[1:]],
            "counted": (after - before) / (len(done) * micro),
            "encoded": sum(m["bytes"] for m in msgs) / (len(done) * micro),
            "messages": {k: (len(v) / (len(done) * micro), float(np.mean(v)))
                         for k, v in sorted(per.items())}}


def link_bytes(args: argparse.Namespace) -> None:
    from types import SimpleNamespace

    from atomc.distributed import netem

    ok, why = netem.available()
    if not ok:
        print(f"part (c): network namespaces are not available here ({why}); nothing measured.")
        return
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="atomc-swarm-bench-c-"))
    pkg = _package(C_CONFIG, args.c_micro, None, work / "pkg")
    n = args.stages + 1
    runs = {}
    for mbit in (args.c_mbit, 10_000.0):
        gbps = tuple(tuple(0.0 if i == k else mbit / 1000 for k in range(n)) for i in range(n))
        net = SimpleNamespace(devices=[SimpleNamespace(name="trainer")]
                              + [SimpleNamespace(name=f"stage{j}") for j in range(args.stages)],
                              bandwidth_gbps=gbps, delay_ms=tuple((0.0,) * n for _ in range(n)))
        with netem.EmulatedNetwork(net, subnet=232) as emu:
            if not runs:
                print(f"part (c): {C_CONFIG}, {args.stages} stages (one server each, slowdown "
                      f"1), one trainer; global batch {args.c_batch}, micro-batch {args.c_micro},"
                      f" {args.c_steps} steps per run; work in {work}\n{emu.describe()}")
            for compress in (False, True):
                key = (mbit, compress)
                runs[key] = link_run(args, pkg, work / f"{mbit:g}mbit-{int(compress)}", emu,
                                     compress)
                r = runs[key]
                print(f"  {mbit:g} Mbit/s, {'8-bit' if compress else 'fp32'}: step "
                      f"{np.mean(r['step_s']):.2f} s, {r['counted'] / 1e3:.1f} kB per "
                      f"micro-batch counted", flush=True)
    print("\nbytes per micro-batch, by message (encoded: protobuf ByteSize; calls per "
          "micro-batch x mean bytes)")
    print("| stage | call | message | fp32 bytes | 8-bit bytes | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    plain, packed = runs[(args.c_mbit, False)], runs[(args.c_mbit, True)]
    for key, (calls, size) in plain["messages"].items():
        c_calls, c_size = packed["messages"].get(key, (0.0, math.nan))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {calls:.2f} x {size:,.0f} | "
              f"{c_calls:.2f} x {c_size:,.0f} | {size / c_size:.2f} |")
    print("\n| link | codec | encoded kB / micro-batch | counted kB / micro-batch "
          "(trainer's interface, tx + rx, DHT included) | step s (mean +- sd, first step "
          "left out) |")
    print("|---|---|---:|---:|---:|")
    for (mbit, compress), r in runs.items():
        sd = np.std(r["step_s"], ddof=1) if len(r["step_s"]) > 1 else 0.0
        print(f"| {mbit:g} Mbit/s | {'8-bit' if compress else 'fp32'} | "
              f"{r['encoded'] / 1e3:.1f} | {r['counted'] / 1e3:.1f} | "
              f"{np.mean(r['step_s']):.2f} +- {sd:.2f} |")
    print(f"\npart (c) took {time.time() - t_start:.0f} s; logs in {work}")


# ---------------------------------------------------------------------------------------------

PARTS: dict[str, Callable[[argparse.Namespace], None]] = {"a": real_processes,
                                                             "b": simulated,
                                                             "c": link_bytes}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", action="append", choices=sorted(PARTS),
                    help="which part to run (repeatable); default: every part there is")
    a = ap.add_argument_group("part (a), real processes on loopback")
    a.add_argument("--duration", type=float, default=240.0,
                   help="seconds per run (default 240: phases of 60 s between churn events, "
                        "against a reaction of about 5 s to each)")
    a.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    a.add_argument("--batch", type=int, default=64, help="global batch, samples (default 64)")
    a.add_argument("--period", type=float, default=3.0,
                   help="rebalancing period T, seconds (default 3)")
    a.add_argument("--min-gain", type=float, default=0.03,
                   help="a move must raise the lower of its two stages by this fraction "
                        "(default 0.03: emulated devices keep a steady speed)")
    a.add_argument("--reanalyse", type=Path, metavar="WORKDIR",
                   help="print part (a)'s tables from the logs of an earlier run's work "
                        "directory instead of running it")
    b = ap.add_argument_group("part (b), simulated")
    b.add_argument("--seeds", type=int, default=10, help="seeds per row (SWARM App. I: 10)")
    b.add_argument("--peers", type=int, default=400, help="peers at the start")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulations run in parallel")
    c = ap.add_argument_group("part (c), bytes and step time over an emulated link")
    c.add_argument("--c-mbit", type=float, default=100.0, help="link rate, Mbit/s (default 100)")
    c.add_argument("--c-batch", type=int, default=64, help="global batch (default 64)")
    c.add_argument("--c-micro", type=int, default=16, help="micro-batch (default 16)")
    c.add_argument("--c-steps", type=int, default=6, help="steps per run (default 6)")
    c.add_argument("--c-timeout", type=float, default=240.0, help="seconds per run")
    args = ap.parse_args()
    if args.seeds < 1 or args.peers < 1 or args.jobs < 1:
        ap.error("--seeds, --peers and --jobs must be positive")
    return args


def main() -> int:
    args = parse_args()
    for part in args.part or sorted(PARTS):
        PARTS[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
