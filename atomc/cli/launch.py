"""`atomc launch LAYOUT -- SCRIPT ...` (DT-FM layouts under torchrun) and
`atomc peer SCRIPT ...` (one ATOM peer on hivemind).

The peer's outer-step options are checked by `atomc.distributed.outer`, which imports torch:
imported when `atomc peer` runs, so that building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys

from atomc.distributed.launch import build_command, run_command
from atomc.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="print (or run) the torchrun command for a layout",
        description="Build the torchrun command that starts a layout's D_PP x D_DP processes "
                    "(elastic, c10d rendezvous); each runs SCRIPT with the layout in "
                    "$ATOMC_LAYOUT. "
                    "Usage: atomc launch layout.json [options] -- train_script.py [script args]")
    p.add_argument("layout", help="layout JSON (atomc place)")
    _launch_options(p)
    p.add_argument("script", nargs=argparse.REMAINDER, help="[options] -- SCRIPT [ARGS...]")
    p.set_defaults(func=run_launch)

    q = sub.add_parser(
        "peer", help="start one ATOM peer (hivemind) running a training script",
        description="Run SCRIPT as one peer of a decentralized run: the peer options go to the "
                    "script as ATOMC_PEER_* variables (examples/train_peer.py reads them). The "
                    "script runs in its own process group, which is killed as a whole when it ends "
                    "or is interrupted "
                    "(hivemind leaves helper processes otherwise). "
                    "Usage: atomc peer [options] train_peer.py --package DIR [script args]")
    q.add_argument("--initial-peers", action="append", default=[], metavar="MADDR",
                   help="multiaddress of a live peer; repeat or separate with commas (none: this "
                        "peer starts the run)")
    q.add_argument("--run-id", default="atomc", help="peers with the same run id train together")
    q.add_argument("--target-batch-size", type=int,
                   help="samples over all peers per averaging round")
    q.add_argument("--rounds", type=int, help="averaging rounds to train")
    q.add_argument("--host-maddrs", action="append", default=[], metavar="MADDR",
                   help="where to listen (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for "
                        "other machines)")
    q.add_argument("--announce-maddrs", action="append", default=[], metavar="MADDR",
                   help="an address other peers should dial (repeatable)")
    q.add_argument("--name", help="this peer's name in logs")
    q.add_argument("--min-peers", type=int, metavar="N",
                   help="a new run's peers take their first step once N peers have their state, "
                        "and their first round waits for N (default 1: start at once)")
    q.add_argument("--outer", choices=("sgd", "nesterov"),
                   help="the outer optimizer of each round: sgd (default; at --outer-lr 1 "
                        "ATOM's averaging) or nesterov (DiLoCo)")
    q.add_argument("--outer-lr", type=float, metavar="LR",
                   help="outer learning rate (default: 1 for sgd, 0.7 for nesterov)")
    q.add_argument("--outer-momentum", type=float, metavar="M",
                   help="outer momentum (default: 0 for sgd, 0.9 for nesterov)")
    q.add_argument("--inner-steps", type=int, metavar="H",
                   help="local steps between rounds (default: a round per --target-batch-size "
                        "samples over all peers)")
    q.add_argument("--round-dtype", choices=("float32", "bfloat16", "float16", "int8"),
                   help="what rounds send pseudo-gradients in (default: the master dtype, exact; "
                        "int8: blockwise absmax, a quarter of float32's bytes)")
    q.add_argument("--fragments", type=int, metavar="K",
                   help="average 1/K of the sub-models each round, in turn, overlapped with the "
                        "next local steps (default 1)")
    q.add_argument("--print", dest="print_only", action="store_true",
                   help="print the command instead of running it")
    q.add_argument("script", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    q.set_defaults(func=run_peer_cli)


def _launch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--network", help="the layout's network JSON, passed on as $ATOMC_NETWORK: "
                   "its link delays, and its devices' memory_bytes, which stages that do not fit "
                   "run swapped against")
    p.add_argument("--nnodes", type=int, default=1, help="machines taking part (default 1)")
    p.add_argument("--nproc-per-node", type=int,
                   help="processes on this machine (default: tasklets / nnodes)")
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:29400",
                   help="HOST:PORT of the rendezvous (one machine's address, the same everywhere)")
    p.add_argument("--rdzv-id",
                   help="job id shared by all machines (default: from the layout path)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="elastic restarts after a failure (default 3)")
    p.add_argument("--devices", help="comma-separated layout device names of this machine's "
                   "processes, in local-rank order (several machines: tasklets follow devices)")
    p.add_argument("--run", action="store_true", help="run the command instead of printing it")


def _launch_args(args: argparse.Namespace) -> None:
    """Options written after the layout land in the script remainder: parse those before `--`."""
    rest = list(args.script)
    if "--" in rest and rest[0] != "--":
        cut = rest.index("--")
        own = argparse.ArgumentParser(prog="atomc launch", add_help=False)
        _launch_options(own)
        try:
            extra = own.parse_args(rest[:cut])
        except SystemExit:
            raise UsageError(f"atomc launch: cannot read the options {' '.join(rest[:cut])!r} "
                             f"before `--`; see `atomc launch --help`") from None
        for key, value in vars(extra).items():
            if value != own.get_default(key):
                setattr(args, key, value)
        args.script = rest[cut:]


def _script(args: argparse.Namespace) -> tuple[str, list[str]]:
    rest = list(args.script)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise UsageError("no training script: give it after the options, e.g. "
                         "`-- examples/train_layout.py --package out/pkg`")
    return rest[0], rest[1:]


def run_launch(args: argparse.Namespace) -> int:
    _launch_args(args)
    script, script_args = _script(args)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    cmd = build_command(args.layout, script, script_args, nnodes=args.nnodes,
                        nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                        rdzv_id=args.rdzv_id, max_restarts=args.max_restarts, devices=devices,
                        network=args.network)
    if not args.run:
        print(cmd.text())
        return 0
    print(cmd.text(), file=sys.stderr)
    return run_command(cmd)


def _split(values: list[str]) -> list[str]:
    return [v.strip() for item in values or [] for v in item.replace(",", " ").split() if v.strip()]


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    args.initial_peers = _split(args.initial_peers)
    args.host_maddrs = _split(args.host_maddrs)
    args.announce_maddrs = _split(args.announce_maddrs)
    env = {"ATOMC_PEER_RUN_ID": args.run_id,
           "ATOMC_PEER_INITIAL_PEERS": " ".join(args.initial_peers)}
    if args.target_batch_size is not None:
        env["ATOMC_PEER_TARGET_BATCH_SIZE"] = str(args.target_batch_size)
    if args.rounds is not None:
        env["ATOMC_PEER_ROUNDS"] = str(args.rounds)
    if args.host_maddrs:
        env["ATOMC_PEER_HOST_MADDRS"] = " ".join(args.host_maddrs)
    if args.announce_maddrs:
        env["ATOMC_PEER_ANNOUNCE_MADDRS"] = " ".join(args.announce_maddrs)
    if args.name:
        env["ATOMC_PEER_NAME"] = args.name
    if args.min_peers is not None:
        env["ATOMC_PEER_MIN_PEERS"] = str(args.min_peers)
    for key in OUTER_OPTIONS:
        value = getattr(args, key, None)
        if value is not None:
            env[f"ATOMC_PEER_{key.upper()}"] = str(value)
    return env


# `atomc peer`'s outer options, passed on as ATOMC_PEER_<NAME> (examples/train_peer.py)
OUTER_OPTIONS = ("outer", "outer_lr", "outer_momentum", "inner_steps", "round_dtype", "fragments")


def check_outer(args: argparse.Namespace) -> None:
    """The outer options, checked as the peer checks them (one line, exit 2), before the
    script starts: all but --fragments, which needs the package's sub-models."""
    from atomc.distributed.outer import OuterConfig

    OuterConfig.make(outer=args.outer or "sgd", lr=args.outer_lr, momentum=args.outer_momentum,
                     inner_steps=args.inner_steps, round_dtype=args.round_dtype,
                     fragments=1 if args.fragments is None else args.fragments)


def run_peer_cli(args: argparse.Namespace) -> int:
    check_outer(args)
    env_add = peer_env(args)
    for a in args.initial_peers:
        if not a.startswith("/"):
            raise UsageError(f"initial peer {a!r} is not a multiaddress; give the address another "
                             f"peer printed, e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID")
    script, script_args = _script(args)
    argv = [sys.executable, script, *script_args]
    if args.print_only:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env_add.items()) if v) + " "
              + " ".join(shlex.quote(a) for a in argv))
        return 0
    env = dict(os.environ)
    env.update(env_add)
    env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the script's whole process group: hivemind's DHT, averager and p2p daemon with it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
