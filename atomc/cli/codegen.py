"""`atomc codegen PLAN.json -o DIR`: write the plan's sub-models as a Python package.

Code generation traces the model again with torch: imported when the command runs, so that
building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from atomc.ir import Plan, Profile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codegen", help="write a plan's sub-models as a Python package",
                       description="Trace the plan's model again, cut it where the plan says and "
                                   "write one nn.Module class per sub-model into DIR (a package).")
    p.add_argument("plan", help="plan JSON written by `atomc partition`")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="package directory to write (replaced whole if atomc generated it)")
    p.add_argument("--profile", help="the profile the plan was made from, to check it matches")
    p.set_defaults(func=run_codegen)


def run_codegen(args: argparse.Namespace) -> int:
    from atomc.codegen import emit

    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile) if args.profile else None
    emit(plan, Path(args.output), profile=profile, plan_path=args.plan)
    return 0
