"""`atomc profile MODEL.py` and `atomc profiles`.

Tracing and profiling import torch: the commands import those stages when they run, so that
building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from atomc.errors import UsageError
from atomc.units import format_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="trace a model file and profile every operator",
                       description="Trace MODEL.py and write its per-operator profile (JSON).")
    p.add_argument("model", help="model file defining build_model() and example_inputs()")
    p.add_argument("--config", help="configuration name passed to build_model()")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--seq-len", type=int, help="sequence length option for the model file")
    p.add_argument("--device", help="measure on this device: cpu, cuda or cuda:N")
    p.add_argument("--target", help="estimate for a hardware profile (see `atomc profiles`)")
    p.add_argument("--compute-dtype", help="dtype estimates assume (default: the target's)")
    p.add_argument("--frontend", choices=["auto", "fx", "export"], default="auto")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per operator (median)")
    p.add_argument("--eval", action="store_true", help="trace in eval mode (dropout off)")
    p.add_argument("-o", "--output", help="profile JSON path (default MODEL.profile.json)")
    p.set_defaults(func=run_profile)

    q = sub.add_parser("profiles", help="list the hardware profiles --target accepts")
    q.set_defaults(func=run_profiles)


def run_profile(args: argparse.Namespace) -> int:
    from atomc.calibrate import measure_runtime_costs
    from atomc.profile import profile_model
    from atomc.profile.report import summarise
    from atomc.trace import runs_on_for, trace_model

    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats} must be 1 or more")
    options = {"seq_len": args.seq_len} if args.seq_len is not None else {}
    # the model's code sees the device its generated code will run on: a target is a GPU
    runs_on = runs_on_for(args.device if args.target is None else args.target)
    traced = trace_model(args.model, args.config, args.batch_size, options, frontend=args.frontend,
                         train=not args.eval, runs_on=runs_on)
    profile = profile_model(traced, device=args.device, target=args.target,
                            compute_dtype=args.compute_dtype, repeats=args.repeats,
                            runtime_costs=measure_runtime_costs)
    out = Path(args.output) if args.output else Path(args.model).with_suffix(".profile.json")
    profile.save(out)
    print(summarise(profile))
    print(f"\nwrote {out}")
    return 0


def run_profiles(args: argparse.Namespace) -> int:
    from atomc.profile.hardware import hardware_names, load_hardware

    for name in hardware_names():
        hw = load_hardware(name)
        peak = ", ".join(f"{k} {v:g}" for k, v in hw.peak_tflops.items())
        print(f"{name:12s} {format_bytes(hw.memory_bytes):>10s}  H2D {hw.h2d_gbps:4.0f} GB/s  "
              f"TFLOP/s {peak}  ({hw.description})")
    return 0
