"""Train a generated package as one ATOM peer: a full copy with the swap runtime, averaged with the
other peers of the run whenever they have processed a global batch together.

    atomc peer --run-id demo --target-batch-size 64 examples/train_peer.py --package out/pkg
    atomc peer --run-id demo --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/12D3Koo... \\
        examples/train_peer.py --package out/pkg

`atomc peer` passes the peer options in ATOMC_PEER_* variables (or give them here as flags).
The first peer prints its address; every other peer joins through any live peer's address.

Data: `--data counting` (default) gives sequences t, t+1, t+2, ... (mod the vocabulary) from
random starts, which a GPT learns in a few hundred steps, so falling losses show that the
peers train; `--data random` draws the model file's `example_inputs`. Replace `batch_of` with
your data loader; each peer should read different data.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"ATOMC_PEER_{name}", default)


def _float(text: str | None) -> float | None:
    return None if text is None else float(text)


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", required=True, help="generated package directory (atomc codegen)")
    p.add_argument("--run-id", default=_env("RUN_ID", "atomc"),
                   help="peers with the same run id train together")
    p.add_argument("--initial-peers", nargs="*", default=(_env("INITIAL_PEERS") or "").split(),
                   help="multiaddresses of live peers (none: start a new run)")
    p.add_argument("--host-maddrs", nargs="*",
                   default=(_env("HOST_MADDRS") or "/ip4/127.0.0.1/tcp/0").split(),
                   help="where to listen (default loopback; "
                   "/ip4/0.0.0.0/tcp/31337 for other machines)")
    p.add_argument("--announce-maddrs", nargs="*", default=(_env("ANNOUNCE_MADDRS") or "").split(),
                   help="addresses other peers should dial (public IP behind a forwarded port)")
    p.add_argument("--target-batch-size", type=int, default=int(_env("TARGET_BATCH_SIZE", "64")),
                   help="samples over all peers between two averaging rounds (the global batch)")
    p.add_argument("--rounds", type=int, default=int(_env("ROUNDS", "10")),
                   help="averaging rounds to train")
    p.add_argument("--min-peers", type=int, default=int(_env("MIN_PEERS", "1")),
                   help="a new run: take the first step once this many peers have their state")
    p.add_argument("--outer", default=_env("OUTER", "sgd"), choices=("sgd", "nesterov"),
                   help="outer optimizer: sgd (at --outer-lr 1: ATOM's averaging) or nesterov "
                        "(DiLoCo)")
    p.add_argument("--outer-lr", type=float, default=_float(_env("OUTER_LR")),
                   help="default: 1 for sgd, 0.7 for nesterov")
    p.add_argument("--outer-momentum", type=float, default=_float(_env("OUTER_MOMENTUM")),
                   help="default: 0 for sgd, 0.9 for nesterov")
    p.add_argument("--inner-steps", type=int, default=_int(_env("INNER_STEPS")),
                   help="local steps between rounds (default: the global batch rule)")
    p.add_argument("--round-dtype", default=_env("ROUND_DTYPE"),
                   choices=("float32", "bfloat16", "float16", "int8"),
                   help="what pseudo-gradients travel in (default: the master dtype)")
    p.add_argument("--fragments", type=int, default=int(_env("FRAGMENTS", "1")),
                   help="sub-model groups averaged in turn, one a round")
    p.add_argument("--accum", type=int, default=None,
                   help="micro-batches per local step (default: the plan's C)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="master dtype: float32 (default) or float64")
    p.add_argument("--seed", type=int, default=0, help="initial weights (the same on every peer)")
    p.add_argument("--data", choices=("counting", "random"), default="counting")
    p.add_argument("--data-seed", type=int, default=None,
                   help="default: derived from the peer's name")
    p.add_argument("--name", default=_env("NAME", ""), help="this peer's name in logs and metrics")
    p.add_argument("--matchmaking-time", type=float, default=float(_env("MATCHMAKING_TIME", "2.0")))
    p.add_argument("--averaging-timeout", type=float,
                   default=float(_env("AVERAGING_TIMEOUT", "30")))
    p.add_argument("--connect-timeout", type=float, default=float(_env("CONNECT_TIMEOUT", "20")))
    p.add_argument("--max-seconds", type=float, default=None, help="fail when the run takes longer")
    p.add_argument("--linger", type=float, default=0.0,
                   help="seconds to keep serving after the last round")
    p.add_argument("--metrics", default=None, help="append one JSON line per step and round here")
    p.add_argument("--final", default=None, help="write this peer's final weights here")
    p.add_argument("--maddr-file", default=None, help="write this peer's address here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from atomc.distributed.outer import OuterConfig
    from atomc.distributed.peer import run_peer
    from atomc.distributed.peerconfig import PeerConfig
    from atomc.errors import AtomcError, UsageError
    from atomc.runtime.package import load_swap_package
    from atomc.trace.load import call_with_options, load_model_file

    name = args.name or f"peer-{os.getpid()}"
    try:
        pkg = load_swap_package(args.package)
        plan = pkg.plan
        model_path = pkg.model_file()
        if model_path is None:
            raise UsageError(f"{args.package} was generated from {plan.model_path}, which is not "
                             f"found from here; run from the directory the plan was made in")
        module = load_model_file(model_path)
        options = dict(plan.options)
        config = plan.config
        with torch.device("meta"):  # shapes only: the trainer makes the initial weights
            model = call_with_options(module.build_model, (config,), options, model_path)
        accum = args.accum or plan.accum
        local_batch = accum * (plan.batch_size or 1)
        vocab = int(getattr(getattr(model, "cfg", None), "vocab_size", 256))
        data_seed = args.data_seed if args.data_seed is not None else sum(name.encode())

        def batch_of(step: int):
            g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
            if args.data == "random":
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(data_seed * 1_000_003 + step)
                    batch = call_with_options(module.example_inputs, (model, local_batch), options,
                                              model_path)
                return batch if isinstance(batch, tuple) else (batch,)
            (x,) = call_with_options(module.example_inputs, (model, local_batch), options,
                                     model_path)
            start = torch.randint(0, vocab, (local_batch, 1), generator=g)
            return (((start + torch.arange(x.shape[1])) % vocab).to(x.dtype),)

        outer = OuterConfig.make(outer=args.outer, lr=args.outer_lr,
                                 momentum=args.outer_momentum, inner_steps=args.inner_steps,
                                 round_dtype=args.round_dtype, fragments=args.fragments)
        cfg = PeerConfig(
            package=args.package, run_id=args.run_id, initial_peers=tuple(args.initial_peers),
            host_maddrs=tuple(args.host_maddrs), announce_maddrs=tuple(args.announce_maddrs),
            target_batch_size=args.target_batch_size, rounds=args.rounds, accum=accum,
            optimizer={"lr": args.lr, "weight_decay": args.weight_decay}, device=args.device,
            dtype=args.dtype, seed=args.seed,
            matchmaking_time_s=args.matchmaking_time, averaging_timeout_s=args.averaging_timeout,
            connect_timeout_s=args.connect_timeout, max_seconds=args.max_seconds,
            metrics_path=args.metrics, final_path=args.final, maddr_path=args.maddr_file, name=name,
            outer=outer, min_peers=args.min_peers)
        # initial weights: the package's initial_state_dict(seed), as every peer makes them
        run_peer(cfg, batch_of, loss_fn=module.loss_fn, linger_s=args.linger,
                 log=lambda s: print(f"[{name}] {s}", flush=True))
    except AtomcError as e:
        print(f"train_peer ({name}): error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
