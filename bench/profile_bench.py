"""Profile-stage benchmark: wall time and peak memory of

1. tracing + estimating GPT-3 175B for a hardware profile (goal: < 60 s, < 2 GiB),
2. the same for Hugging Face Llama-2-70B from examples/hf.py (goal: < 60 s, < 4 GiB), what
   `atomc profile examples/hf.py --config llama-2-70b --target a100-80gb` does, and
3. a measured CPU profile of GPT-3 small (seq 2048, batch 1).

Each job runs in a fresh interpreter so its peak resident memory is its own.
Usage: python bench/profile_bench.py [--skip-measured]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import json, resource, sys, time
    from atomc.trace import trace_model
    from atomc.calibrate import measure_runtime_costs
    from atomc.profile import profile_model
    model, config = sys.argv[1], sys.argv[2]
    target, device = sys.argv[3] or None, sys.argv[4] or None
    repeats = int(sys.argv[5])
    t0 = time.perf_counter()
    traced = trace_model(model, config, 1)
    t1 = time.perf_counter()
    p = profile_model(traced, target=target, device=device, repeats=repeats, progress=False,
                      runtime_costs=measure_runtime_costs)  # as `atomc profile` does
    t2 = time.perf_counter()
    print(json.dumps({"trace_s": t1 - t0, "profile_s": t2 - t1,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "nodes": len(p.graph.nodes), "unique": p.num_unique, "reused": p.num_reused,
                      "params": p.graph.num_params(), "fwd_ms": p.totals()["fwd_ms"],
                      "bwd_ms": p.totals()["bwd_ms"]}))
""")


def run(config: str, target: str = "", device: str = "", repeats: int = 3,
        model: str = "examples/gpt.py") -> dict:
    out = subprocess.run([sys.executable, "-c", JOB, model, config, target, device, str(repeats)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args()
    rows = [("gpt3-175b estimated (v100-32gb)", run("gpt3-175b", target="v100-32gb"), (60.0, 2.0)),
            ("hf llama-2-70b estimated (a100-80gb)",
             run("llama-2-70b", target="a100-80gb", model="examples/hf.py"), (60.0, 4.0))]
    if not args.skip_measured:
        rows.append(("gpt3-small measured (cpu)", run("gpt3-small", device="cpu", repeats=3), None))
    print(f"{'job':37s} {'trace s':>8s} {'profile s':>9s} {'total s':>8s} {'peak GiB':>9s} "
          f"{'nodes':>6s} {'unique':>6s} {'reused':>6s}")
    for name, r, goal in rows:
        total = r["trace_s"] + r["profile_s"]
        gib = r["peak_rss_bytes"] / 2**30
        print(f"{name:37s} {r['trace_s']:8.2f} {r['profile_s']:9.2f} {total:8.2f} {gib:9.2f} "
              f"{r['nodes']:6d} {r['unique']:6d} {r['reused']:6d}")
        if goal:
            print(f"  goal < {goal[0]:.0f} s and < {goal[1]:.0f} GiB: "
                  f"time ratio {total / goal[0]:.3f}, memory ratio {gib / goal[1]:.3f} -> "
                  f"{'met' if total < goal[0] and gib < goal[1] else 'MISSED'}")
        else:
            print(f"  model forward {r['fwd_ms']:.0f} ms, backward {r['bwd_ms']:.0f} ms "
                  f"per micro-batch (sum of isolated operators)")


if __name__ == "__main__":
    main()
