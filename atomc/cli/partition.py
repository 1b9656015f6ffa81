"""`atomc partition PROFILE --gpu-mem SIZE` and `atomc show PLAN`.

Both run without torch (its import is seconds of a planning command's time): only `--emit`,
which generates the package, imports codegen, and it does so when asked.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from pathlib import Path

from atomc.actions import atom_order, format_actions, phases
from atomc.calibrate.disk import resolve_disk
from atomc.calibrate.host import resolve_cpu_adam
from atomc.errors import UsageError
from atomc.ir import Plan, Profile
from atomc.partition import DEFAULT_MAX_ACCUM, POLICIES, partition
from atomc.partition.hostmem import HostBudget, resolve_host_mem
from atomc.partition.precision import resolve_precision
from atomc.partition.report import render_plan, sweep_table
from atomc.simulate import simulate_plan, write_timeline_svg
from atomc.units import parse_size


def register(sub: argparse._SubParsersAction) -> None:
    _add_partition(sub)
    _add_show(sub)


def _add_partition(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "partition", help="cut a profiled model into swappable sub-models",
        description="Cut a profile into consecutive sub-models that swap through GPU memory while "
                    "the next one loads (ATOM Algorithm 1, exact); choose the accumulation degree "
                    "C; predict the step time and GPU utilisation by simulation.")
    p.add_argument("profile", help="profile JSON written by `atomc profile`")
    p.add_argument("--gpu-mem", required=True, metavar="SIZE", help="GPU memory, e.g. 11GiB, 16GB")
    p.add_argument("--reserve", default="1GiB", metavar="SIZE",
                   help="memory kept free for the CUDA context and fragmentation (default 1GiB)")
    p.add_argument("--accum", metavar="C",
                   help="fix the accumulation degree C, or min: the smallest C that meets "
                        "every constraint (default: the C that trains the most tokens a "
                        "second, weighed from that smallest one up; atomc show --sweep)")
    p.add_argument("--max-accum", type=int, default=DEFAULT_MAX_ACCUM, metavar="N",
                   help=f"largest C the search may choose (default {DEFAULT_MAX_ACCUM})")
    p.add_argument("--max-global-batch", metavar="N",
                   help="largest global batch the chosen C may make: samples (64) or tokens "
                        "(512k-tokens); C x micro-batch stays within it")
    p.add_argument("--activations", choices=POLICIES, default="auto",
                   help="auto (default): keep or send to host memory the heavy operators' "
                        "outputs the memory and link slack allow, recompute the rest; "
                        "recompute: every sub-model's internals in its backward; keep: every "
                        "sub-model's saved activations on the GPU until its backward")
    p.add_argument("--cpu-adam-gbps", default="auto", metavar="GBPS",
                   help="CPU AdamW throughput in GB/s of fp32 masters, or auto (default): "
                        "measured on this host for a measured profile (cached), the hardware "
                        "profile's host figure for an estimated one; 0 leaves the optimizer out "
                        "of the model")
    p.add_argument("--transfer-dtype", metavar="DTYPE",
                   help="dtype of the weights and gradients on the GPU: float32, bfloat16 or "
                        "float16 (default: the model's); masters stay float32 on the host")
    p.add_argument("--autocast", metavar="DTYPE",
                   help="compute dtype under torch.autocast: bfloat16, float16 or none (default: "
                        "the transfer dtype when it is half, else an estimated profile's compute "
                        "dtype when that is half)")
    _add_host_options(p)
    p.add_argument("--no-fold", action="store_true",
                   help="do not fold repeated blocks (slower, same plan)")
    p.add_argument("-o", "--output", help="plan JSON path (default PROFILE with .plan.json)")
    p.add_argument("--timeline", metavar="SVG", help="also draw the predicted timeline (two steps)")
    p.add_argument("--all", action="store_true", help="list every sub-model and cut")
    p.add_argument("--emit", metavar="DIR", help="also generate the sub-model package into DIR")
    p.set_defaults(func=run_partition)


def _add_host_options(p: argparse.ArgumentParser) -> None:
    """What the host may hold and the drives it may spill model states to."""
    p.add_argument("--host-mem", metavar="SIZE",
                   help="host memory the run may take, e.g. 64GiB (default: this machine's "
                        "available memory for a measured profile; for an estimated one "
                        "(--target), the host memory its hardware profile states, and when it "
                        "states none the plan is not checked: give this)")
    p.add_argument("--optimizer-states", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of AdamW's two moments on the host (default float32; bfloat16 "
                        "halves them, the update still computes in float32)")
    p.add_argument("--offload-dir", action="append", metavar="PATH",
                   help="a directory on an NVMe drive the run may keep model states in when "
                        "the host is short (repeat, one per drive; striped): its free space "
                        "and its rate, measured once and cached, are the plan's")
    p.add_argument("--disks", type=int, metavar="N",
                   help="drives of a machine that is not here, for the states when the host "
                        "is short (with --disk-gbps and --disk-capacity)")
    p.add_argument("--disk-gbps", metavar="R[/W]",
                   help="each drive's sequential rate in GB/s, read and write alike or "
                        "read/write (default with --offload-dir: measured)")
    p.add_argument("--disk-capacity", metavar="SIZE",
                   help="each drive's space for the run (default with --offload-dir: its free "
                        "space now)")
    p.add_argument("--clipping", action="store_true",
                   help="the run will clip its gradients' global norm (atomc train "
                        "--max-grad-norm): every sub-model's gradients are held on the host "
                        "until the last arrives, not a ring of those in flight (a float16 run's "
                        "loss scaling holds them too)")


def _add_show(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("show", help="print a plan's table again",
                       description="Print a plan written by `atomc partition`.")
    s.add_argument("plan", help="plan JSON")
    s.add_argument("--timeline", metavar="SVG", help="draw its predicted timeline (two steps)")
    s.add_argument("--all", action="store_true", help="list every sub-model and cut")
    s.add_argument("--schedule", action="store_true",
                   help="also print one step's actions in the order the swap runtime runs them")
    s.add_argument("--sweep", action="store_true",
                   help="also print, per accumulation degree C weighed, the predicted step, "
                        "tokens a second and the resource that binds it")
    s.set_defaults(func=run_show)


def _default_output(profile_path: str) -> Path:
    p = Path(profile_path)
    name = p.name
    stem = name[: -len(".profile.json")] if name.endswith(".profile.json") else p.stem
    return p.with_name(stem + ".plan.json")


def run_partition(args: argparse.Namespace) -> int:
    capacity = parse_size(args.gpu_mem, "--gpu-mem")
    reserve = parse_size(args.reserve, "--reserve")
    profile = Profile.load(args.profile)
    transfer = resolve_precision(profile, args.transfer_dtype, args.autocast).transfer_dtype
    cpu_adam, cpu_adam_source = resolve_cpu_adam(args.cpu_adam_gbps, profile,
                                                args.optimizer_states, transfer)
    limit, source = resolve_host_mem(args.host_mem, profile)
    disk = resolve_disk(args.offload_dir, args.disks, args.disk_gbps, args.disk_capacity)
    plan = partition(profile, capacity, reserve_bytes=reserve, accum=_accum(args.accum),
                     max_accum=args.max_accum, activations=args.activations,
                     fold_blocks=not args.no_fold, cpu_adam_gbps=cpu_adam,
                     cpu_adam_source=cpu_adam_source, transfer_dtype=args.transfer_dtype,
                     autocast=args.autocast, max_global_batch=args.max_global_batch,
                     host=HostBudget(limit, source, args.optimizer_states, args.clipping,
                                     disk))
    out = Path(args.output) if args.output else _default_output(args.profile)
    plan.save(out)
    print(render_plan(plan, None if args.all else 40))
    print(f"\nwrote {out}")
    if args.timeline:
        _write_timeline(plan, args.timeline)
    if args.emit:
        from atomc.codegen import emit_plan  # torch: imported only when the package is wanted

        emit_plan(plan, profile, args.emit)
    return 0


def _accum(value: str | None) -> int | str | None:
    """--accum: a number, "min", or nothing (the C of the most tokens a second)."""
    if value is None or value.strip().lower() == "min":
        return None if value is None else "min"
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--accum {value!r} is not a number; give C (e.g. 4) or min") from None


def _write_timeline(plan, path: str) -> None:
    sim = simulate_plan(plan, num_steps=2)
    print(f"wrote {write_timeline_svg(sim.timeline, path)}")


def run_show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    print(render_plan(plan, None if args.all else 40))
    if args.sweep:
        print()
        print(sweep_table(plan))
    if args.schedule:
        print()
        print(render_schedule(plan))
    if args.timeline:
        _write_timeline(plan, args.timeline)
    return 0


def render_schedule(plan) -> str:
    """One step of the plan's swap schedule (atomc.actions), a sub-model's phase to a line,
    wrapped to the terminal."""
    k = len(plan.submodels)
    order = atom_order(k, plan.accum, early_prefetch=plan.early_prefetch)
    width = max(shutil.get_terminal_size().columns, 40)
    legend = (f"schedule of one step, {k} sub-models, C={plan.accum}: F forward, B backward, "
              f"L load weights, O offload gradients, U CPU update "
              f"(2F0: sub-model 2, micro-batch 0)")
    lines = [legend]
    for phase in phases(order):
        lines.append(textwrap.fill(format_actions(phase), width, initial_indent="  ",
                                   subsequent_indent="    ", break_on_hyphens=False))
    return "\n".join(lines)
