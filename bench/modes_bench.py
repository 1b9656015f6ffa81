"""Which way to train: ATOM's comparison of peers and pipelines, predicted and measured.

    python bench/modes_bench.py --part a        # Table III's settings, predicted (seconds)
    python bench/modes_bench.py --part c        # Fig. 16's setting, predicted
    python bench/modes_bench.py --part b        # small scale, measured (root, iproute2)
    python bench/modes_bench.py --part x        # where pipelines overtake peers, predicted

(a) ATOM Section V-B1 (Table III, Fig. 14, Fig. 15): four GPUs of one kind (GTX 1080, GTX 1080
    Ti, V100) at 400 Mbit/s, 800 Mbit/s and 10 Gbit/s, GPT-3 Small to 13B (18 layers) and 175B
    (2 blocks), C = 4, forward and backward only (no averaging, no optimizer step: the paper
    disabled both). `atomc compare` on profiles estimated for each GPU: ATOM peers (each GPU
    its own swap plan at C = 4), 4-stage GPipe, 4-stage 1F1B and 4-stage PipeDream (the
    modelled asynchronous baseline, `--modes pipedream`) over the same global batch (4 GPUs x C
    mini-batches). Per-mini-batch GPU time (the paper's "per result GPU time": the
    reciprocal of mini-batches per GPU per second) and GPU utilisation (compute-busy share).
(c) ATOM Section V-B2 (Fig. 16): three 4-GPU servers (V100, 1080 Ti, 1080) in three subnets;
    "local": GPUs of one server talk over a fast link, servers over a slow one; "remote":
    every pair over the slow one. Global batch 256 mini-batches, averaging and optimizer on:
    ATOM on the same GPUs as 2 pipelines (V100 and 1080 Ti servers) and 3 pipelines.
(b) Small scale, measured: see `part_b`.

Profiles are estimated from `bench/_modes_model.py` (examples/gpt.py with a layer count, for
Table III's trimmed 13B and 175B) and kept in --work (reused when present).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import header

MODEL = ROOT / "bench" / "_modes_model.py"
GPUS = ("gtx-1080", "gtx-1080-ti", "v100-32gb")
# Table III: (label, gpt.py configuration, layers kept)
TABLE_III = (("GPT-3 Small", "gpt3-small", None), ("GPT-3 Medium", "gpt3-medium", None),
             ("GPT-3 Large", "gpt3-large", None), ("GPT-3 XL", "gpt3-xl", None),
             ("GPT-3 2.7B", "gpt3-2.7b", None), ("GPT-3 6.7B", "gpt3-6.7b", None),
             ("GPT-3 13B (18 layers)", "gpt3-13b", 18), ("GPT-3 175B (2 blocks)", "gpt3-175b", 2))
BANDWIDTHS = ((0.4, "400 Mbit/s"), (0.8, "800 Mbit/s"), (10.0, "10 Gbit/s"))
ACCUM = 4
BATCH = 1  # samples per mini-batch: one sequence of 2048 tokens
# ATOM Fig. 15, GPT-3 175B (2 blocks) on localhost: GPU utilisation by nvidia-smi
PAPER_UTIL = {"peers": 0.919, "1f1b": 0.463, "gpipe": 0.183}
FAST_GBPS = 100.0  # "local": GPUs of one server (PCIe, no throttling)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("a", "b", "c", "x", "all"), default="all")
    p.add_argument("--configs", help="comma-separated gpt.py configurations (default Table III)")
    p.add_argument("--gpus", default=",".join(GPUS))
    p.add_argument("--work", default=str(ROOT / "build" / "modes-bench"),
                   help="profiles and run files (reused)")
    p.add_argument("--budget-s", type=float, default=1.0, help="atomc place per stage count")
    p.add_argument("--c-configs", default="gpt3-medium,gpt3-large,gpt3-xl",
                   help="part (c): configurations")
    p.add_argument("--c-mbit", type=float, default=400.0, help="part (c): the slow link")
    p.add_argument("--x-configs", default="gpt3-small,gpt3-medium,gpt3-large,gpt3-xl,gpt3-2.7b",
                   help="crossover: configurations")
    p.add_argument("--x-gpus", default="gtx-1080-ti,v100-32gb", help="crossover: GPUs")
    p.add_argument("--x-batches", default="64,256",
                   help="crossover: global batches, in mini-batches")
    # part (b)
    p.add_argument("--b-config", default="mini", help="part (b): gpt.py configuration")
    p.add_argument("--b-steps", type=int, default=4, help="part (b): steps measured per run")
    p.add_argument("--b-slowdown", type=float, default=250.0,
                   help="part (b): emulated devices compute this many times slower than the "
                        "profile")
    p.add_argument("--b-rate-scale", type=float, default=0.03,
                   help="part (b): multiply 400 and 800 Mbit/s by this (the model is small)")
    p.add_argument("--b-timeout", type=float, default=240.0)
    p.add_argument("--output", help="also write the report (markdown) here")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# profiles


def estimated_profile(work: Path, config: str, layers: int | None, target: str,
                      batch: int = BATCH):
    """An estimated profile (cached in `work`)."""
    from atomc.ir import Profile
    from atomc.profile import profile_model
    from atomc.trace import runs_on_for, trace_model

    name = f"{config}{'-' + str(layers) + 'l' if layers else ''}.b{batch}.{target}.profile.json"
    path = work / name
    if path.exists():
        return Profile.load(path)
    options = {"n_layer": layers} if layers else {}
    traced = trace_model(MODEL, config, batch, options, runs_on=runs_on_for(target))
    profile = profile_model(traced, target=target)
    profile.save(path)
    return profile


def uniform_network(name: str, gpus: list[str], gbps: float, delay_ms: float = 0.0,
                    regions: list[str] | None = None, intra_gbps: float | None = None):
    """Devices named gpuN; one bandwidth between regions, `intra_gbps` inside one."""
    from atomc.place.network import Device, Network

    regions = regions or ["host"] * len(gpus)
    devices = tuple(Device(f"{r}/{i}", r, g) for i, (g, r) in enumerate(zip(gpus, regions)))
    n = len(devices)

    def bw(i, j):
        if intra_gbps is not None and regions[i] == regions[j]:
            return intra_gbps
        return gbps

    return Network(devices=devices,
                   delay_ms=tuple(tuple(0.0 if i == j else delay_ms for j in range(n))
                                  for i in range(n)),
                   bandwidth_gbps=tuple(tuple(bw(i, j) for j in range(n)) for i in range(n)),
                   name=name).check(name)


# ---------------------------------------------------------------------------------------------
# (a)


def part_a(args, work: Path) -> list[str]:
    from atomc.compare import Setting, compare, hardware_models, machines_of

    configs = [c for c in TABLE_III
               if not args.configs or c[1] in args.configs.split(",")]
    gpus = [g for g in args.gpus.split(",") if g]
    t0 = time.time()
    rows = []
    for target in gpus:
        for label, config, layers in configs:
            profile = estimated_profile(work, config, layers, target)
            b = profile.graph.batch_size
            setting = Setting(global_batch=4 * ACCUM * b, accum=ACCUM, sync=False,
                              stages=(4,), place_budget_s=args.budget_s)
            models = None
            for gbps, bw_label in BANDWIDTHS:
                net = uniform_network(f"4x{target}-{gbps:g}G", [target] * 4, gbps)
                if models is None:
                    models = hardware_models([profile], machines_of(net), no_update=True)
                c = compare([profile], net, setting, modes=A_MODES, models=models)
                rows.append((target, label, bw_label, gbps, c))
                print(f"(a) {target} {label} {bw_label}: " + ", ".join(
                    f"{k} {r.step_s:.2f} s" if r.feasible else f"{k} -"
                    for k, r in c.results.items()), flush=True)
    return render_a(args, rows, t0)


A_MODES = ("peers", "gpipe", "1f1b", "pipedream")
A_NAMES = {"peers": "ATOM", "gpipe": "GPipe", "1f1b": "1F1B", "pipedream": "PipeDream"}


def per_minibatch_s(r, n_gpus: int, minibatches: int) -> float:
    """ATOM's "per result GPU time": GPU-seconds per mini-batch."""
    return r.step_s * n_gpus / minibatches


def cell_time(r, k: str, mb: int) -> str:
    x = r.get(k)
    return f"{per_minibatch_s(x, 4, mb):.3f}" if x and x.feasible else "-"


def cell_util(r, k: str) -> str:
    x = r.get(k)
    return f"{x.mean_busy():.1%}" if x and x.feasible else "-"


def cell_factor(r, k: str) -> str:
    x, a = r.get(k), r.get("peers")
    ok = x and x.feasible and a and a.feasible
    return f"{x.step_ns / a.step_ns:.2f}" if ok else "-"


def cell_bound(r, k: str) -> str:
    x = r.get(k)
    if x is None:
        return "-"
    if not x.feasible:
        return "does not fit"
    swapped = x.detail.get("swapped")
    return x.binding + (f"; stage(s) {','.join(map(str, swapped))} swapped" if swapped else "")


def render_a(args, rows, t0) -> list[str]:
    cmd = "python bench/modes_bench.py --part a" + (
        f" --configs {args.configs}" if args.configs else "") + (
        f" --gpus {args.gpus}" if args.gpus != ",".join(GPUS) else "")
    out = header("(a) Table III's settings, predicted", cmd, t0)
    pipes = A_MODES[1:]
    out += [
        ("Per-mini-batch GPU time (s; 4 GPUs x step / mini-batches in the step) and GPU "
         "utilisation (mean compute-busy share) of ATOM peers, 4-stage GPipe, 4-stage 1F1B "
         "(PipeDream-flush, what atomc's layout runner runs) and 4-stage PipeDream "
         "(asynchronous 1F1B with weight stashing, a modelled baseline atomc does not run) "
         f"over a global batch of {4 * ACCUM} mini-batches (C = {ACCUM}; a pipeline step of "
         f"{4 * ACCUM} micro-batches), forward and backward only. `-`: does not fit. "
         "X/ATOM: per-mini-batch time over ATOM's."),
        "",
        ("| GPU | model | link | " + " | ".join(f"{A_NAMES[k]} s" for k in A_MODES) + " | "
         + " | ".join(f"{A_NAMES[k]} util" for k in A_MODES) + " | "
         + " | ".join(f"{A_NAMES[k]}/ATOM" for k in pipes) + " | "
         + " | ".join(f"{A_NAMES[k]} bound by" for k in A_MODES) + " |"),
        "|---|---|---|" + "---:|" * (3 * len(A_MODES) - 1) + "---|" * len(A_MODES)]
    refused: dict[tuple[str, str, str], str] = {}
    for target, label, bw_label, _, c in rows:
        r = c.results
        mb = c.setting.global_batch // BATCH
        for k, x in r.items():
            if not x.feasible:
                refused[(target, label, k)] = x.reason
        out.append(f"| {target} | {label} | {bw_label} | "
                   + " | ".join(cell_time(r, k, mb) for k in A_MODES) + " | "
                   + " | ".join(cell_util(r, k) for k in A_MODES) + " | "
                   + " | ".join(cell_factor(r, k) for k in pipes) + " | "
                   + " | ".join(cell_bound(r, k) for k in A_MODES) + " |")
    out.append("")
    if refused:
        out.append("Does not fit (the same at every bandwidth):")
        out += [f"- {target}, {label}, {k}: {why}" for (target, label, k), why in refused.items()]
        out.append("")
    out += summary_a(rows)
    return out


def summary_a(rows) -> list[str]:
    """The orderings, the growth of the gaps, swapped stages, and the paper's utilisations
    beside ours."""
    fits = {}
    for target, label, bw_label, gbps, c in rows:
        fits[(target, label, bw_label, gbps)] = {k: x for k, x in c.results.items()
                                                 if x.feasible}
    out = []
    # ATOM > PipeDream > GPipe, where the three fit
    chain = [(key, r) for key, r in fits.items() if {"peers", "pipedream", "gpipe"} <= set(r)]
    ok = [(key, r) for key, r in chain
          if r["peers"].step_ns < r["pipedream"].step_ns < r["gpipe"].step_ns]
    out.append(f"- **ATOM > PipeDream > GPipe** in **{len(ok)} of {len(chain)}** settings "
               f"where all three fit.")
    for (target, label, bw_label, _), r in chain:
        a, p, g = (r[k] for k in ("peers", "pipedream", "gpipe"))
        if not a.step_ns < p.step_ns < g.step_ns:
            which = ("PipeDream is not slower than ATOM" if p.step_ns <= a.step_ns
                     else "PipeDream is not faster than GPipe")
            out.append(f"  - fails: {target}, {label}, {bw_label}: {which} (GPipe/PipeDream "
                       f"{g.step_ns / p.step_ns:.2f}, PipeDream/ATOM "
                       f"{p.step_ns / a.step_ns:.2f}); PipeDream bound by {p.binding}; GPipe "
                       f"bound by {g.binding}")
    gp = [r["gpipe"].step_ns / r["pipedream"].step_ns for _, r in chain]
    if gp:
        out.append(f"  - GPipe/PipeDream from {min(gp):.2f} to {max(gp):.2f}.")
    only = [key for key, r in fits.items()
            if "gpipe" in r and "pipedream" not in r and "peers" in r]
    if only:
        out.append(f"  - not checked where PipeDream does not fit but GPipe does ({len(only)} "
                   f"settings: " + "; ".join(sorted({f"{t}, {lab}" for t, lab, _, _ in only}))
                   + ").")
    # ATOM faster than every pipeline that fits
    total = sum(1 for r in fits.values() if "peers" in r and len(r) > 1)
    faster = sum(1 for r in fits.values() if "peers" in r and len(r) > 1
                 and all(r["peers"].step_ns < x.step_ns for k, x in r.items() if k != "peers"))
    out.append(f"- ATOM faster than every pipeline that fits in **{faster} of {total}** "
               f"settings.")
    # the gaps as bandwidth falls
    by: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
    worst = (0.0, "")
    for (target, label, _, gbps), r in fits.items():
        if "peers" not in r:
            continue
        gaps = {k: x.step_ns / r["peers"].step_ns for k, x in r.items() if k != "peers"}
        by.setdefault((target, label), {})[gbps] = gaps
        for k, f in gaps.items():
            if f > worst[0]:
                worst = (f, f"{A_NAMES[k]}, {label} on {target}")
    grows = {k: [0, 0] for k in A_MODES[1:]}
    for per_bw in by.values():
        seq = [per_bw[b] for b, _ in BANDWIDTHS if b in per_bw]
        for k in grows:
            xs = [g[k] for g in seq if k in g]
            if len(xs) == len(seq) and len(xs) > 1:
                grows[k][1] += 1
                grows[k][0] += all(x >= y - 1e-9 for x, y in itertools.pairwise(xs))
    out.append("- The gap grows (or stays) as bandwidth falls, (GPU, model) pairs: "
               + ", ".join(f"{A_NAMES[k]}/ATOM {n} of {t}" for k, (n, t) in grows.items())
               + f". Largest factor over ATOM: **{worst[0]:.1f}x** ({worst[1]}); the paper: "
               f"up to 20x.")
    # 1F1B (PipeDream-flush, atomc's runner) against GPipe
    both = [r for r in fits.values() if "gpipe" in r and "1f1b" in r]
    wins = sum(r["1f1b"].step_ns < r["gpipe"].step_ns for r in both)
    ratio = [r["gpipe"].step_ns / r["1f1b"].step_ns for r in both]
    out.append(f"- 1F1B (with a flush) faster than GPipe in {wins} of {len(both)} settings "
               f"where both fit (GPipe/1F1B from {min(ratio, default=0):.2f} to "
               f"{max(ratio, default=0):.2f}).")
    swapped = sorted({(t, lab, tuple(r["gpipe"].detail.get("swapped", ())))
                      for (t, lab, _, _), r in fits.items()
                      if "gpipe" in r and r["gpipe"].detail.get("swapped")})
    if swapped:
        out.append("- GPipe with swapped stages (they do not fit resident; the layout runner "
                   "runs them swapped, and the layout as GPipe): "
                   + "; ".join(f"{t}, {lab}: stage(s) {','.join(map(str, s))}"
                               for t, lab, s in swapped) + ".")
    util = []
    for (target, label, _, gbps), r in fits.items():
        if label.startswith("GPT-3 175B") and gbps == BANDWIDTHS[-1][0]:
            util.append(f"{target}: " + ", ".join(
                f"{A_NAMES[k]} {r[k].mean_busy():.1%}" if k in r else f"{A_NAMES[k]} -"
                for k in ("peers", "pipedream", "1f1b", "gpipe")))
    if util:
        out.append("- GPT-3 175B (2 blocks) at 10 Gbit/s, GPU utilisation (paper, Fig. 15, "
                   "localhost: ATOM 91.9%, PipeDream 46.3%, GPipe 18.3%): " + "; ".join(util))
    return out


# ---------------------------------------------------------------------------------------------
# (c)


def part_c(args, work: Path) -> list[str]:
    from atomc.compare import Setting, compare, hardware_models, machines_of

    t0 = time.time()
    servers = (("V100", "v100-32gb"), ("1080Ti", "gtx-1080-ti"), ("1080", "gtx-1080"))
    slow = args.c_mbit / 1000
    rows = []
    for config in [c for c in args.c_configs.split(",") if c]:
        profiles = [estimated_profile(work, config, None, t) for _, t in servers]
        b = profiles[0].graph.batch_size
        for pipelines in (2, 3):
            used = servers[:pipelines]
            gpus = [t for _, t in used for _ in range(4)]
            regions = [s for s, _ in used for _ in range(4)]
            models = None  # the same GPUs in both settings: their peer plans are reused
            for setting_name, intra in (("local", FAST_GBPS), ("remote", None)):
                net = uniform_network(f"{pipelines}srv-{setting_name}", gpus, slow, 1.0,
                                      regions, intra)
                # 256 mini-batches, less what does not split over the pipelines (255 for 3)
                batch = 256 // pipelines * pipelines * b
                setting = Setting(global_batch=batch, accum=ACCUM, sync=True, stages=(4,),
                                  place_budget_s=args.budget_s)
                models = models or hardware_models(profiles, machines_of(net))
                c = compare(profiles, net, setting, modes=("peers", "gpipe", "1f1b"),
                            models=models)
                rows.append((config, pipelines, setting_name, c))
                print(f"(c) {config} {pipelines} pipelines {setting_name}: " + ", ".join(
                    f"{k} {r.step_s:.1f} s" if r.feasible else f"{k} -"
                    for k, r in c.results.items()), flush=True)
    cmd = (f"python bench/modes_bench.py --part c --c-configs {args.c_configs} "
           f"--c-mbit {args.c_mbit:g}")
    out = header("(c) Fig. 16's setting, predicted", cmd, t0)
    out += [
        (f"Three 4-GPU servers (V100, 1080 Ti, 1080), each its own region; servers joined at "
         f"{args.c_mbit:g} Mbit/s, 1 ms; GPUs of one server at {FAST_GBPS:g} Gbit/s (local) "
         f"or at {args.c_mbit:g} Mbit/s too (remote). Global batch 256 mini-batches (255 "
         f"with 3 pipelines, which 256 does not split over); ATOM "
         f"peers at C = {ACCUM} average their weights, the layouts (4 stages x 2 or 3 "
         f"replicas, placed by `atomc place`) average each stage's gradients; both step AdamW. "
         f"Time of one global batch."),
        "",
        ("| model | GPUs | setting | ATOM s | GPipe s | 1F1B s | GPipe/ATOM | 1F1B/ATOM "
         "| ATOM bound by | GPipe bound by | 1F1B bound by |"),
        "|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    refused: dict[tuple[str, int, str], str] = {}
    for config, pipelines, setting_name, c in rows:
        r = c.results
        for k, x in r.items():
            if not x.feasible:
                refused[(config, pipelines, k)] = x.reason
        secs = {k: f"{x.step_s:.1f}" if x.feasible else "-" for k, x in r.items()}
        out.append(f"| {config} | {4 * pipelines} ({pipelines} pipelines) | {setting_name} "
                   f"| {secs['peers']} | {secs['gpipe']} | {secs['1f1b']} "
                   f"| {cell_factor(r, 'gpipe')} | {cell_factor(r, '1f1b')} "
                   f"| {cell_bound(r, 'peers')} | {cell_bound(r, 'gpipe')} "
                   f"| {cell_bound(r, '1f1b')} |")
    out.append("")
    if refused:
        out.append("Does not fit:")
        out += [f"- {config}, {p} pipelines, {k}: {why}"
                for (config, p, k), why in refused.items()]
    out.append("")
    return out


# ---------------------------------------------------------------------------------------------
# crossover


SWEEP_GBPS = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 25.0, 50.0, 100.0)
SHOWN_GBPS = (0.4, 1.6, 10.0)


def part_x(args, work: Path) -> list[str]:
    """Where pipelines overtake peers: for each model, GPU and global batch, the lowest
    bandwidth of the sweep from which on the best 2- or 4-stage layout (GPipe or 1F1B) trains
    a global batch, averaging and optimizer on, faster than ATOM peers on the same 4 GPUs."""
    from atomc.compare import Setting, compare, hardware_models, machines_of

    t0 = time.time()
    configs = [c for c in args.x_configs.split(",") if c]
    gpus = [g for g in args.x_gpus.split(",") if g]
    batches = [int(x) for x in args.x_batches.split(",") if x]
    rows = []
    for target in gpus:
        for config in configs:
            profile = estimated_profile(work, config, None, target)
            b = profile.graph.batch_size
            models = None
            for batch in batches:
                setting = Setting(global_batch=batch * b, accum=ACCUM, sync=True, stages=(2, 4),
                                  place_budget_s=args.budget_s)
                sweep = []
                for gbps in SWEEP_GBPS:
                    net = uniform_network(f"4x{target}-{gbps:g}G", [target] * 4, gbps)
                    models = models or hardware_models([profile], machines_of(net))
                    c = compare([profile], net, setting,
                                modes=("peers", "gpipe", "1f1b", "swarm"), models=models)
                    sweep.append((gbps, c.results))
                rows.append((target, config, batch, sweep))
                print(f"(x) {target} {config} {batch}: " + "; ".join(
                    f"{g:g}G " + "/".join(f"{r[k].step_s:.1f}" if r[k].feasible else "-"
                                          for k in ("peers", "gpipe", "1f1b", "swarm"))
                    for g, r in sweep), flush=True)
    cmd = (f"python bench/modes_bench.py --part x --x-configs {args.x_configs} "
           f"--x-gpus {args.x_gpus} --x-batches {args.x_batches}")
    out = header("Crossover: where pipelines overtake peers, predicted", cmd, t0)
    out += [
        ("Four GPUs of one kind on links of one bandwidth (no added delay), averaging and "
         f"AdamW on; ATOM peers at C = {ACCUM} (atomc peer's 2 s matchmaking and 0.5 s "
         "progress lag included); layouts of 2 or 4 stages (the best of GPipe and 1F1B, placed "
         "by `atomc place`); SWARM over 2 to 4 stages. Time of one global batch, s: peers / "
         "best layout / SWARM, at three bandwidths of the sweep "
         f"({', '.join(f'{g:g}' for g in SWEEP_GBPS)} Gbit/s). Crossover: the lowest "
         "bandwidth of the sweep from which on the best layout is faster than the peers."),
        "",
        "| GPU | model | global batch | " + " | ".join(f"{g:g} Gbit/s" for g in SHOWN_GBPS)
        + " | crossover | fastest at 0.1 / 100 Gbit/s |",
        "|---|---|---:|" + "---:|" * len(SHOWN_GBPS) + "---|---|"]
    for target, config, batch, sweep in rows:
        cells, cross = {}, None
        fastest = {}
        for gbps, r in sweep:
            peers = r["peers"].step_s if r["peers"].feasible else None
            lay = [r[k].step_s for k in ("gpipe", "1f1b") if r[k].feasible]
            best = min(lay) if lay else None
            swarm = r["swarm"].step_s if r["swarm"].feasible else None
            cells[gbps] = " / ".join("-" if x is None else f"{x:.1f}"
                                     for x in (peers, best, swarm))
            wins = best is not None and (peers is None or best < peers)
            cross = cross if (wins and cross is not None) else (gbps if wins else None)
            ok = [(x, k) for x, k in ((peers, "peers"), (best, "layout"), (swarm, "SWARM"))
                  if x is not None]
            fastest[gbps] = min(ok)[1] if ok else "-"
        where = f"{cross:g} Gbit/s" if cross is not None else "none up to 100 Gbit/s"
        out.append(f"| {target} | {config} | {batch} | "
                   + " | ".join(cells[g] for g in SHOWN_GBPS)
                   + f" | {where} | {fastest[SWEEP_GBPS[0]]} / {fastest[SWEEP_GBPS[-1]]} |")
    out.append("")
    return out


# ---------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    if args.part in ("a", "all"):
        report += part_a(args, work)
    if args.part in ("c", "all"):
        report += part_c(args, work)
    if args.part in ("x", "all"):
        report += part_x(args, work)
    if args.part in ("b", "all"):
        from bench._modes_procs import part_b

        report += part_b(args, work)
    text = "\n".join(report) + "\n"
    print("\n" + text)
    if args.output:
        from atomc.jsonio import write_atomic

        write_atomic(args.output, text)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
