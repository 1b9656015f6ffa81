"""Activation policies, predicted: recompute, auto and keep side by side for Llama-shaped models
on the GPUs the side-by-side benchmark (bench/side_by_side.py) measures, from estimated profiles
(`atomc profile --target`), so no GPU is needed. Prints one markdown table; every number is the
partitioner's simulated step, not a measurement.

    python bench/activation_plans.py [--configs llama-1.3b,llama-2.7b]
        [--targets h100-80gb,rtx-3090] [--budgets 8GiB,11GiB] [--seq-len 2048]

Each row: the plan atomc makes for the budget with each policy (C searched), its predicted step,
tokens/s, model TFLOPS (6 x parameters x tokens / step) and the GPU's busy share; "auto" also
names the bytes it keeps and sends. Host memory is not checked (--host-mem 1024TiB): the rows are
about the GPU and the link.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # bench/_provenance.py
POLICIES = ("recompute", "auto", "keep")


def atomc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atomc", *args], capture_output=True, text=True,
                          cwd=REPO)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="llama-1.3b,llama-2.7b")
    ap.add_argument("--targets", default="h100-80gb,rtx-3090")
    ap.add_argument("--budgets", default="8GiB,11GiB")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    from bench._provenance import commit as git_commit

    commit = git_commit()
    print(f"predicted on {platform.node()} (no GPU), {datetime.date.today()}, commit {commit}; "
          f"bf16 weights and autocast, sequence {args.seq_len}, micro-batch 1\n")
    print("| model | target | budget | policy | C | sub-models | step | tokens/s | TFLOPS "
          "| busy | stored |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            for target in args.targets.split(","):
                prof = Path(tmp) / f"{config}.{target}.json"
                done = atomc("profile", "examples/hf.py", "--config", config, "--target", target,
                             "--seq-len", str(args.seq_len), "-o", str(prof))
                if done.returncode:
                    print(f"| {config} | {target} | - | - | profile failed: "
                          f"{done.stderr.strip().splitlines()[-1]} |")
                    continue
                graph = json.loads(prof.read_text())["graph"]
                params = sum(math.prod(p["shape"]) for p in graph["params"].values())
                tokens = args.seq_len * int(graph["batch_size"])
                for budget in args.budgets.split(","):
                    for policy in POLICIES:
                        out = Path(tmp) / f"{config}.{target}.{budget}.{policy}.json"
                        done = atomc("partition", str(prof), "--gpu-mem", budget,
                                     "--transfer-dtype", "bfloat16", "--activations", policy,
                                     "--host-mem", "1024TiB", "-o", str(out))
                        if done.returncode:
                            why = done.stderr.strip().splitlines()[-1][:90]
                            print(f"| {config} | {target} | {budget} | {policy} | - | - | - | - "
                                  f"| - | - | does not plan: {why} |")
                            continue
                        plan = json.loads(out.read_text())
                        step_s = plan["predicted_step_ms"] / 1e3
                        toks = plan["accum"] * tokens / step_s
                        subs = plan["submodels"]
                        stored = "-"
                        if policy == "auto":
                            c = plan["accum"]
                            kept = c * sum(s.get("kept_bytes", 0) for s in subs) / 2**30
                            sent = c * sum(s.get("sent_bytes", 0) for s in subs) / 2**30
                            stored = f"{kept:.2f} GiB kept, {sent:.2f} GiB sent"
                        print(f"| {config} | {target} | {budget} | {policy} | {plan['accum']} "
                              f"| {len(subs)} | {step_s * 1e3:.0f} ms | {toks:,.0f} "
                              f"| {6 * params * toks / 1e12:.1f} "
                              f"| {plan['predicted_utilisation']:.1%} | {stored} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
