"""`atomc swarm serve PACKAGE` (one server of a stage) and `atomc swarm train PACKAGE` (one
trainer): SWARM parallelism over hivemind (atomc.swarm).

The server, the trainer and their data import torch and hivemind: imported when the command
runs, so that building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from atomc.errors import UsageError
from atomc.swarm.config import ServeConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("swarm", help="SWARM parallelism: serve pipeline stages, train through them",
                       description="Stochastically wired, adaptively rebalanced pipelines on "
                                   "hivemind: `serve` runs one server of a stage, `train` one "
                                   "trainer.")
    own = p.add_subparsers(dest="swarm_command", metavar="{serve,train}")
    s = own.add_parser("serve", help="serve one pipeline stage of a generated package",
                       description="Serve one stage of PACKAGE (its sub-models in --stages "
                                   "balanced stages) until interrupted.")
    _common(s)
    s.add_argument("--stage", default="auto",
                   help="stage to serve, 0..N-1, or 'auto': the one that needs a server most")
    s.add_argument("--target-batch-size", type=int, required=True,
                   help="samples per optimizer step over all trainers (the global batch)")
    s.add_argument("--dtype", help="master dtype: float32 (default) or float64")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    s.add_argument("--seed", type=int, default=0,
                   help="initial weights: build_model under manual_seed(SEED) (default 0)")
    s.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    s.add_argument("--weight-decay", type=float, default=0.01)
    s.add_argument("--swap", action="store_true",
                   help="swap the stage's sub-models through the device (the swap runtime)")
    s.add_argument("--rebalance-period", type=float, metavar="T",
                   help="every T seconds the least-loaded server of the least-loaded stage may "
                        "move to the most-loaded one (default: never)")
    s.add_argument("--min-gain", type=float, default=0.0, metavar="FRACTION",
                   help="move only if the lower of the two stages' throughputs rises by more "
                        "than this fraction (default 0: any gain)")
    s.add_argument("--rate-window", type=float, default=10.0, metavar="SECONDS",
                   help="the throughput a server announces (and rebalancing compares) covers "
                        "about its last SECONDS of calls (default 10)")
    s.add_argument("--delayed-updates", action="store_true",
                   help="delayed parameter updates: each step's calls use the weights before "
                        "the last step's update, which runs meanwhile (one more copy of the "
                        "stage's weights and optimizer state)")
    s.add_argument("--slowdown", type=float, metavar="F",
                   help="emulate a device F times slower than the one the plan was profiled "
                        "on: every call lasts F times what the profile says it takes (or what "
                        "it took, if longer); needs a package made from a profile")
    s.add_argument("--checkpoint-dir",
                   help="write the stage's state here after every step (a stage left without "
                        "servers resumes from it)")
    s.add_argument("--expiration", type=float, default=4.0,
                   help="seconds after which a silent server drops out of the DHT (default 4)")
    s.add_argument("--matchmaking-time", type=float, default=1.0)
    s.add_argument("--averaging-timeout", type=float, default=20.0)
    s.add_argument("--maddr-file", help="write this server's addresses here")
    s.add_argument("--max-seconds", type=float, help="stop serving after this long")
    s.set_defaults(func=run_swarm_serve)
    t = own.add_parser("train", help="train a generated package through the swarm's servers",
                       description="Send batches through the servers of every stage, one optimizer "
                                   "step per global batch.")
    _common(t)
    t.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    t.add_argument("--batch-size", type=int, required=True,
                   help="samples this trainer sends per step (all trainers together: the "
                        "servers' --target-batch-size)")
    t.add_argument("--micro-batch-size", type=int, help="default: the plan's batch size")
    t.add_argument("--trainers", type=int, default=1,
                   help="trainers sharing each step (each sends --batch-size samples)")
    t.add_argument("--trainer-index", type=int, default=0,
                   help="this trainer's place among them, 0..trainers-1")
    t.add_argument("--compress", action="store_true",
                   help="8-bit blockwise activations and gradients on the links")
    t.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a server has to answer one call (default 30)")
    t.add_argument("--servers-timeout", type=float, default=60.0,
                   help="seconds to wait for a server of every stage (default 60)")
    t.add_argument("--max-in-flight", type=int, default=2,
                   help="calls this trainer keeps unanswered at one server (default 2: one "
                        "running, one queued; more where a round trip outlasts a call)")
    t.add_argument("--data", choices=("counting", "random"), default="counting",
                   help="counting sequences (learnable) or the model file's example_inputs")
    t.add_argument("--data-seed", type=int, default=0)
    t.set_defaults(func=run_swarm_train)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("package", help="generated package directory (atomc codegen)")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages of the swarm")
    p.add_argument("--prefix", default="atomc-swarm",
                   help="DHT prefix: servers and trainers with the same prefix work together")
    p.add_argument("--initial-peers", action="append", default=[], metavar="MADDR",
                   help="multiaddress of any live server or trainer (repeatable; none: a new "
                        "swarm)")
    p.add_argument("--host-maddrs", action="append", default=[], metavar="MADDR",
                   help="where to listen (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for "
                        "other machines)")
    p.add_argument("--announce-maddrs", action="append", default=[], metavar="MADDR",
                   help="an address others should dial (repeatable)")
    p.add_argument("--connect-timeout", type=float, default=20.0,
                   help="seconds to join the swarm through --initial-peers (default 20)")
    p.add_argument("--name", default="", help="name in logs and metrics")
    p.add_argument("--metrics", help="append one JSON line per event here")


def _split(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or [] for v in item.replace(",", " ").split()
                 if v.strip())


def _addresses(args: argparse.Namespace) -> dict[str, Any]:
    return {"initial_peers": _split(args.initial_peers),
            "host_maddrs": _split(args.host_maddrs) or ("/ip4/127.0.0.1/tcp/0",),
            "announce_maddrs": _split(args.announce_maddrs)}


def run_swarm_serve(args: argparse.Namespace) -> int:
    from atomc.swarm.server import SwarmServer

    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    if args.stage == "auto":
        stage = None
    else:
        try:
            stage = int(args.stage)
        except ValueError:
            raise UsageError(f"--stage {args.stage!r} is not a stage number or 'auto'") from None
    name = args.name or f"server-{os.getpid()}"
    cfg = ServeConfig(
        package=args.package, num_stages=args.stages, stage=stage,
        target_batch_size=args.target_batch_size, prefix=args.prefix, **_addresses(args),
        device=args.device, dtype=args.dtype, seed=args.seed,
        optimizer={"lr": args.lr, "weight_decay": args.weight_decay}, swap=args.swap,
        expiration_s=args.expiration, rebalance_s=args.rebalance_period,
        matchmaking_s=args.matchmaking_time, averaging_timeout_s=args.averaging_timeout,
        connect_timeout_s=args.connect_timeout, slowdown=args.slowdown,
        min_gain=args.min_gain, rate_window_s=args.rate_window,
        delayed_updates=args.delayed_updates,
        checkpoint_dir=args.checkpoint_dir, name=name, maddr_path=args.maddr_file,
        metrics_path=args.metrics)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = SwarmServer(cfg, log=lambda s: print(f"[{name}] {s}", flush=True))
    try:
        print(f"[{name}] stage {server.state.spec.index} of {args.stages}: "
              f"{' '.join(server.maddrs)}", flush=True)
        server.serve(stop, max_seconds=args.max_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def run_swarm_train(args: argparse.Namespace) -> int:
    from atomc.swarm.client import SwarmTrainer, TrainConfig

    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be 1 or more")
    if not 0 <= args.trainer_index < args.trainers:
        raise UsageError(f"--trainer-index {args.trainer_index} is not one of the --trainers "
                         f"{args.trainers} (0 to {args.trainers - 1})")
    name = args.name or f"trainer-{os.getpid()}"
    trainer = SwarmTrainer(TrainConfig(
        package=args.package, num_stages=args.stages, prefix=args.prefix, **_addresses(args),
        micro_batch_size=args.micro_batch_size, compress=args.compress,
        request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
        servers_timeout_s=args.servers_timeout, max_in_flight=args.max_in_flight, name=name),
        log=lambda s: print(f"[{name}] {s}", file=sys.stderr, flush=True))
    try:
        size = trainer.micro_batch_size
        if args.batch_size % size:
            raise UsageError(f"--batch-size {args.batch_size} is not a multiple of the "
                             f"micro-batch size {size}")
        mine = args.batch_size // size
        trainer.cfg.first_micro = args.trainer_index * mine
        trainer.cfg.global_micro = args.trainers * mine
        batch_of = _data(trainer, args)
        for step in range(args.steps):
            stats = trainer.step(batch_of(step))
            line = {"step": step, "loss": stats.loss, "seconds": stats.seconds,
                    "calls": stats.calls, "retries": stats.retries, "resent": stats.resent,
                    "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                    "time": time.time(), "trainer": name}
            print(f"step {step}: loss {stats.loss:.4f} ({stats.seconds:.2f} s, "
                  f"{stats.retries} retries, {stats.resent} re-sent)", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        trainer.close()
    return 0


def _data(trainer: Any, args: argparse.Namespace) -> Any:
    """Batches for step s: this trainer's share of the global batch."""
    import torch

    from atomc.trace.load import call_with_options

    pkg = trainer.node.pkg
    module = pkg.model_module()
    path = pkg.model_file()
    options = dict(pkg.plan.options)
    with torch.device("meta"):
        model = call_with_options(module.build_model, (pkg.plan.config,), options, path)
    vocab = int(getattr(getattr(model, "cfg", None), "vocab_size", 256))

    def batch_of(step: int) -> tuple:
        seed = (args.data_seed * 1_000_003 + step) * 1_009 + args.trainer_index
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            batch = call_with_options(module.example_inputs, (model, args.batch_size), options,
                                      path)
        batch = batch if isinstance(batch, tuple) else (batch,)
        if args.data == "random":
            return tuple(t.to("cpu") for t in batch)
        (x,) = batch
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (args.batch_size, 1), generator=g)
        return (((start + torch.arange(x.shape[1])) % vocab).to(x.dtype),)

    return batch_of


__all__ = ["register", "run_swarm_serve", "run_swarm_train"]
