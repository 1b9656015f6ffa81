"""Convergence per byte: ATOM's averaging against DiLoCo on four peers over emulated links.

    python bench/diloco_bench.py                      # root, iproute2 (as modes_bench part b)
    python bench/diloco_bench.py --steps 32 --inner 8 --configs atom,8,8-int8   # a quick look

What runs (the netem setup of bench/modes_bench.py part (b), bench/_modes_procs.py):
1. examples/gpt.py `mini` (834k weights), micro-batch 2, C = 4 (512 tokens a local step), its
   peer plan for a 2 GiB GTX 1080 (estimated profile), generated as a package; every peer's
   local step is emulated: it lasts the plan's simulated swap step with the compute --slowdown
   times the profile's (what `atomc compare --slowdown` takes), or what it took when longer,
   one steady speed whatever else the box runs (emulating the sub-models' forwards and
   backwards alone, as modes_bench part (b) does, left the real copies, optimizer and Python
   of four peers on two shared cores: local steps 20% over the prediction);
2. four Linux network namespaces on a bridge, every link `tc htb`-shaped to --mbit each way;
3. in them, one configuration after another, four `atomc peer` trainers (PeerTrainer, the
   runtime `atomc peer` runs), each on its own byte-level slice of the Python standard
   library's sources (atomc.data.text.ByteBatches, its own seed), --steps local AdamW steps
   each (the same token budget for every configuration), starting together once all have
   joined:
   - `atom`: ATOM's averaging every local step (`--outer sgd --outer-lr 1 --inner-steps 1`:
     the weights averaged exactly, a global batch of one step of each peer);
   - `H` and `H-int8`: DiLoCo, `--outer nesterov` (lr 0.7, momentum 0.9) every H local steps,
     pseudo-gradients exact (float32) or int8 (`--round-dtype int8`);
   then the held-out loss of the final weights (every peer ends with the same ones) on
   windows of the text's last 5%, which no peer trains on;
4. beside each measured round, `atomc compare --modes diloco`'s prediction for the same
   devices, links, slowdown and H (the ATOM runs too: their timeline is DiLoCo's at H = 1 with
   exact rounds).

Reported per configuration: final held-out loss, the bytes each peer sent in its training
rounds (what the peers counted: hivemind's parts at the codec's size; and what `tc` counted
on the links from the moment all had joined to the end, final rounds and the DHT's traffic
included), wall time, measured and predicted time of a round, and the training-loss curve.
Run as a worker: `python bench/diloco_bench.py worker ...` (the orchestration starts them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import provenance

GPT = ROOT / "examples" / "gpt.py"
CONFIG = "mini"
MICRO = 2
ACCUM = 4
SEQ = 64
HARDWARE = "gtx-1080"
MEMORY = 2 << 30
PEERS = 4
MATCHMAKING_S = 1.0
HOLDOUT = 0.05
HELDOUT_WINDOWS = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=256, help="local steps each peer takes")
    p.add_argument("--inner", default="8,32,128", help="DiLoCo's H values")
    p.add_argument("--configs", help="comma-separated subset: atom, H, H-int8 (default all)")
    p.add_argument("--mbit", type=float, default=24.0, help="every link, each way (Mbit/s)")
    p.add_argument("--slowdown", type=float, default=150.0,
                   help="emulated devices: the profile's compute this many times slower")
    p.add_argument("--lr", type=float, default=2e-3, help="the inner AdamW's learning rate")
    p.add_argument("--work", default=str(ROOT / "build" / "diloco-bench"))
    p.add_argument("--timeout", type=float, default=1500.0, help="one configuration at most")
    p.add_argument("--output", help="also write the report (markdown) here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# worker: one peer


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    for name in ("package", "run_id", "host", "name", "metrics", "barrier", "outer",
                 "round_dtype", "maddr_file", "final"):
        p.add_argument(f"--{name.replace('_', '-')}", default=None)
    p.add_argument("--initial-peers", default="")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--inner", type=int, required=True)
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--timeout", type=float, required=True)
    a = p.parse_args(argv)

    from atomc.data.text import ByteBatches, stdlib_text
    from atomc.distributed.outer import OuterConfig
    from atomc.distributed.peer import PeerTrainer
    from atomc.distributed.peerconfig import PeerConfig
    from atomc.runtime.package import load_swap_package
    from atomc.trace.load import load_model_file

    pkg = load_swap_package(a.package)
    module = load_model_file(pkg.model_file())
    data = ByteBatches(stdlib_text(), SEQ, ACCUM * MICRO, seed=a.index + 1,
                       holdout_fraction=HOLDOUT)
    outer = OuterConfig.make(outer=a.outer, inner_steps=a.inner, round_dtype=a.round_dtype)
    cfg = PeerConfig(package=a.package, run_id=a.run_id,
                     initial_peers=tuple(x for x in a.initial_peers.split(",") if x),
                     host_maddrs=(f"/ip4/{a.host}/tcp/0",), rounds=a.steps // a.inner,
                     accum=ACCUM, optimizer={"lr": a.lr, "weight_decay": 0.0},
                     matchmaking_time_s=MATCHMAKING_S, averaging_timeout_s=60.0,
                     connect_timeout_s=60.0, max_seconds=a.timeout, metrics_path=a.metrics,
                     final_path=a.final, maddr_path=a.maddr_file, name=a.name,
                     finish_timeout_s=60.0, final_linger_s=3.0, outer=outer, min_peers=PEERS)
    peer = PeerTrainer(cfg, loss_fn=module.loss_fn,
                       log=lambda s: print(f"[{a.name}] {s}", flush=True))
    try:
        emulate_steps(peer.trainer, a.step_s)
        barrier = Path(a.barrier)
        (barrier / a.name).touch()
        deadline = time.monotonic() + 120
        while len(list(barrier.iterdir())) < PEERS:
            if time.monotonic() > deadline:
                raise SystemExit(f"{a.name}: not every peer joined within 120 s")
            time.sleep(0.05)
        peer.train(lambda step: (data.batch(step),))
        peer.save_final()
        peer.linger(cfg.final_linger_s)
    finally:
        peer.close()
    return 0


def emulate_steps(trainer, step_s: float) -> None:
    """Make every local step last `step_s` (the emulated device's simulated swap step), or what
    it took when that was longer: one steady speed whatever else the box runs."""
    step = trainer.step

    def emulated(batch):
        t0 = time.perf_counter()
        loss = step(batch)
        left = step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return loss

    trainer.step = emulated


# ---------------------------------------------------------------------------------------------
# orchestration


def configurations(args) -> list[tuple[str, str, int, str | None]]:
    """(name, outer, H, round dtype) of every configuration asked for."""
    out = [("atom", "sgd", 1, None)]
    for h in [int(x) for x in args.inner.split(",") if x]:
        out += [(f"{h}", "nesterov", h, None), (f"{h}-int8", "nesterov", h, "int8")]
    if args.configs:
        wanted = {x.strip() for x in args.configs.split(",") if x.strip()}
        out = [c for c in out if c[0] in wanted]
    return out


def setup(args, work: Path):
    """The profile, the peers' plan and package, the network."""
    from atomc.codegen import generate
    from atomc.compare import hardware_models, machines_of
    from atomc.ir import Profile
    from atomc.place.network import Device, Network
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model(GPT, CONFIG, MICRO)  # traced as this CPU runs the package
    prof_path = work / f"{CONFIG}.{HARDWARE}.profile.json"
    if prof_path.exists():
        profile = Profile.load(prof_path)
    else:
        profile = profile_model(traced, target=HARDWARE)
        profile.save(prof_path)
    gbps = args.mbit / 1e3
    devices = tuple(Device(f"dev{k}", "box", HARDWARE, MEMORY) for k in range(PEERS))
    net = Network(devices=devices, delay_ms=tuple((0.0,) * PEERS for _ in range(PEERS)),
                  bandwidth_gbps=tuple((gbps,) * PEERS for _ in range(PEERS)),
                  name=f"diloco-{args.mbit:g}M").check()
    models = hardware_models([profile], machines_of(net), slowdown=args.slowdown)
    peer = models[HARDWARE].peer_plan(MEMORY, ACCUM)
    args.step_s = peer.step_ns / 1e9
    generate(peer.plan, work / "pkg", traced=traced)
    peer.plan.save(work / "plan.json")
    return profile, net, models, peer.plan


def predict(profile, net, models, inner: int, round_dtype: str | None):
    from atomc.compare import Setting, compare

    setting = Setting(global_batch=PEERS * ACCUM * MICRO, accum=ACCUM, sync=True,
                      matchmaking_s=MATCHMAKING_S, inner_steps=inner, round_dtype=round_dtype)
    return compare([profile], net, setting, modes=("diloco",), models=models).results["diloco"]


def run_config(args, work: Path, emu, name: str, outer: str, inner: int,
               round_dtype: str | None) -> dict:
    from bench._modes_procs import _kill, _wait, link_bytes

    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    barrier = d / "barrier"
    barrier.mkdir()
    run_id = "diloco" + "".join(ch for ch in f"{os.getpid()}{name}" if ch.isalnum())
    procs, logs = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               HIVEMIND_LOGLEVEL="ERROR")
    t0 = time.time()
    before = link_bytes(emu)
    joined_bytes = None
    try:
        for k in range(PEERS):
            log = d / f"peer{k}.log"
            logs.append(log)
            argv = ["worker", "--package", str(work / "pkg"),
                    "--run-id", run_id, "--host", emu.addr(k), "--name", f"peer{k}",
                    "--metrics", str(d / f"peer{k}.jsonl"), "--barrier", str(barrier),
                    "--outer", outer, "--index", str(k), "--steps", str(args.steps),
                    "--inner", str(inner), "--step-s", str(args.step_s),
                    "--lr", str(args.lr), "--timeout", str(args.timeout),
                    "--final", str(d / f"peer{k}.pt")]
            if round_dtype:
                argv += ["--round-dtype", round_dtype]
            if k == 0:
                argv += ["--maddr-file", str(d / "maddr")]
            else:
                deadline = time.monotonic() + 120
                while not (d / "maddr").exists() and time.monotonic() < deadline:
                    if procs[0].poll() is not None:
                        raise SystemExit(f"{name}: the first peer ended:\n"
                                         f"{logs[0].read_text()[-3000:]}")
                    time.sleep(0.2)
                addrs = [x for x in (d / "maddr").read_text().split() if emu.addr(0) in x]
                argv += ["--initial-peers", ",".join(addrs)]
            out = open(log, "w")
            try:
                procs.append(subprocess.Popen(
                    emu.exec_prefix(k) + [sys.executable, __file__, *argv], env=env, cwd=ROOT,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            finally:
                out.close()
        deadline = time.monotonic() + 180
        while len(list(barrier.iterdir())) < PEERS and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.02)
        joined_bytes = link_bytes(emu)  # the joins' state downloads are before this
        t_train = time.time()
        _wait(procs, logs, time.monotonic() + args.timeout, name)
    finally:
        _kill(procs)
    after = link_bytes(emu)
    base = joined_bytes or before
    tc_sent = {k: sum(v - base.get(lane, 0) for lane, v in after.items() if lane[0] == k)
               for k in range(PEERS)}
    events = {k: [json.loads(x) for x in (d / f"peer{k}.jsonl").read_text().splitlines()]
              for k in range(PEERS)}
    return {"name": name, "events": events, "tc_sent": tc_sent, "wall_s": time.time() - t_train,
            "setup_s": t_train - t0, "final": d / "peer0.pt"}


def heldout_loss(final: Path) -> float:
    import torch

    from atomc.data.text import ByteBatches, stdlib_text
    from atomc.runtime.checkpoint import load_checkpoint

    sys.path.insert(0, str(GPT.parent))
    import gpt

    data = ByteBatches(stdlib_text(), SEQ, 1, seed=0, holdout_fraction=HOLDOUT)
    tokens = data.holdout(HELDOUT_WINDOWS)
    model = gpt.build_model(CONFIG)
    model.load_state_dict(load_checkpoint(final)["params"])
    model.eval()
    with torch.no_grad():
        return float(gpt.loss_fn(model(tokens), (tokens,)))


def summarize(run: dict, steps: int) -> dict:
    """Bytes, round times, losses of one configuration, over the four peers."""
    sent, final_sent, gaps, losses, utilization, local = [], [], [], {}, [], []
    for _k, ev in run["events"].items():
        rounds = [e for e in ev if e.get("event") == "round" and not e.get("final")]
        finals = [e for e in ev if e.get("event") == "round" and e.get("final")]
        sent.append(sum(e.get("sent_bytes", 0) for e in rounds))
        final_sent.append(sum(e.get("sent_bytes", 0) for e in finals))
        ends = [e["time"] for e in rounds]
        gaps += [b - a for a, b in itertools.pairwise(ends)]
        for e in ev:
            if e.get("event") == "step":
                losses.setdefault(e["step"], []).append(e["loss"])
        done = [e for e in ev if e.get("event") == "done"]
        step_times = [e["time"] for e in ev if e.get("event") == "step"]
        if done and step_times and rounds:
            compute = done[0]["compute_s"]
            local.append(compute / len(step_times))
            # the training window: from the first step's start to the last round's end
            window = rounds[-1]["time"] - step_times[0] + compute / len(step_times)
            utilization.append(compute / window)
    curve = []
    window = max(steps // 8, 1)
    for start in range(0, steps, window):
        xs = [statistics.mean(losses[s]) for s in range(start, start + window) if s in losses]
        if xs:
            curve.append(statistics.mean(xs))
    return {"sent": statistics.mean(sent), "final_sent": statistics.mean(final_sent),
            "tc_sent": statistics.mean(run["tc_sent"].values()),
            "round_s": statistics.mean(gaps) if gaps else 0.0,
            "round_sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            "rounds_measured": len(gaps), "curve": curve,
            "utilization": statistics.mean(utilization) if utilization else 0.0,
            "local_step_s": statistics.mean(local) if local else 0.0}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    args = parse_args(argv)
    from atomc.distributed import netem

    ok, why = netem.available()
    if not ok:
        print(f"not measured: {why}")
        return 0
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    profile, net, models, plan = setup(args, work)
    rows = []
    with netem.EmulatedNetwork(net) as emu:
        print(emu.describe(), flush=True)
        for name, outer, inner, rd in configurations(args):
            if args.steps % inner:
                raise SystemExit(f"--steps {args.steps} is not a multiple of H = {inner}")
            predicted = predict(profile, net, models, inner, rd)
            print(f"{name}: predicted round {predicted.detail['cycle_ns'] / 1e9:.3f} s",
                  flush=True)
            run = run_config(args, work, emu, name, outer, inner, rd)
            s = summarize(run, args.steps)
            s.update(name=name, inner=inner, round_dtype=rd or "float32", outer=outer,
                     wall_s=run["wall_s"], heldout=heldout_loss(run["final"]),
                     predicted_round_s=predicted.detail["cycle_ns"] / 1e9,
                     predicted_utilization=predicted.detail["utilization"],
                     predicted_sent=predicted.detail["round_bytes_per_peer"]["dev0"]
                     * args.steps // inner)
            rows.append(s)
            print(f"{name}: held-out {s['heldout']:.4f}, sent {s['sent'] / 1e6:.3f} MB a peer "
                  f"(tc {s['tc_sent'] / 1e6:.3f} MB), wall {s['wall_s']:.0f} s, round "
                  f"{s['round_s']:.3f} s measured / {s['predicted_round_s']:.3f} s predicted",
                  flush=True)
    report = render(args, rows, plan, t0)
    print("\n" + report)
    if args.output:
        Path(args.output).write_text(report)
    (work / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


def render(args, rows: list[dict], plan, t0: float) -> str:

    atom = next((r for r in rows if r["name"] == "atom"), None)
    cmd = "python bench/diloco_bench.py" + "".join(
        f" --{k} {v}" for k, v in (("steps", args.steps), ("inner", args.inner),
                                   ("configs", args.configs), ("mbit", f"{args.mbit:g}"),
                                   ("slowdown", f"{args.slowdown:g}"), ("lr", f"{args.lr:g}"))
        if v is not None)
    out = [provenance(t0), "", f"Command: `{cmd}`", "",
           (f"examples/gpt.py `{CONFIG}`, {len(plan.submodels)} sub-models, C = {ACCUM} x "
           f"micro-batch {MICRO} x {SEQ} tokens; 4 peers, links {args.mbit:g} Mbit/s each way "
           f"(tc htb), every local step {args.step_s:.3f} s (the {HARDWARE} profile's swap step "
           f"at {args.slowdown:g}x its compute) or longer when it took longer; "
           f"{args.steps} local steps a peer ({PEERS * args.steps * ACCUM * MICRO * SEQ} tokens "
           f"in all); inner AdamW lr {args.lr:g}; DiLoCo's outer Nesterov lr 0.7, momentum 0.9."),
           "",
           ("| run | H | rounds | round dtype | held-out loss | vs ATOM | sent a peer, rounds "
           "(MB) | vs ATOM | final rounds (MB) | tc, after joining (MB) | wall (s) | round: "
           "measured / predicted (s) | error | local step (s) | compute utilization: "
           "measured / predicted |"),
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs_loss = f"{(r['heldout'] / atom['heldout'] - 1):+.2%}" if atom else "-"
        vs_bytes = f"{r['sent'] / atom['sent']:.2%}" if atom and atom["sent"] else "-"
        err = ((r["predicted_round_s"] - r["round_s"]) / r["round_s"]
               if r["round_s"] else 0.0)
        out.append(f"| {r['name']} | {r['inner']} | {args.steps // r['inner']} | "
                   f"{r['round_dtype']} | {r['heldout']:.4f} | {vs_loss} | "
                   f"{r['sent'] / 1e6:.3f} | {vs_bytes} | {r['final_sent'] / 1e6:.3f} | "
                   f"{r['tc_sent'] / 1e6:.3f} | {r['wall_s']:.0f} | {r['round_s']:.3f} ± "
                   f"{r['round_sd']:.3f} / {r['predicted_round_s']:.3f} | {err:+.1%} | "
                   f"{r['local_step_s']:.3f} | {r['utilization']:.0%} / "
                   f"{r['predicted_utilization']:.0%} |")
    out += ["", "Training loss (mean of the four peers) over eighths of the run:", "",
            "| run | " + " | ".join(f"{i + 1}/8" for i in range(8)) + " |",
            "|---|" + "---:|" * 8]
    for r in rows:
        out.append(f"| {r['name']} | " + " | ".join(f"{x:.3f}" for x in r["curve"]) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
