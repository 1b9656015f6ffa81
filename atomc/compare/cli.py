"""`atomc compare PROFILE... --network NET.json --global-batch N`: which way to train, predicted.

atomc compare gpt.gtx-1080.profile.json --network net.json --global-batch 64
atomc compare a.profile.json b.profile.json --network net.json --global-batch 256 --accum 4 \
    --modes peers,1f1b --stages 4 --json comparison.json
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="predict one global batch as ATOM peers, DT-FM layouts (GPipe, 1F1B) and SWARM",
        description="Predict, for the same global batch, the time of ATOM peers (each device "
        "its own swap plan, averaging over the network), the best DT-FM layouts with GPipe and "
        "1F1B, and SWARM, by simulating the action lists each runtime executes with the "
        "network's links; print each mode's time, busy shares, traffic and binding resource.")
    p.add_argument("profiles", nargs="+", metavar="PROFILE",
                   help="the model's profile for each kind of device the network names "
                        "(atomc profile --target NAME, or measured on a CPU)")
    p.add_argument("--network", required=True,
                   help="network JSON (atomc network, or hand-written): every device names its "
                        "hardware in \"gpu\"; optional \"memory_bytes\", \"host_memory_bytes\"")
    p.add_argument("--global-batch", type=int, required=True, metavar="N",
                   help="samples in one global batch, all devices together")
    p.add_argument("--modes", help="comma-separated: peers, gpipe, 1f1b, swarm (default all); "
                   "a mode named here that the devices cannot hold is an error")
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
    from atomc.errors import UsageError

    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} {text!r}: expected comma-separated whole numbers") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} {text!r}: expected numbers of at least 1")
    return values


def run_compare(args: argparse.Namespace) -> int:
    from atomc.compare import Setting, check_modes, compare, read_network, to_data
    from atomc.compare.report import LABELS, render
    from atomc.distributed.peer import PeerConfig
    from atomc.errors import UsageError
    from atomc.ir import Profile
    from atomc.jsonio import write_json

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
    setting = Setting(global_batch=args.global_batch, accum=args.accum, sync=not args.no_sync,
                      matchmaking_s=matchmaking, progress_lag_s=lag,
                      stages=_ints(args.stages, "--stages"), place_budget_s=args.budget_s,
                      swarm_trainer=trainer)
    profiles = [Profile.load(p) for p in args.profiles]
    result = compare(profiles, network, setting, modes=modes, host_memory=host,
                     slowdown=args.slowdown, source=args.network)
    if args.modes is not None:  # modes asked for by name must fit
        for r in result.results.values():
            if not r.feasible:
                raise UsageError(f"{LABELS[r.mode]} does not fit: {r.reason}")
    if not result.feasible():
        first = next(iter(result.results.values()))
        raise UsageError(f"no mode fits these devices; {LABELS[first.mode]}: {first.reason}")
    print(render(result, links=args.links))
    if args.json:
        write_json(args.json, to_data(result))
        print(f"wrote {args.json}")
    return 0
