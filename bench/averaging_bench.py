"""What one hivemind averaging round costs, part by part, with atomc peer's averager.

    python bench/averaging_bench.py --mbit 12,24 --bytes 3337216     # netns links (root)
    python bench/averaging_bench.py --loopback --bytes 3337216        # no shaping

n processes, each a DHT node and the DecentralizedAverager atomc peer builds
(atomc.distributed.averaging.make_averager: min_group_size 2, the given matchmaking time, its
request timeout), average one float32 vector of --bytes over links of --mbit each way (four
network namespaces on a bridge, `tc htb` per destination, packets of at most 1500 bytes, as
bench/modes_bench.py part (b)), or over loopback with no shaping (--loopback: what the
protocol and the processes cost without the links). Every round, peer k calls `averager.step`
at a common wall-clock moment plus k x --stagger seconds; the averager's own stage flags
(hivemind's StepControl, polled every millisecond) say when the group was assembled (the
stage turns RUNNING_ALLREDUCE: the group is assembled and this peer starts its all-reduce)
and when the round ended. Printed per round: the first call to the first member's start, the
spread of the members' starts, the all-reduce from the first start to the last end, and the
bytes `tc` counted on each link; then the means, beside atomc.compare.peers's model of the
same round over the same links (`predicted_allreduce`). `--trace S` samples every link's
byte counter each S seconds into the run's JSON (in --work), with each round's hivemind group
order, for taking a round apart by link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(a: argparse.Namespace) -> int:
    import torch

    from atomc.distributed.averaging import make_averager
    from atomc.distributed.hive import import_hivemind, start_dht
    from atomc.distributed.peerconfig import PeerConfig

    hm = import_hivemind()
    from hivemind.averaging.control import AveragingStage

    initial = tuple(x for x in a.initial_peers.split(",") if x)
    dht = start_dht(hm, initial, (f"/ip4/{a.host}/tcp/0",), (), 30.0)
    if a.maddr_file:
        Path(a.maddr_file).write_text("\n".join(str(x) for x in dht.get_visible_maddrs()))
    cfg = PeerConfig(package="-", run_id=a.run_id, matchmaking_time_s=a.matchmaking,
                     averaging_timeout_s=60.0)
    values = torch.full((a.bytes // 4,), float(a.index))
    averager = make_averager(hm, [values], dht, cfg, lambda: ({}, [], None))
    out = open(a.out, "w")
    try:
        for r in range(a.rounds):
            at = a.start + r * a.period + a.index * a.stagger
            time.sleep(max(at - time.time(), 0.0))
            with averager.get_tensors() as ts:
                ts[0].fill_(float(a.index))
            t_call = time.time()
            ctl = averager.step(weight=1.0, gather={"i": a.index}, timeout=a.period,
                                allow_retries=True, wait=False)
            t_group = None
            while not ctl.done():
                if t_group is None and ctl.stage == AveragingStage.RUNNING_ALLREDUCE:
                    t_group = time.time()
                time.sleep(0.001)
            t_end = time.time()
            try:
                group = ctl.result()
                size = len(group)
                order = [v["i"] for v in group.values()]  # hivemind's shuffled group order
            except Exception as e:  # noqa: BLE001 - a failed round is a row too
                size, order = 0, []
                print(f"round {r}: {type(e).__name__}: {e}", flush=True)
            with averager.get_tensors() as ts:
                mean = float(ts[0][:1000].mean())
            out.write(json.dumps({"round": r, "peer": a.index, "call": t_call, "group": t_group,
                                  "end": t_end, "size": size, "order": order,
                                  "mean": mean}) + "\n")
            out.flush()
    finally:
        out.close()
        averager.shutdown()
        dht.shutdown()
    return 0


def run(a: argparse.Namespace, mbit: float | None, work: Path) -> dict:
    from bench._modes_procs import _env, _kill, link_bytes

    n = a.peers
    tag = (f"{'lo' if mbit is None else f'{mbit:g}M'}-{a.bytes}-s{a.stagger:g}"
           + (f"-q{a.queue_packets}" if a.queue_packets else ""))
    outs = [work / f"{tag}.{k}.jsonl" for k in range(n)]
    maddr = work / f"{tag}.maddr"
    maddr.unlink(missing_ok=True)
    emu = None
    if mbit is not None:
        from atomc.distributed import netem
        from atomc.place.network import Device, Network

        devices = tuple(Device(f"dev{k}", "box", "cpu", 1 << 30) for k in range(n))
        net = Network(devices=devices, delay_ms=tuple((0.0,) * n for _ in range(n)),
                      bandwidth_gbps=tuple((mbit / 1e3,) * n for _ in range(n)), name=tag)
        emu = netem.EmulatedNetwork(net.check()).up()
        if a.queue_packets:  # each link's queue: pfifo of this many packets (default 1000)
            for k in range(n):
                for m in range(n):
                    if m != k:
                        subprocess.run(emu.exec_prefix(k) + [
                            "tc", "qdisc", "add", "dev", emu.iface(k), "parent", f"1:{10 + m}",
                            "handle", f"{10 + m}:", "pfifo", "limit", str(a.queue_packets)],
                            check=True, capture_output=True, timeout=30)
    run_id = "avg" + "".join(ch for ch in f"{os.getpid()}{tag}" if ch.isalnum())
    procs = []
    try:
        # every peer joins first; the rounds start together well after
        start = time.time() + a.warmup
        for k in range(n):
            host = emu.addr(k) if emu else "127.0.0.1"
            argv = [sys.executable, __file__, "--worker", "--index", str(k), "--host", host,
                    "--out", str(outs[k]), "--bytes", str(a.bytes), "--rounds", str(a.rounds),
                    "--period", str(a.period), "--start", f"{start:.3f}",
                    "--stagger", str(a.stagger), "--matchmaking", str(a.matchmaking),
                    "--run-id", run_id]
            if k == 0:
                argv += ["--maddr-file", str(maddr)]
            else:
                deadline = time.monotonic() + 60
                while not maddr.exists():
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the first peer did not start; see "
                                         f"{work / f'{tag}.0.log'}")
                    time.sleep(0.1)
                addrs = [x for x in maddr.read_text().split() if host.rsplit(".", 1)[0] in x
                         or "127.0.0.1" in x]
                argv += ["--initial-peers", ",".join(addrs)]
            prefix = emu.exec_prefix(k) if emu else []
            log = open(work / f"{tag}.{k}.log", "w")
            procs.append(subprocess.Popen(prefix + argv, env=_env({}), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        before = link_bytes(emu) if emu else {}
        deadline = start + a.rounds * a.period + 60
        trace = []  # (time, bytes each link has carried) every --trace seconds
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if emu and a.trace:
                trace.append((time.time(), link_bytes(emu)))
                time.sleep(a.trace)
            else:
                time.sleep(0.5)
        after = link_bytes(emu) if emu else {}
    finally:
        _kill(procs)
        if emu:
            emu.down()
    rows = [json.loads(x) for o in outs if o.exists() for x in o.read_text().splitlines()]
    return {"tag": tag, "mbit": mbit, "rows": rows,
            "trace": [(t, {f"{s}->{d}": v for (s, d), v in x.items()}) for t, x in trace],
            "link_bytes": {f"{s}->{d}": after[(s, d)] - before.get((s, d), 0) for s, d in after}}


def predicted_allreduce(a: argparse.Namespace, mbit: float) -> tuple[float, int, float]:
    """The peers' model of the same round, means over the group orders: seconds from the
    leader's start to the last member's end, the busiest link's bytes and the share of the
    round it sends."""
    from atomc.compare.modes import Setting
    from atomc.compare.peers import averaging_programs, group_orders, share_parts
    from atomc.simulate.network import Links, simulate_programs

    s = Setting(global_batch=1)
    group = list(range(a.peers))
    shares = share_parts(a.bytes // 4, a.peers, 4, s.averaging_part_bytes)
    links = Links.uniform(a.peers, mbit * 1e6)
    ends, busiest, busy = [], [], []
    for order in group_orders(group, s.seed):
        jobs = averaging_programs(order, 0, 0, shares, s.stream_window_bytes)
        sim = simulate_programs([[*jobs[d], ("mark", 0)] for d in group], links)
        ends.append(sim.step_end(0))
        lane = max(sim.link_bytes, key=sim.link_bytes.get)
        busiest.append(sim.link_bytes[lane])
        busy.append(sim.link_busy_ns[lane] / ends[-1])
    return statistics.mean(ends) / 1e9, round(statistics.mean(busiest)), statistics.mean(busy)


def round_bytes(trace: list, t0: float, t1: float) -> tuple[int, int] | None:
    """Bytes all links and the busiest link carried from t0 to t1 (50 ms either side), from
    the sampled counters; None when the samples do not cover it."""
    before = [x for t, x in trace if t <= t0 - 0.05]
    after = [x for t, x in trace if t >= t1 + 0.05]
    if not before or not after:
        return None
    a, b = before[-1], after[0]
    carried = [b[k] - a[k] for k in a if k in b]
    return sum(carried), max(carried)


def summarize(res: dict, a: argparse.Namespace) -> list[str]:
    rows = res["rows"]
    lines = [(f"{res['tag']}: {a.peers} peers, {a.bytes} bytes, matchmaking "
              f"{a.matchmaking:g} s, stagger {a.stagger:g} s")]
    mm, ar, total, wire, busy = [], [], [], [], []
    payload = 2 * (a.peers - 1) * (a.bytes // 4 * 4)  # every member's copies and averages
    for r in sorted({x["round"] for x in rows}):
        xs = [x for x in rows if x["round"] == r]
        sizes = sorted(x["size"] for x in xs)
        first = min(x["call"] for x in xs)
        groups = [x["group"] for x in xs if x["group"] is not None]
        end = max(x["end"] for x in xs)
        if not groups or len(xs) < a.peers or min(sizes) < a.peers:
            lines.append(f"  round {r}: groups {sizes} (not one group of all)")
            continue
        g0 = min(groups)
        mm.append(g0 - first)
        ar.append(end - g0)
        total.append(end - first)
        line = (f"  round {r} (order {xs[0].get('order')}): first member starts "
                f"{g0 - first:.3f} s after the first call (the last +{max(groups) - g0:.3f}), "
                f"all-reduce {end - g0:.3f} s, round {end - first:.3f} s")
        carried = round_bytes(res["trace"], g0, end) if res.get("trace") else None
        if carried:
            on_wire, busiest = carried
            wire.append(on_wire / payload)
            busy.append(busiest * 8 / (res["mbit"] * 1e6) / (end - g0))
            line += (f"; on the links {wire[-1]:.3f} x the parts' bytes, the busiest link "
                     f"{busiest / 1e3:.0f} kB, sending {busy[-1]:.0%} of the all-reduce")
        lines.append(line)
    if ar:
        sd = statistics.stdev(ar) if len(ar) > 1 else 0.0
        lines.append(f"  mean: first member starts after {statistics.mean(mm):.3f} s, all-reduce "
                     f"{statistics.mean(ar):.3f} ± {sd:.3f} s, round "
                     f"{statistics.mean(total):.3f} s over {len(ar)} rounds")
    if wire:
        lines.append(f"  mean on the links: {statistics.mean(wire):.3f} x the parts' bytes; the "
                     f"busiest link sending {statistics.mean(busy):.0%} of the all-reduce")
    if res["mbit"] is not None:
        seconds, busiest, share = predicted_allreduce(a, res["mbit"])
        lines.append(f"  model (atomc.compare.peers, mean over hivemind's group orders): "
                     f"all-reduce {seconds:.3f} s, the busiest link {busiest / 1e3:.0f} kB, "
                     f"sending {share:.0%} of it")
    if res["link_bytes"]:
        per = {k: v / max(len(total), 1) for k, v in res["link_bytes"].items()}
        lines.append("  tc bytes per round: " + ", ".join(f"{k} {v / 1e3:.0f} kB"
                                                        for k, v in sorted(per.items())))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--out")
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--initial-peers", default="")
    p.add_argument("--maddr-file")
    p.add_argument("--run-id", default="avg")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--bytes", type=int, default=3337216, help="the averaged vector (float32)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--period", type=float, default=8.0, help="seconds between round starts")
    p.add_argument("--stagger", type=float, default=0.0, help="peer k calls k x this later")
    p.add_argument("--matchmaking", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--mbit", default="12,24", help="link rates, Mbit/s (each a run)")
    p.add_argument("--trace", type=float, default=0.0,
                   help="sample every link's byte counter this often (s) into the JSON")
    p.add_argument("--queue-packets", type=int, default=0,
                   help="give every link a queue of this many packets (default: the "
                        "device's txqueuelen, 1000)")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
    p.add_argument("--work", default=str(ROOT / "build" / "averaging-bench"))
    a = p.parse_args()
    if a.worker:
        return worker(a)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rates = [None] if a.loopback else [float(x) for x in a.mbit.split(",") if x]
    if not a.loopback:
        from atomc.distributed import netem

        ok, why = netem.available()
        if not ok:
            print(f"averaging_bench: {why}; or measure over loopback with --loopback",
                  file=sys.stderr)
            return 2
    for mbit in rates:
        res = run(a, mbit, work)
        print("\n".join(summarize(res, a)), flush=True)
        (work / f"{res['tag']}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
