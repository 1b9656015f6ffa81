"""`atomc calibrate PACKAGE`: measure a generated package's steps, calibrate its profile, re-plan.

Trains the package for a few traced steps with the swap runtime (byte-level text, as `atomc
train`), scales the profile the plan was made from to the measured sub-models
(atomc.calibrate.calibrate), writes the calibrated profile, partitions it again with the
plan's settings, and prints predicted against measured before and after.

Measuring runs the runtime, which imports torch: the command imports it when it runs, so that
building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from atomc.errors import UsageError
from atomc.ir import Plan, Profile
from atomc.partition import partition, profile_hash, recost
from atomc.partition.report import render_plan
from atomc.simulate import simulate_plan, write_timelines_svg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure a package's steps and calibrate its profile to them",
        description="Train PACKAGE (written by `atomc codegen`) for a few traced steps, scale "
                    "the profile its plan was made from to the measured sub-models, write the "
                    "calibrated profile, re-plan from it, and print predicted against measured "
                    "step and lane times, before and after.")
    p.add_argument("package", help="generated package directory")
    p.add_argument("--plan", help="the plan the package was generated from (default: the "
                                  "package's plan.json)")
    p.add_argument("--profile", help="the profile the plan was made from (default: a "
                                     "*.profile.json beside the package or here whose hash the "
                                     "plan records)")
    p.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps run first and not measured (default 3)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available); it "
                                    "must be the device the plan was made for")
    p.add_argument("--data", default="stdlib",
                   help="'stdlib' (the Python standard library's sources) or a text file")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", help="calibrated profile (default: beside the profile, "
                                          "NAME.calibrated.profile.json)")
    p.add_argument("--plan-output", metavar="FILE",
                   help="the re-plan (default: beside the calibrated profile, "
                        "NAME.calibrated.plan.json)")
    p.add_argument("--no-replan", action="store_true", help="do not partition again")
    p.add_argument("--timeline", metavar="SVG",
                   help="draw two measured steps above the calibrated prediction of two")
    p.set_defaults(func=run_calibrate)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".profile.json", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def find_profile(given: str | None, package: Path, wanted: str):
    """The profile the plan was made from: given, or found by its hash beside the package,
    beside the package's folder, or here."""
    if given:
        return Path(given), Profile.load(given)
    seen: set[Path] = set()
    for folder in (package, package.parent, Path.cwd()):
        for path in sorted(folder.glob("*profile*.json")):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            try:
                profile = Profile.load(path)
            except Exception:  # noqa: BLE001 - any file that is not that profile is skipped
                continue
            if profile_hash(profile) == wanted:
                return path, profile
    raise UsageError(f"no profile with hash {wanted} (the one the plan was made from) "
                     f"beside {package} or here; give it with --profile FILE")


def run_calibrate(args: argparse.Namespace) -> int:
    from atomc.calibrate import calibrate, measure_package
    from atomc.calibrate.report import render
    from atomc.runtime.package import load_swap_package
    from atomc.runtime.startup import check_plan

    package = Path(args.package)
    if not package.is_dir():
        raise UsageError(f"{package} is not a directory; give the package `atomc codegen` wrote")
    plan_path = Path(args.plan) if args.plan else package / "plan.json"
    if not plan_path.is_file():
        raise UsageError(f"{plan_path} does not exist; give the plan the package was generated "
                         f"from with --plan FILE")
    plan = Plan.load(plan_path)
    check_plan(load_swap_package(package), plan_path)  # the package's plan, before all else
    profile_path, profile = find_profile(args.profile, package, plan.profile_hash)
    print(f"measuring {package}: {args.warmup} warm-up and {args.steps} measured steps")
    measurement, traces = measure_package(
        package, steps=args.steps, warmup=args.warmup, device=args.device, seed=args.seed,
        plan=plan_path, data=args.data, optimizer={"lr": args.lr})
    calibrated = calibrate(profile, plan, measurement)
    rate = calibrated.calibration.cpu_adam_gbps or plan.cpu_adam_gbps
    after = recost(calibrated, plan, cpu_adam_gbps=rate, cpu_adam_source="calibrated")
    print(render(plan, after, measurement, calibrated))
    out = Path(args.output) if args.output else profile_path.with_name(
        f"{_stem(profile_path)}.calibrated.profile.json")
    calibrated.save(out)
    print(f"wrote {out}")
    if args.timeline:
        _draw(traces, plan, after, args.timeline)
    if args.no_replan:
        return 0
    replan = partition(
        calibrated, plan.capacity_bytes, reserve_bytes=plan.reserve_bytes,
        accum=plan.accum if plan.accum_fixed else None, activations=plan.activations,
        cpu_adam_gbps=rate, cpu_adam_source="calibrated",
        transfer_dtype=plan.transfer_dtype or None,
        autocast=plan.autocast or ("none" if plan.transfer_dtype else None))
    plan_out = Path(args.plan_output) if args.plan_output else out.with_name(
        f"{_stem(out)}.plan.json")
    kept = replan.predicted_step_ms > after.predicted_step_ms
    if kept:
        # the search adds up a GPU's overlapped lanes; on a CPU the thread's copies and its time
        # between actions are only in the simulation, which may prefer the measured cuts
        replan = after
    replan.save(plan_out)
    same = [s.start for s in replan.submodels] == [s.start for s in plan.submodels] \
        and replan.accum == plan.accum
    print()
    print(render_plan(replan, 40))
    if kept:
        print(f"\nre-planned from the calibrated profile: the search's plan simulates slower "
              f"than the measured plan's cuts (the search leaves the CPU thread's copies and "
              f"its time between actions out), so the measured cuts are kept, predicted "
              f"{replan.predicted_step_ms:.2f} ms a step; wrote {plan_out}")
    elif same:
        print(f"\nre-planned from the calibrated profile: the same cuts and C={replan.accum}, "
              f"predicted {replan.predicted_step_ms:.2f} ms a step; wrote {plan_out}")
    else:
        print(f"\nre-planned from the calibrated profile: {len(replan.submodels)} sub-models, "
              f"C={replan.accum}, predicted {replan.predicted_step_ms:.2f} ms a step against "
              f"{after.predicted_step_ms:.2f} ms for the measured plan's cuts; wrote {plan_out} "
              f"(atomc codegen {plan_out} -o DIR generates it)")
    return 0


def _draw(traces, plan, calibrated_plan, path: str) -> None:
    from atomc.runtime.trace import to_timeline

    k, c = len(plan.submodels), plan.accum
    measured = to_timeline(traces[-3:-1], k, c, label="measured")
    predicted = simulate_plan(calibrated_plan, num_steps=2).timeline
    write_timelines_svg([measured, predicted], path,
                        [f"measured: two steps of plan {plan.content_hash()}",
                         "calibrated prediction: the same plan on the calibrated profile"])
    print(f"wrote {path}")


__all__ = ["register", "run_calibrate"]
