"""`atomc compare PROFILE|PLAN... --network NET.json --global-batch N`: which way to train,
predicted.

atomc compare gpt.gtx-1080.profile.json --network net.json --global-batch 64
atomc compare a.profile.json b.profile.json --network net.json --global-batch 256 --accum 4 \
    --modes peers,1f1b --stages 4 --json comparison.json
atomc compare gpt.gtx-1080.plan.json --network net.json --global-batch 64

An input is told by its JSON kind: a profile, or a plan of `atomc partition`, whose profile
(named by its hash) is one of the inputs or a file beside the plan (where `atomc partition`
writes it by default); the plan is what the peers of its hardware train with.

The comparison imports torch (through the peer's and the runtime's settings): imported when
the command runs, so that building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from atomc.errors import AtomcError, UsageError
from atomc.ir import Plan, Profile
from atomc.jsonio import read_json, write_json
from atomc.partition import profile_hash
from atomc.units import format_bytes

if TYPE_CHECKING:
    from atomc.compare import Comparison, GivenPlan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="predict one global batch as ATOM peers, DT-FM layouts (GPipe, 1F1B) and SWARM",
        description="Predict, for the same global batch, the time of ATOM peers (each device "
        "its own swap plan, averaging over the network), the best DT-FM layouts with GPipe and "
        "1F1B, and SWARM, by simulating the action lists each runtime executes with the "
        "network's links; print each mode's time, busy shares, traffic and binding resource.")
    p.add_argument("inputs", nargs="+", metavar="PROFILE|PLAN",
                   help="the model's profile for each kind of device the network names "
                        "(atomc profile --target NAME, or measured on a CPU), or a plan "
                        "(atomc partition) in its place: the peers of its hardware train with "
                        "it, C included, and its profile is found by hash among the inputs or "
                        "beside it")
    p.add_argument("--network", required=True,
                   help="network JSON (atomc network, or hand-written): every device names its "
                        "hardware in \"gpu\"; optional \"memory_bytes\", \"host_memory_bytes\"")
    p.add_argument("--global-batch", type=int, required=True, metavar="N",
                   help="samples in one global batch, all devices together")
    p.add_argument("--modes", help="comma-separated: peers, gpipe, 1f1b, swarm (the default), "
                   "diloco (atomc peer with DiLoCo's outer step), pipedream (a baseline atomc "
                   "models but does not run); a mode named here that the devices cannot hold "
                   "is an error")
    p.add_argument("--accum", type=int, metavar="C", help="the peers' C (default: the "
                   "partitioner's choice)")
    p.add_argument("--stages", help="comma-separated numbers of pipeline stages to try for "
                   "layouts and SWARM (default: every divisor of the devices)")
    p.add_argument("--no-sync", action="store_true",
                   help="no averaging and no optimizer step: forward and backward only "
                        "(ATOM Fig. 14's setting)")
    p.add_argument("--matchmaking-s", type=float, default=None, metavar="S",
                   help="the peers' wait for a group before averaging (default: atomc peer's "
                        "--matchmaking-time)")
    p.add_argument("--progress-lag-s", type=float, default=None, metavar="S",
                   help="how late a peer sees the others' progress (default: atomc peer's "
                        "progress tracker, 0.5 s)")
    p.add_argument("--inner-steps", type=int, metavar="H",
                   help="DiLoCo (--modes diloco): local steps between rounds (default: a round "
                        "per global batch)")
    p.add_argument("--round-dtype", choices=("float32", "bfloat16", "float16", "int8"),
                   help="DiLoCo: what rounds send pseudo-gradients in (default: the master dtype)")
    p.add_argument("--fragments", type=int, metavar="K",
                   help="DiLoCo: average 1/K of the sub-models each round, in turn, beside the "
                        "next local steps (default 1)")
    p.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                   help="every device computes F times slower than its profile (an emulated "
                        "device, as atomc swarm serve --slowdown)")
    p.add_argument("--swarm-trainer", metavar="DEVICE",
                   help="the device the SWARM trainer runs on (default the first)")
    p.add_argument("--budget-s", type=float, default=2.0,
                   help="atomc place's search budget per number of stages (default 2 s)")
    p.add_argument("--links", type=int, default=3, help="busiest links listed per mode")
    p.add_argument("--json", metavar="PATH", help="also write the comparison as JSON")
    p.set_defaults(func=run_compare)


def _ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} {text!r}: expected comma-separated whole numbers") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} {text!r}: expected numbers of at least 1")
    return values


def read_inputs(paths: list[str]) -> tuple[list[Profile], list[GivenPlan], list[str]]:
    """The profiles and plans given, told apart by their JSON kind, each plan with the profile
    it was made from; and a line for each plan saying where its profile was found."""
    from atomc.compare import GivenPlan

    profiles: list[tuple[str, Profile]] = []
    plans: list[tuple[str, Plan]] = []
    for path in paths:
        data = read_json(path, "profile or plan")
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind == Profile.KIND:
            profiles.append((path, Profile.from_json(data, path)))
        elif kind == Plan.KIND:
            plans.append((path, Plan.from_json(data, path)))
        else:
            raise UsageError(f"{path} is {'a ' + str(kind) if kind else 'JSON without a kind'}, "
                             f"neither a profile ({Profile.KIND}: atomc profile) nor a plan "
                             f"({Plan.KIND}: atomc partition); give the model's profiles or "
                             f"plans")
    hashes = {profile_hash(p): (path, p) for path, p in profiles}
    given = []
    notes = []
    for path, plan in plans:
        found = hashes.get(plan.profile_hash)
        where = "given"
        if found is None:
            found = _profile_beside(Path(path), plan.profile_hash, {Path(p).resolve()
                                                                   for p in paths})
            where = "found beside it"
        if found is None:
            raise UsageError(f"{path} was made from profile {plan.profile_hash}, which is "
                             f"neither among the inputs nor beside {path}; give that profile "
                             f"too (the one `atomc partition` read)")
        given.append(GivenPlan(plan=plan, profile=found[1], source=path))
        notes.append(f"{path}: made from {found[0]} ({where})")
    return [p for _, p in profiles], given, notes


def _profile_beside(plan_path: Path, wanted: str, skip: set[Path]
                    ) -> tuple[str, Profile] | None:
    """The profile of hash `wanted` among the JSON files in the plan's folder."""
    for path in sorted(plan_path.parent.glob("*.json")):
        if path.resolve() in skip:
            continue
        try:
            data = read_json(path, "profile")
        except AtomcError:  # a file that is not JSON is no profile
            continue
        if not isinstance(data, dict) or data.get("kind") != Profile.KIND:
            continue
        try:
            profile = Profile.from_json(data, str(path))
        except AtomcError:  # a profile of another schema version cannot be the plan's
            continue
        if profile_hash(profile) == wanted:
            return str(path), profile
    return None


def describe_plans(result: Comparison, plans: list[GivenPlan]) -> list[str]:
    """A line per plan: which devices' peers train with it, and on what memory."""
    lines = []
    if "peers" not in result.results:
        return lines
    for gp in plans:
        names = [d for d, src in result.plans.items() if src == gp.source]
        plan = gp.plan
        made = plan.capacity_bytes
        more = sorted({m.memory_bytes for m in result.machines if m.name in names} - {made})
        lines.append(
            f"{gp.source}: the peers on {', '.join(names)} train with it (C={plan.accum}, "
            f"{len(plan.submodels)} sub-models, made for {format_bytes(made)})"
            + (f"; on {' and '.join(format_bytes(x) for x in more)} as it is"
               if more else ""))
    return lines


def diloco_options(args: argparse.Namespace, modes: tuple[str, ...]) -> dict:
    """--inner-steps, --round-dtype and --fragments, checked as `atomc peer` checks them; an
    error where they are given without --modes diloco, which alone reads them."""
    from atomc.distributed.outer import OuterConfig

    given = [f for f, v in (("--inner-steps", args.inner_steps), ("--round-dtype",
             args.round_dtype), ("--fragments", args.fragments)) if v is not None]
    if given and "diloco" not in modes:
        raise UsageError(f"{', '.join(given)} set DiLoCo's rounds, but --modes does not name "
                         f"diloco; add it (e.g. --modes peers,diloco)")
    cfg = OuterConfig.make(inner_steps=args.inner_steps, round_dtype=args.round_dtype,
                           fragments=1 if args.fragments is None else args.fragments)
    return {"inner_steps": cfg.inner_steps, "round_dtype": cfg.round_dtype,
            "fragments": cfg.fragments}


def run_compare(args: argparse.Namespace) -> int:
    from atomc.compare import Setting, check_modes, compare, read_network, to_data
    from atomc.compare.report import LABELS, render
    from atomc.distributed.peerconfig import PeerConfig

    modes = check_modes(args.modes)
    if args.accum is not None and args.accum < 1:
        raise UsageError(f"--accum {args.accum} must be 1 or more")
    if args.budget_s <= 0:
        raise UsageError(f"--budget-s {args.budget_s:g}: expected a positive number of seconds")
    network, host = read_network(args.network)
    trainer = 0
    if args.swarm_trainer is not None:
        names = [d.name for d in network.devices]
        if args.swarm_trainer not in names:
            raise UsageError(f"--swarm-trainer {args.swarm_trainer!r} is not a device of "
                             f"{args.network}; expected one of {', '.join(names)}")
        trainer = names.index(args.swarm_trainer)
    matchmaking = (PeerConfig.__dataclass_fields__["matchmaking_time_s"].default
                   if args.matchmaking_s is None else args.matchmaking_s)
    if matchmaking < 0:
        raise UsageError(f"--matchmaking-s {matchmaking:g}: expected seconds >= 0")
    lag = Setting.__dataclass_fields__["progress_lag_s"].default \
        if args.progress_lag_s is None else args.progress_lag_s
    if lag < 0:
        raise UsageError(f"--progress-lag-s {lag:g}: expected seconds >= 0")
    diloco = diloco_options(args, modes)
    setting = Setting(global_batch=args.global_batch, accum=args.accum, sync=not args.no_sync,
                      matchmaking_s=matchmaking, progress_lag_s=lag, **diloco,
                      stages=_ints(args.stages, "--stages"), place_budget_s=args.budget_s,
                      swarm_trainer=trainer)
    profiles, plans, found = read_inputs(args.inputs)
    result = compare(profiles, network, setting, modes=modes, host_memory=host,
                     slowdown=args.slowdown, source=args.network, plans=plans)
    if args.modes is not None:  # modes asked for by name must fit
        for r in result.results.values():
            if not r.feasible:
                raise UsageError(f"{LABELS[r.mode]} does not fit: {r.reason}")
    if not result.feasible():
        first = next(iter(result.results.values()))
        raise UsageError(f"no mode fits these devices; {LABELS[first.mode]}: {first.reason}")
    if plans:
        print("\n".join(found + describe_plans(result, plans)) + "\n")
    print(render(result, links=args.links))
    if args.json:
        write_json(args.json, to_data(result))
        print(f"wrote {args.json}")
    return 0
