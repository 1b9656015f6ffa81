"""`atomc train PACKAGE_DIR --steps N`: swapped training of a generated package on byte-level text.

The data is text fed as bytes (a byte-level language model: one int64 input of shape
[micro-batch, sequence]): the Python standard library's sources by default, or a file. Models
with other inputs are trained through the Python API (atomc.runtime.SwapTrainer).
"""

from __future__ import annotations

import argparse

from atomc.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a generated package with the swap runtime",
                       description="Train the sub-models of PACKAGE_DIR (written by "
                                   "`atomc codegen`) with the swap runtime on byte-level text.")
    p.add_argument("package", help="generated package directory")
    p.add_argument("--steps", type=int, required=True,
                   help="optimizer steps to run (in total, with --resume)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--accum", type=int, help="micro-batches per step, C (default: the plan's)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps, then cosine decay")
    p.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm to this")
    p.add_argument("--transfer-dtype", metavar="DTYPE",
                   help="weights and gradients on the GPU: float32, bfloat16 or float16 "
                        "(default: the plan's)")
    p.add_argument("--autocast", metavar="DTYPE",
                   help="compute dtype under torch.autocast (default: the plan's)")
    p.add_argument("--activations", choices=["recompute", "keep"], help="default: the plan's")
    p.add_argument("--data", default="stdlib",
                   help="'stdlib' (the Python standard library's sources) or a text file "
                        "(default stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint",
                   help="write a checkpoint here at the end (and every --every steps)")
    p.add_argument("--every", type=int, default=0,
                   help="checkpoint interval in steps (0: only at the end)")
    p.add_argument("--resume", help="continue from this checkpoint")
    p.add_argument("--trace", help="write the measured event trace of the last steps (JSON)")
    p.add_argument("--timeline", help="draw the measured timeline of the last steps (SVG)")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from atomc.runtime import SwapTrainer, warmup_cosine
    from atomc.runtime.data import text_batches
    from atomc.runtime.trace import to_timeline

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be 1 or more")
    schedule = warmup_cosine(args.warmup, args.steps) if args.warmup else None
    trainer = SwapTrainer.from_package(
        args.package, device=args.device, accum=args.accum, seed=args.seed,
        activations=args.activations,
        optimizer={"lr": args.lr, "weight_decay": args.weight_decay,
                   "max_grad_norm": args.max_grad_norm, "lr_schedule": schedule},
        transfer_dtype=args.transfer_dtype, autocast=args.autocast, checkpoint=args.resume,
        trace=bool(args.trace or args.timeline))
    try:
        data = text_batches(trainer, args.data, args.seed)
        print(trainer.describe())
        start = trainer.step_count
        if start >= args.steps:
            print(f"the checkpoint is at step {start}, --steps is {args.steps}: nothing to do")
            return 0
        bar = tqdm(range(start, args.steps), desc="training", unit="step", initial=start,
                   total=args.steps)
        for step in bar:
            try:
                loss = trainer.step(data.batch(step))
            except IndexError as e:  # an embedding smaller than the 256 byte values
                raise UsageError(
                    f"{args.package} failed on byte-level text at step {step} (IndexError: "
                    f"{e}); `atomc train` feeds bytes, token ids 0-255, which a model whose "
                    f"vocabulary has fewer than 256 entries cannot look up: train it on its "
                    f"own data with atomc.runtime.SwapTrainer (--debug shows where it "
                    f"failed)") from e
            bar.set_postfix(loss=f"{loss:.4f}")
            if args.checkpoint and args.every and (step + 1) % args.every == 0:
                trainer.save_checkpoint(args.checkpoint)
        bar.close()
        print(f"step {trainer.step_count}: loss {trainer.last_loss:.4f}")
        if args.checkpoint:
            print(f"wrote {trainer.save_checkpoint(args.checkpoint)}")
        if args.trace or args.timeline:
            traces = list(trainer.traces.values())
            if args.trace:
                from atomc.jsonio import write_json
                write_json(args.trace, {"kind": "atomc.swap-trace",
                                        "steps": [t.to_json() for t in traces]})
                print(f"wrote {args.trace}")
            if args.timeline:
                from atomc.simulate import write_timeline_svg
                timeline = to_timeline(traces, len(trainer.store.layouts), trainer.accum,
                                       label=f"{args.package}: measured on {trainer.device}")
                write_timeline_svg(timeline, args.timeline)
                print(f"wrote {args.timeline}")
    finally:
        trainer.close()
    return 0


__all__ = ["register", "run_train"]
