"""Time to plan GPT-3 175B (the full 96-block operator graph) at 11 GiB, with and without
repeated-block folding, measured side by side in one run.

    python bench/partition_bench.py [--gpu-mem 11GiB] [--repeats 5]

The profile is estimated for a V100 32 GB (micro-batch 1, sequence 2048) and is built first,
untimed. Each repeat times one full `partition()` call (every accumulation degree it tries,
every search tier, the simulation and the Plan) folded, then unfolded; the medians are
compared. The goal: the folded plan in under 2 s on a 2-core machine. Both runs must return
the same plan.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atomc.partition import partition
from atomc.units import format_bytes, format_ms, parse_size


def build_profile(config: str):
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    return profile_model(trace_model(ROOT / "examples" / "gpt.py", config, 1), target="v100-32gb")


def timed(profile, capacity: int, fold: bool):
    wall, cpu = time.perf_counter(), time.process_time()
    plan = partition(profile, capacity, fold_blocks=fold)
    return plan, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt3-175b")
    ap.add_argument("--gpu-mem", default="11GiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    capacity = parse_size(args.gpu_mem, "--gpu-mem")

    t = time.perf_counter()
    profile = build_profile(args.config)
    print(f"profile   {args.config}: {len(profile.graph.nodes)} nodes, "
          f"{len(profile.graph.blocks)} blocks "
          f"(estimated for v100-32gb in {time.perf_counter() - t:.1f} s, not timed)")
    print(f"machine   {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")

    timed(profile, capacity, True)  # warm imports and caches
    runs = {True: [], False: []}
    plans = {}
    for _ in range(args.repeats):
        for fold in (True, False):
            plan, wall, cpu = timed(profile, capacity, fold)
            runs[fold].append((wall, cpu))
            plans[fold] = plan
    if plans[True].submodels != plans[False].submodels or plans[True].accum != plans[False].accum:
        print("ERROR: folded and unfolded searches returned different plans")
        return 1
    plan = plans[True]
    print(f"plan      {format_bytes(capacity)}: {len(plan.submodels)} sub-models, C={plan.accum}, "
          f"predicted step {format_ms(plan.predicted_step_ms)}, "
          f"GPU busy {plan.predicted_utilisation:.1%}, "
          f"{'feasible' if plan.feasible else 'best relaxed plan'}")
    print(f"{'':10}{'median wall':>12}{'median CPU':>12}{'min wall':>10}")
    med = {}
    for fold, name in ((True, "folded"), (False, "unfolded")):
        walls = [w for w, _ in runs[fold]]
        cpus = [c for _, c in runs[fold]]
        med[fold] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:10}{med[fold][0]:>11.3f}s{med[fold][1]:>11.3f}s{min(walls):>9.3f}s")
    print(f"ratio     unfolded / folded: {med[False][0] / med[True][0]:.1f}x wall, "
          f"{med[False][1] / med[True][1]:.1f}x CPU")
    goal = med[True][0] < 2.0
    print(f"goal      folded under 2 s: {'met' if goal else 'NOT met'} ({med[True][0]:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
