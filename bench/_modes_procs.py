"""bench/modes_bench.py part (b): peers and 4-stage layouts measured over emulated links.

What runs (root, iproute2; without them it says so and measures nothing):
1. examples/gpt.py `tiny` (micro-batch 2) is profiled for a GTX 1080 (estimated: a measured
   profile of this shared CPU is noise at this size); the devices are emulated from it: every
   forward and backward lasts --b-slowdown times what the profile says it takes (and no less
   than it took), one steady speed from the first call whatever else the box runs, as
   `atomc swarm serve --slowdown` does. Copies, the optimizer and the runtimes' own Python run
   at their real speed on this CPU.
2. four Linux network namespaces on a bridge, every link shaped by `tc htb` to 400 or 800
   Mbit/s times --b-rate-scale (the model's messages are small: scaled so that a micro-batch's
   values take about as long on a link as a stage computes them, as on the paper's GPUs);
3. in them, one after the other: four ATOM peers (`atomc peer`'s PeerTrainer, hivemind, each
   its own swap plan, averaging at the global batch), the 4-stage GPipe layout and the 4-stage
   1F1B layout (the layout runner; the layout `atomc place` finds), on the same global batch;
4. beside each measured time, `atomc compare`'s prediction for the same devices, network,
   global batch and slowdown.

Run as a worker: `python bench/_modes_procs.py layout|peer ...` (the orchestration starts them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT = ROOT / "examples" / "gpt.py"
B_MICRO = 2  # samples per micro-batch
B_ACCUM = 4  # the peers' C
B_LOCAL_STEPS = 3  # local steps each peer takes per global batch
B_MATCHMAKING_S = 1.0
B_MEMORY = 2 << 30  # the emulated devices' memory: every plan fits
B_HARDWARE = "gtx-1080"  # the profile the devices are emulated from
BANDWIDTHS = ((0.4, "400 Mbit/s"), (0.8, "800 Mbit/s"))
MODES = ("peers", "gpipe", "1f1b")


# ---------------------------------------------------------------------------------------------
# emulated devices


def emulate(stage, fwd_ns, bwd_ns) -> None:
    """Make `stage`'s forward and backward (of a micro-batch through index i) last fwd_ns(i)
    and bwd_ns(i) nanoseconds, or what they took when that was longer."""
    forward, backward = stage.forward, stage.backward

    def pad(t0: float, target_ns: int) -> None:
        left = target_ns / 1e9 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    def emulated_forward(index, micro, **kw):
        t0 = time.perf_counter()
        forward(index, micro, **kw)
        pad(t0, fwd_ns(index))

    def emulated_backward(index, micro, **kw):
        t0 = time.perf_counter()
        backward(index, micro, **kw)
        pad(t0, bwd_ns(index))

    stage.forward, stage.backward = emulated_forward, emulated_backward


# ---------------------------------------------------------------------------------------------
# workers


def worker_layout(a: argparse.Namespace) -> int:
    import torch

    from atomc.compare.costs import hardware_model
    from atomc.distributed.groups import load_layout
    from atomc.distributed.runner import LayoutConfig, LayoutTrainer
    from atomc.ir import Profile
    from atomc.runtime.package import load_swap_package
    from atomc.trace.load import call_with_options, load_model_file

    pkg = load_swap_package(a.package)
    module = load_model_file(pkg.model_file())
    hm = hardware_model(B_HARDWARE, Profile.load(a.profile), slowdown=a.slowdown)
    layout = load_layout(a.layout, None)
    with torch.device("meta"):
        shape = call_with_options(module.build_model, (pkg.plan.config,), {}, GPT)

    def batch_of(step: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1_000_003 + step)
            batch = module.example_inputs(shape, a.global_batch)
        return batch if isinstance(batch, tuple) else (batch,)

    cfg = LayoutConfig(package=a.package, layout=layout, global_batch=a.global_batch,
                       micro_batch=a.micro_batch, schedule=a.schedule,
                       optimizer={"lr": 1e-3}, timeout_s=a.timeout, metrics_path=a.metrics,
                       dp_reduce="p2p")
    trainer = LayoutTrainer(cfg, module.loss_fn, lambda: pkg.initial_state_dict(0))
    try:
        spec = trainer.spec
        fwd, bwd = hm.stage_compute_ns(spec.start, spec.stop)
        emulate(trainer.stage, lambda i: fwd, lambda i: bwd)
        while trainer.step_count < a.steps:
            trainer.step(batch_of(trainer.step_count))
        trainer.dist.barrier()
    finally:
        trainer.close()
    return 0


def worker_peer(a: argparse.Namespace) -> int:
    import torch

    from atomc.distributed.peer import PeerTrainer
    from atomc.distributed.peerconfig import PeerConfig
    from atomc.ir import Plan
    from atomc.runtime.package import load_swap_package
    from atomc.trace.load import call_with_options, load_model_file
    from atomc.units import ms_to_ns

    pkg = load_swap_package(a.package)
    plan = Plan.load(a.plan)  # the package's, with its sub-models' times
    module = load_model_file(pkg.model_file())
    with torch.device("meta"):
        shape = call_with_options(module.build_model, (plan.config,), {}, GPT)
    local = plan.accum * plan.batch_size
    seed = sum(a.name.encode())

    def batch_of(step: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + step)
            batch = module.example_inputs(shape, local)
        return batch if isinstance(batch, tuple) else (batch,)

    cfg = PeerConfig(package=a.package, run_id=a.run_id,
                     initial_peers=tuple(x for x in a.initial_peers.split(",") if x),
                     host_maddrs=(f"/ip4/{a.host}/tcp/0",), target_batch_size=a.global_batch,
                     rounds=a.rounds, accum=plan.accum, optimizer={"lr": 1e-3},
                     matchmaking_time_s=a.matchmaking, averaging_timeout_s=a.timeout,
                     connect_timeout_s=a.timeout, max_seconds=a.timeout * 3,
                     metrics_path=a.metrics, maddr_path=a.maddr_file, name=a.name,
                     finish_timeout_s=20.0, final_linger_s=2.0)
    peer = PeerTrainer(cfg, loss_fn=module.loss_fn, log=lambda s: print(f"[{a.name}] {s}",
                                                                        flush=True))
    try:
        subs = plan.submodels
        emulate(peer.trainer.executor,
                lambda i: round(ms_to_ns(subs[i].fwd_ms) * a.slowdown),
                lambda i: round(ms_to_ns(subs[i].bwd_ms) * a.slowdown))
        time_rounds(peer)
        if a.barrier:  # every peer has joined (and downloaded the state): all start together
            barrier = Path(a.barrier)
            (barrier / a.name).touch()
            deadline = time.monotonic() + a.timeout
            while len(list(barrier.iterdir())) < a.peers:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{a.name}: not every peer joined within {a.timeout:g} s")
                time.sleep(0.05)
        peer.train(batch_of)
        peer.linger(cfg.final_linger_s)
    finally:
        peer.close()
    return 0


def time_rounds(peer) -> None:
    """Record each averaging round's parts in the peer's metrics: when the peer asked for a
    group (`call`), when hivemind's StepControl turned RUNNING_ALLREDUCE (`group`: the group
    is assembled and this peer starts its all-reduce), when the round ended (`end`), the group
    in hivemind's order, and how long the check for finished peers before it took."""
    from hivemind.averaging.control import AveragingStage

    step, finished = peer.averager.step, peer._finished_peers

    def timed_step(*args, **kwargs):
        t_call = time.time()
        ctl = step(*args, **{**kwargs, "wait": False})
        t_group = None
        while not ctl.done():
            if t_group is None and ctl.stage == AveragingStage.RUNNING_ALLREDUCE:
                t_group = time.time()
            time.sleep(0.002)
        line = {"event": "averager", "call": t_call, "group": t_group, "end": time.time()}
        try:
            group = ctl.result()
        except BaseException:
            peer.metrics.write({**line, "failed": True})  # PeerTrainer logs the round as failed
            raise
        line["order"] = [str(v.get("name")) for v in (group or {}).values()
                         if isinstance(v, dict)]
        peer.metrics.write(line)
        return group

    def timed_finished():
        t0 = time.time()
        try:
            return finished()
        finally:
            peer.metrics.write({"event": "finished_check", "seconds": time.time() - t0})

    peer.averager.step, peer._finished_peers = timed_step, timed_finished


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("layout", "peer"))
    p.add_argument("--package", required=True)
    p.add_argument("--profile")
    p.add_argument("--plan")
    p.add_argument("--layout")
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=B_MICRO)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--slowdown", type=float, required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--run-id", default="modes")
    p.add_argument("--initial-peers", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--maddr-file")
    p.add_argument("--matchmaking", type=float, default=B_MATCHMAKING_S)
    p.add_argument("--name", default="peer")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--barrier", help="a folder: peers start training once all are in it")
    a = p.parse_args(argv)
    return worker_layout(a) if a.role == "layout" else worker_peer(a)


# ---------------------------------------------------------------------------------------------
# orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra})
    return env


def _start(emu, k: int, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    out = open(log, "w")  # the child holds its own copy
    try:
        return subprocess.Popen(emu.exec_prefix(k) + [sys.executable, __file__, *argv],
                                env=_env(env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def _wait(procs, logs, deadline: float, what: str) -> None:
    """Until every worker ended, one failed, or the deadline passed."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: workers still running after the timeout; see {logs[0]}")
        time.sleep(0.5)
    bad = [k for k, p in enumerate(procs) if p.returncode not in (None, 0)]
    if bad:
        raise SystemExit(f"{what}: workers {bad} failed:\n{logs[bad[0]].read_text()[-3000:]}")


def link_bytes(emu) -> dict[tuple[int, int], int]:
    """Bytes each shaped link has carried so far (`tc -s class show`: the sender's class for
    that destination), TCP/IP headers included."""
    import re

    out = {}
    for k in range(len(emu.network.devices)):
        text = subprocess.run(emu.exec_prefix(k) + ["tc", "-s", "class", "show", "dev",
                                                    emu.iface(k)],
                              capture_output=True, text=True, timeout=30).stdout
        for cls, sent in re.findall(r"class htb 1:(\d+) .*?Sent (\d+) bytes", text, re.S):
            if int(cls) >= 10:
                out[(k, int(cls) - 10)] = int(sent)
    return out


def run_layout(args, work: Path, emu, name: str, schedule: str, layout: Path, pkg: Path,
               profile: Path, global_batch: int) -> dict:
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    port = _free_port()
    procs, logs = [], []
    try:
        for k, dev in enumerate(emu.network.devices):
            log = work / f"{name}.{k}.log"
            logs.append(log)
            argv = ["layout", "--package", str(pkg), "--profile", str(profile), "--layout",
                    str(layout), "--schedule", schedule, "--global-batch", str(global_batch),
                    "--steps", str(args.b_steps + 1), "--slowdown", str(args.b_slowdown),
                    "--metrics", str(metrics), "--timeout", str(args.b_timeout / 2)]
            procs.append(_start(emu, k, argv, log, {
                "RANK": str(k), "WORLD_SIZE": str(len(emu.network.devices)), "LOCAL_RANK": "0",
                "MASTER_ADDR": emu.addr(0), "MASTER_PORT": str(port), "ATOMC_DEVICE": dev.name,
                "GLOO_SOCKET_IFNAME": emu.iface(k)}))
        _wait(procs, logs, time.monotonic() + args.b_timeout, name)
    finally:
        _kill(procs)
    steps = [json.loads(x)["step_ms"] / 1e3 for x in metrics.read_text().splitlines()]
    # the first step builds buffers and connections
    return {"times": steps[1:], "samples_per_round": float(global_batch), "batches": len(steps)}


def run_peers(args, work: Path, emu, name: str, pkg: Path, global_batch: int) -> dict:
    procs, logs = [], []
    metrics = [work / f"{name}.{k}.jsonl" for k in range(len(emu.network.devices))]
    for m in metrics:
        m.unlink(missing_ok=True)
    maddr = work / f"{name}.maddr"
    maddr.unlink(missing_ok=True)
    rounds = args.b_steps + 1
    run_id = "modes" + "".join(ch for ch in f"{os.getpid()}{name}" if ch.isalnum())
    barrier = work / f"{name}.barrier"
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir()
    try:
        for k in range(len(emu.network.devices)):
            log = work / f"{name}.{k}.log"
            logs.append(log)
            argv = ["peer", "--package", str(pkg), "--plan", str(work / "peer-plan.json"),
                    "--global-batch", str(global_batch),
                    "--rounds", str(rounds), "--slowdown", str(args.b_slowdown),
                    "--metrics", str(metrics[k]), "--timeout", str(args.b_timeout / 2),
                    "--run-id", run_id, "--host", emu.addr(k), "--name", f"peer{k}",
                    "--peers", str(len(emu.network.devices)), "--barrier", str(barrier)]
            if k == 0:
                argv += ["--maddr-file", str(maddr)]
            else:
                deadline = time.monotonic() + 60
                while not maddr.exists() and time.monotonic() < deadline:
                    if procs[0].poll() is not None:
                        raise SystemExit(f"{name}: the first peer ended:\n"
                                         f"{logs[0].read_text()[-3000:]}")
                    time.sleep(0.2)
                addrs = [a for a in maddr.read_text().split() if emu.addr(0) in a]
                argv += ["--initial-peers", ",".join(addrs)]
            procs.append(_start(emu, k, argv, log, {}))
        _wait(procs, logs, time.monotonic() + args.b_timeout, name)
    finally:
        _kill(procs)
    # a global batch: from one round's end to the next's, on every peer; the first round
    # holds the start (peers joining, downloading the state). hivemind's progress tracker
    # learns of the others' steps late, so a round may hold more than the global batch: its
    # samples are counted too
    gaps, samples = [], 0.0
    for m in metrics:
        events = [json.loads(x) for x in m.read_text().splitlines()]
        ends = [i for i, e in enumerate(events)
                if e.get("event") == "round" and not e.get("final")]
        gaps += [events[b]["time"] - events[a]["time"] for a, b in itertools.pairwise(ends)]
        if len(ends) > 1:
            steps = sum(1 for e in events[ends[0]:ends[-1]] if e.get("event") == "step")
            samples += steps * B_ACCUM * B_MICRO / (len(ends) - 1)
    return {"times": gaps, "samples_per_round": samples, "parts": round_parts(metrics)}


ROUND_PARTS = (
    ("ready", "the peers' last local steps ended within (s)"),
    ("check", "the check for finished peers before a round (DHT get, s)"),
    ("assembly", "first peer asks hivemind for a group -> the first member starts its all-reduce"),
    ("start", "first member starts -> the last member starts"),
    ("allreduce", "first member starts -> the last member's round ends"),
    ("after", "round ended -> the peer has loaded the averaged weights and counted the round (s)"),
    ("full", "rounds with every peer in one group (share of the measured rounds)"),
)


def round_parts(metrics: list[Path]) -> dict[str, float]:
    """The measured rounds (every round but the first and the final ones) taken apart, as
    means over the rounds (see ROUND_PARTS), from what `time_rounds` recorded."""
    by_epoch: dict[int, list[dict]] = {}
    for m in metrics:
        events = [json.loads(x) for x in m.read_text().splitlines()]
        last_step = check = averager = None
        for e in events:
            kind = e.get("event")
            if kind == "step":
                last_step = e["time"]
            elif kind == "finished_check":
                check = e["seconds"]
            elif kind == "averager":
                averager = e
            elif kind == "round" and not e.get("final") and averager and last_step:
                by_epoch.setdefault(e["epoch"], []).append(
                    {"ready": last_step, "check": check or 0.0, "round": e["time"],
                     "size": len(e["group"]), **averager})
                averager = None
    parts: dict[str, list[float]] = {k: [] for k, _ in ROUND_PARTS}
    full = 0
    epochs = sorted(by_epoch)[1:]  # the first round holds the start
    for epoch in epochs:
        xs = by_epoch[epoch]
        if len(xs) < len(metrics) or min(x["size"] for x in xs) < len(metrics) or any(
                x["group"] is None for x in xs):
            continue
        full += 1
        g0 = min(x["group"] for x in xs)
        parts["ready"].append(max(x["ready"] for x in xs) - min(x["ready"] for x in xs))
        parts["check"].append(statistics.mean(x["check"] for x in xs))
        parts["assembly"].append(g0 - min(x["call"] for x in xs))
        parts["start"].append(max(x["group"] for x in xs) - g0)
        parts["allreduce"].append(max(x["end"] for x in xs) - g0)
        parts["after"].append(statistics.mean(x["round"] - x["end"] for x in xs))
    out = {k: statistics.mean(v) for k, v in parts.items() if v}
    out["full"] = full / len(epochs) if epochs else 0.0
    return out


def part_b(args, work: Path) -> list[str]:
    from atomc.compare import Setting, compare, hardware_models, machines_of
    from atomc.compare.costs import placement_plan
    from atomc.distributed import netem
    from atomc.ir import Profile
    from atomc.place import place
    from atomc.place.network import Device, Network
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    ok, why = netem.available()
    if not ok:
        return ["## (b) measured", "", f"Not measured: {why}.", ""]
    t0 = time.time()
    work = work / "b"
    work.mkdir(parents=True, exist_ok=True)
    traced = trace_model(GPT, args.b_config, B_MICRO)
    prof_path = work / f"{args.b_config}.{B_HARDWARE}.profile.json"
    if prof_path.exists():
        profile = Profile.load(prof_path)
    else:
        # traced as the CPU runs it (the packages run here), estimated for the GPU
        profile = profile_model(traced, target=B_HARDWARE)
        profile.save(prof_path)
    n = 4
    global_batch = n * B_ACCUM * B_MICRO * B_LOCAL_STEPS
    micro = global_batch // B_MICRO

    def network(gbps: float) -> Network:
        scaled = gbps * args.b_rate_scale
        devices = tuple(Device(f"dev{k}", "box", B_HARDWARE, B_MEMORY) for k in range(n))
        return Network(devices=devices, delay_ms=tuple((0.0,) * n for _ in range(n)),
                       bandwidth_gbps=tuple((scaled,) * n for _ in range(n)),
                       name=f"b-{gbps:g}G-x{args.b_rate_scale:g}").check()

    setting = Setting(global_batch=global_batch, accum=B_ACCUM, sync=True,
                      matchmaking_s=B_MATCHMAKING_S, stages=(n,))
    from atomc.codegen import generate

    nets = {gbps: network(gbps) for gbps, _ in BANDWIDTHS}
    models = hardware_models([profile], machines_of(nets[BANDWIDTHS[0][0]]),
                             slowdown=args.b_slowdown)
    hm = models[B_HARDWARE]
    peer_plan = hm.peer_plan(B_MEMORY, B_ACCUM).plan
    generate(peer_plan, work / "peer-pkg", traced=traced)
    peer_plan.save(work / "peer-plan.json")
    lay_plan = placement_plan(hm, micro)
    generate(lay_plan, work / "layout-pkg", traced=traced)
    rows = []
    for gbps, label in BANDWIDTHS:
        net = nets[gbps]
        predicted = compare([profile], net, setting, modes=MODES, models=models).results
        layout = place(net, n, 1, plan=lay_plan, seed=0, budget_s=1.0, compare_random=False)
        lay_path = layout.save(work / f"layout-{gbps:g}.json")
        with netem.EmulatedNetwork(net) as emu:
            print(emu.describe(), flush=True)
            measured, carried = {}, {}
            before = link_bytes(emu)
            for mode in MODES:
                name = f"{mode}-{gbps:g}"
                print(f"(b) {label}: {mode} ...", flush=True)
                if mode == "peers":
                    xs = run_peers(args, work, emu, name, work / "peer-pkg", global_batch)
                else:
                    xs = run_layout(args, work, emu, name, mode, lay_path, work / "layout-pkg",
                                    prof_path, global_batch)
                after = link_bytes(emu)
                carried[mode] = {lane: after[lane] - before.get(lane, 0) for lane in after}
                before = after
                measured[mode] = xs
                print(f"(b) {label}: {mode} measured {statistics.mean(xs['times']):.3f} s "
                      f"for {xs['samples_per_round']:.0f} samples (predicted "
                      f"{predicted[mode].step_s:.3f} s for {global_batch})", flush=True)
                if "parts" in xs:
                    print(f"(b) {label}: peers' rounds: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in xs["parts"].items()), flush=True)
        rows.append((label, net, predicted, measured, carried))
    return render_b(args, rows, profile, peer_plan, global_batch, t0)


def render_b(args, rows, profile, peer_plan, global_batch, t0) -> list[str]:
    from bench._provenance import header

    cmd = (f"python bench/modes_bench.py --part b --b-config {args.b_config} --b-steps "
           f"{args.b_steps} --b-slowdown {args.b_slowdown:g} --b-rate-scale "
           f"{args.b_rate_scale:g}")
    out = header("(b) Small scale, measured", cmd, t0)
    out += [
        (f"examples/gpt.py `{args.b_config}`, micro-batch {B_MICRO}, profile estimated for "
         f"{B_HARDWARE}; four emulated devices (every forward and backward "
         f"{args.b_slowdown:g}x the profile's time); four network namespaces on a bridge, "
         f"every link `tc htb`-shaped to the bandwidth x {args.b_rate_scale:g} in packets of "
         f"at most 1500 bytes, no added delay. Global batch {global_batch} samples: the peers "
         f"({len(peer_plan.submodels)} sub-models, C = {peer_plan.accum}) take "
         f"{B_LOCAL_STEPS} local steps each and average (hivemind, matchmaking "
         f"{B_MATCHMAKING_S:g} s; the four start stepping together once all have joined); "
         f"the layouts run 4 stages x 1 replica, "
         f"{global_batch // B_MICRO} micro-batches a step. Measured: mean ± sd over the global "
         f"batches after the first ({args.b_steps} steps per layout; every peer's rounds). "
         f"A peer's round may hold more than the global batch: it sees the others' steps "
         f"through hivemind's progress tracker, late, and steps on meanwhile; `atomc compare` "
         f"predicts that (0.5 s late) and the samples a round, predicted and counted, are "
         f"side by side. Predicted: `atomc compare` for the same devices, links and slowdown. "
         f"Busiest link: the prediction's bytes per global batch on its busiest link beside "
         f"the bytes `tc` counted there per global batch (TCP/IP headers, and for the peers "
         f"hivemind's DHT and state downloads, included; the peers' prediction is the mean "
         f"over hivemind's group orders, which puts the mean share on every link)."),
        "",
        ("| link | scaled | mode | samples a round: predicted / measured | predicted s "
         "| measured s | error | error per sample | busiest link: predicted / counted bytes "
         "| bound by (predicted) |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for label, net, predicted, measured, carried in rows:
        names = [d.name for d in net.devices]
        scaled = net.bandwidth_gbps[0][1] * 1e3
        for mode in MODES:
            p, m = predicted[mode], measured[mode]
            xs = m["times"]
            mean = statistics.mean(xs)
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            err = (p.step_s - mean) / mean
            per = mean / m["samples_per_round"]
            err_sample = (p.per_sample_s() - per) / per
            link = "-"
            if p.links:
                a, b, nbytes, _ = p.links[0]
                batches = m.get("batches") or (args.b_steps + 1)
                counted = carried[mode].get((names.index(a), names.index(b)), 0) / batches
                link = f"{a} -> {b}: {nbytes / 1e3:.0f} / {counted / 1e3:.0f} kB"
            out.append(f"| {label} | {scaled:.1f} Mbit/s | {mode} "
                       f"| {p.samples} / {m['samples_per_round']:.0f} | {p.step_s:.3f} "
                       f"| {mean:.3f} ± {sd:.3f} | **{err:+.1%}** | {err_sample:+.1%} | {link} "
                       f"| {p.binding} |")
    out += ["", ("The peers' rounds taken apart (means over the measured rounds that held all four "
                 "peers; s): predicted / measured where the model has the part, measured alone "
                 "where it has none."), "",
            ("| link (scaled) | last local steps end within | check for finished peers "
             "| first call -> first member starts | first -> last member starts "
             "| first member starts -> last ends | loading the average | rounds of all four |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, net, predicted, measured, _ in rows:
        parts = measured["peers"].get("parts", {})
        p = predicted["peers"]
        if not parts or not p.feasible:
            continue
        bps = net.bandwidth_gbps[0][1] * 1e9
        window_s = p.detail["window_bytes"] * 8 / bps
        allreduce_s = p.detail["round_ns"]["mean"] / 1e9

        def got(k: str, parts: dict = parts) -> str:
            return f"{parts[k]:.3f}" if k in parts else "-"

        out.append(f"| {label} ({bps / 1e6:.1f} Mbit/s) | {got('ready')} | {got('check')} "
                   f"| {B_MATCHMAKING_S:.3f} / {got('assembly')} "
                   f"| {window_s:.3f} / {got('start')} | {allreduce_s:.3f} / {got('allreduce')} "
                   f"| {got('after')} | {parts.get('full', 0.0):.0%} |")
    out.append("")
    return out


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
