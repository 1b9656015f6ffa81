"""Time to plan GPT-3 175B (the full 96-block operator graph) at 11 GiB, in float32 and in
half precision, with and without repeated-block folding, measured side by side in one run.

    python bench/partition_bench.py [--gpu-mem 11GiB] [--repeats 5]
        [--cases v100-32gb:float32,v100-32gb:float16,rtx-3090:bfloat16]

Each case is a hardware profile and a transfer dtype (`atomc partition --transfer-dtype`).
The profiles are estimated (micro-batch 1, sequence 2048) and built first, untimed; the CPU
AdamW rate is each hardware profile's host figure (`--cpu-adam-gbps auto`). Each repeat times
one full `partition()` call (every accumulation degree it tries, every search tier, the
precision view, the simulation and the Plan) folded, then unfolded; the medians are compared.
The goal: every folded plan in under 2 s on a 2-core machine. Both runs must return the same
plan.
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

from atomc.calibrate.host import resolve_cpu_adam
from atomc.errors import InfeasiblePlanError
from atomc.partition import partition
from atomc.units import format_bytes, format_ms, parse_size


def build_profile(config: str, target: str):
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    return profile_model(trace_model(ROOT / "examples" / "gpt.py", config, 1), target=target,
                         progress=False)


def timed(profile, capacity: int, fold: bool, dtype: str, cpu: float):
    """(the plan, or the refusal's message when no partition fits; wall s; CPU s)"""
    wall, used = time.perf_counter(), time.process_time()
    try:
        plan = partition(profile, capacity, fold_blocks=fold, transfer_dtype=dtype,
                         cpu_adam_gbps=cpu)
    except InfeasiblePlanError as e:
        plan = str(e)
    return plan, time.perf_counter() - wall, time.process_time() - used


def run_case(profile, capacity: int, dtype: str, repeats: int) -> tuple[float, bool]:
    """Prints one case's plan and timings; returns (folded median wall s, plans equal)."""
    cpu, _ = resolve_cpu_adam("auto", profile)
    timed(profile, capacity, True, dtype, cpu)  # warm imports and caches
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    plans = {}
    for _ in range(repeats):
        for fold in (True, False):
            plan, wall, used = timed(profile, capacity, fold, dtype, cpu)
            runs[fold].append((wall, used))
            plans[fold] = plan
    plan = plans[True]
    print(f"case      {profile.device}, --transfer-dtype {dtype}, CPU AdamW {cpu:g} GB/s")
    if isinstance(plan, str):
        same = plans[True] == plans[False]
        print(f"refused   {format_bytes(capacity)}: {plan}")
    else:
        same = (not isinstance(plans[False], str)
                and plans[True].submodels == plans[False].submodels
                and plans[True].accum == plans[False].accum)
        print(f"plan      {format_bytes(capacity)}: {len(plan.submodels)} sub-models, "
              f"C={plan.accum}, autocast {plan.autocast or 'off'}, "
              f"predicted step {format_ms(plan.predicted_step_ms)}, "
              f"GPU busy {plan.predicted_utilisation:.1%}, "
              f"{'every constraint met' if plan.feasible else 'binding: ' + plan.binding}")
    print(f"{'':10}{'median wall':>12}{'median CPU':>12}{'min wall':>10}")
    med = {}
    for fold, name in ((True, "folded"), (False, "unfolded")):
        walls = [w for w, _ in runs[fold]]
        cpus = [c for _, c in runs[fold]]
        med[fold] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:10}{med[fold][0]:>11.3f}s{med[fold][1]:>11.3f}s{min(walls):>9.3f}s")
    print(f"ratio     unfolded / folded: {med[False][0] / med[True][0]:.1f}x wall, "
          f"{med[False][1] / med[True][1]:.1f}x CPU")
    if not same:
        print("ERROR: folded and unfolded searches returned different plans")
    print()
    return med[True][0], same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt3-175b")
    ap.add_argument("--gpu-mem", default="11GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default="v100-32gb:float32,v100-32gb:float16,rtx-3090:bfloat16")
    args = ap.parse_args(argv)
    capacity = parse_size(args.gpu_mem, "--gpu-mem")
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]

    print(f"machine   {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    profiles = {}
    for target, _ in cases:
        if target not in profiles:
            t = time.perf_counter()
            profiles[target] = build_profile(args.config, target)
            print(f"profile   {args.config} for {target}: {len(profiles[target].graph.nodes)} "
                  f"nodes, {len(profiles[target].graph.blocks)} blocks (estimated in "
                  f"{time.perf_counter() - t:.1f} s, not timed)")
    print()
    results = [run_case(profiles[target], capacity, dtype, args.repeats)
               for target, dtype in cases]
    slowest = max(w for w, _ in results)
    ok = slowest < 2.0
    print(f"goal      every folded plan under 2 s: {'met' if ok else 'NOT met'} "
          f"(slowest {slowest:.2f} s)")
    return 0 if all(same for _, same in results) else 1


if __name__ == "__main__":
    sys.exit(main())
