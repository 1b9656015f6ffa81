"""Train a generated package over a DT-FM layout: the script `torchrun` runs on every rank.

    atomc launch layout.json --run -- examples/train_layout.py --package out/pkg --steps 100

Every rank builds the same global batch (here: synthetic tokens from the model file's
`example_inputs`, seeded by the step, so a restarted run sees the same data), keeps its
replica's slice, and trains its stage. Replace `batch_of` with a real data loader that gives
every rank the same global batch for a step.

Initial weights are the model file's `build_model()` under `torch.manual_seed(--seed)`: the
same weights single-process training starts from. Exit status 2 with one line on a bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", required=True, help="generated package directory (atomc codegen)")
    p.add_argument("--layout", default=os.environ.get("ATOMC_LAYOUT"),
                   help="layout JSON (atomc place); default: $ATOMC_LAYOUT, set by `atomc launch`")
    p.add_argument("--network", default=os.environ.get("ATOMC_NETWORK"),
                   help="the layout's network JSON: link delays for --emulate-delay, and each "
                   "device's memory_bytes (stages that do not fit run swapped); default: "
                   "$ATOMC_NETWORK, set by `atomc launch --network`")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step over all replicas "
                   "(default: D_DP x plan's C x micro-batch)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per micro-batch (default: the plan's)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=None)
    p.add_argument("--optimizer-impl", choices=("fused", "foreach", "for-loop"), default="fused")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (LOCAL_RANK's GPU, NCCL)")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights: build_model() under this seed")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--swap-stages", default="", help="comma-separated stages to run swapped")
    p.add_argument("--memory-budget", default=None,
                   help="device memory per stage, e.g. 8GiB: stages that do not fit run swapped "
                   "(default: the device's memory_bytes in --network, else a CUDA device's total "
                   "memory, less --memory-reserve)")
    p.add_argument("--memory-reserve", default=None,
                   help="left free of the device's memory when no --memory-budget is given, "
                   "e.g. 1GiB (default: the plan's reserve, atomc partition --reserve)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--metrics", default=None, help="append one JSON line per step here (replica 0)")
    p.add_argument("--final-dir", default=None, help="write each stage's final weights here")
    p.add_argument("--emulate-delay", action="store_true",
                   help="add the layout network's link delays in the send path (no tc netem)")
    p.add_argument("--dp-reduce", choices=("auto", "allreduce", "p2p"), default="auto")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any collective or receive may take")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from atomc.distributed.runner import LayoutConfig, run_layout
    from atomc.errors import AtomcError, UsageError
    from atomc.runtime.package import load_swap_package
    from atomc.trace.load import call_with_options, load_model_file
    from atomc.units import parse_size

    try:
        if not args.layout:
            raise UsageError("no layout: give --layout FILE (or run under `atomc launch`)")
        pkg = load_swap_package(args.package)
        plan = pkg.plan
        model_path = pkg.model_file()
        if model_path is None:
            raise UsageError(f"{args.package} was generated from {plan.model_path}, which is not "
                             f"found from here; run from the directory the plan was made in")
        module = load_model_file(model_path)
        options = dict(plan.options)
        config = plan.config

        def initial_state() -> dict[str, torch.Tensor]:
            return pkg.initial_state_dict(args.seed)

        with torch.device("meta"):
            shape_model = call_with_options(module.build_model, (config,), options, model_path)

        from atomc.distributed.groups import load_layout

        layout = load_layout(args.layout, args.network)
        micro = args.micro_batch or (plan.batch_size or 1)
        global_batch = args.global_batch or layout.dp * plan.accum * micro

        def batch_of(step: int):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.data_seed * 1_000_003 + step)
                batch = call_with_options(module.example_inputs, (shape_model, global_batch),
                                          options, model_path)
            return batch if isinstance(batch, tuple) else (batch,)

        cfg = LayoutConfig(
            package=args.package, layout=layout, network=args.network, global_batch=global_batch,
            micro_batch=micro,
            schedule=args.schedule,
            optimizer={"lr": args.lr, "weight_decay": args.weight_decay,
                       "impl": args.optimizer_impl, "max_grad_norm": args.max_grad_norm},
            device=args.device, dtype=args.dtype,
            swap_stages=tuple(int(s) for s in args.swap_stages.split(",") if s.strip()),
            memory_budget_bytes=(parse_size(args.memory_budget, "--memory-budget")
                                 if args.memory_budget else None),
            memory_reserve_bytes=(parse_size(args.memory_reserve, "--memory-reserve")
                                  if args.memory_reserve else None),
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
            dp_reduce=args.dp_reduce, emulate_delay=args.emulate_delay, timeout_s=args.timeout,
            seed=args.seed, metrics_path=args.metrics)
        rank = os.environ.get("RANK", "0")
        run_layout(cfg, module.loss_fn, initial_state, batch_of, args.steps,
                   final_dir=args.final_dir, log=lambda s: print(f"[rank {rank}] {s}", flush=True))
    except AtomcError as e:
        print(f"train_layout (rank {os.environ.get('RANK', '?')}): error: {e}", file=sys.stderr,
              flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
