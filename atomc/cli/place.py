"""`atomc network` and `atomc place`: build a network, then lay stages x replicas out on it.

atomc network 5-worldwide -o net.json
atomc network --regions Oregon:8,Tokyo:8,London:8 -o net.json
atomc place net.json --pp 8 --dp 8 --plan plan.json -o layout.json
atomc place net.json --pp 8 --dp 8 --c-pp 500MB --c-dp 900MB --strategy ours --budget-s 5
"""

from __future__ import annotations

import argparse

from atomc.errors import UsageError
from atomc.ir import Plan
from atomc.place import build_network, load_network, place, scenario_names
from atomc.place.network import scenario_data
from atomc.units import parse_size


def register(subparsers: argparse._SubParsersAction) -> None:
    net = subparsers.add_parser(
        "network",
        help="build a network (devices, delay ms, Gbit/s) from a DT-FM scenario or regions",
        description="Build a network file: one of DT-FM's five 64-GPU scenarios, or single GPUs "
        "in a list of cloud regions linked by measured region-to-region values.",
    )
    net.add_argument("scenario", nargs="?", help="scenario name or number (see --list)")
    net.add_argument(
        "--regions",
        nargs="+",
        metavar="REGION[:N]",
        help="regions with device counts, e.g. Oregon:8,Tokyo:8 (count defaults to --per-region)",
    )
    net.add_argument(
        "--per-region", type=int, default=8, help="devices per region without a count (default 8)"
    )
    net.add_argument(
        "--intra-delay-ms", type=float, default=5.0, help="delay inside a region (default 5 ms)"
    )
    net.add_argument(
        "--intra-gbps", type=float, default=2.0, help="bandwidth inside a region (default 2 Gbit/s)"
    )
    net.add_argument(
        "--list", action="store_true", help="list the scenarios and regions, then exit"
    )
    net.add_argument("-o", "--output", help="write the network JSON here")
    net.set_defaults(func=run_network)

    plc = subparsers.add_parser(
        "place",
        help="lay pipeline stages x data-parallel replicas out over a network (DT-FM)",
        description="Search the assignment of (replica, stage) tasklets to devices that minimises "
        "DT-FM's communication cost: DP + 2*PP.",
    )
    plc.add_argument("network", help="network JSON (from `atomc network`, or hand-written)")
    plc.add_argument("--pp", type=int, required=True, help="pipeline stages D_PP")
    plc.add_argument("--dp", type=int, required=True, help="data-parallel replicas D_DP")
    plc.add_argument(
        "--plan", help="plan JSON: message sizes and stage -> sub-model ranges come from it"
    )
    plc.add_argument(
        "--c-pp", help="activation bytes one replica sends across a stage boundary per step"
    )
    plc.add_argument("--c-dp", help="gradient bytes of one stage")
    plc.add_argument("--strategy", default="ours", help="ours | kl | random (default ours)")
    plc.add_argument("--seed", type=int, default=0)
    plc.add_argument(
        "--budget-s", type=float, default=5.0, help="wall-clock budget in seconds (default 5)"
    )
    plc.add_argument("--max-evals", type=int, help="stop after this many candidate layouts")
    plc.add_argument(
        "--patience",
        type=int,
        default=5000,
        help="stop after this many candidates without a better layout (default 5000)",
    )
    plc.add_argument("-o", "--output", help="write the layout JSON here")
    plc.set_defaults(func=run_place)


def run_network(args: argparse.Namespace) -> int:
    if args.list:
        print("scenarios: " + ", ".join(scenario_names()))
        print("regions:   " + ", ".join(scenario_data()["region_pairs"]["regions"]))
        return 0
    if args.scenario is None and args.regions is None:
        raise UsageError(
            "give a scenario (" + ", ".join(scenario_names()) + ") or --regions REGION[:N] ..."
        )
    if args.per_region <= 0:
        raise UsageError(f"--per-region {args.per_region}: expected a positive device count")
    network = build_network(
        args.scenario, args.regions, args.per_region, args.intra_delay_ms, args.intra_gbps
    )
    print(network.summary())
    if args.output:
        network.save(args.output)
        print(f"wrote {args.output}")
    return 0


def run_place(args: argparse.Namespace) -> int:
    network = load_network(args.network)
    plan = Plan.load(args.plan) if args.plan else None
    c_pp = parse_size(args.c_pp, "--c-pp") if args.c_pp is not None else None
    c_dp = parse_size(args.c_dp, "--c-dp") if args.c_dp is not None else None
    if plan is None and (c_pp is None) != (c_dp is None):
        missing = "--c-dp" if c_dp is None else "--c-pp"
        raise UsageError(
            f"{missing} is missing: without --plan give both --c-pp and --c-dp (bytes, e.g. 500MB)"
        )
    layout = place(
        network,
        args.pp,
        args.dp,
        c_pp,
        c_dp,
        plan=plan,
        strategy=args.strategy,
        seed=args.seed,
        budget_s=args.budget_s,
        max_evals=args.max_evals,
        patience=args.patience,
    )
    print(layout.text(network))
    if args.output:
        layout.save(args.output)
        print(f"wrote {args.output}")
    return 0
