"""`atomc train [PACKAGE_DIR] --steps N`: swapped training of a generated package on token data.

The model takes one integer input of shape [micro-batch, sequence] (a language model's token
ids); `--data` gives them: a token-id binary or .npy array, text or JSONL with a tokenizer
from a local directory, a `datasets` dataset saved to disk, or text as bytes (the Python
standard library's sources by default). Models with other inputs are trained through the
Python API (atomc.runtime.SwapTrainer). `--config run.toml` holds any of the options
(`key = value`, the option's name without its dashes); the command line overrides the file.
`--eval-data` gives a held-out loss, `--log-dir` a record of the run (JSONL, and TensorBoard
with `--tensorboard`). docs/data.md describes each.

The data readers and the runtime import torch: the commands import them when they run, so
that building this parser (`atomc --help`) does not.
"""

from __future__ import annotations

import argparse
from typing import Any

from tqdm import tqdm

from atomc.errors import UsageError
from atomc.jsonio import write_json
from atomc.simulate import write_timeline_svg

_UNSET = object()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a generated package with the swap runtime",
                       description="Train the sub-models of PACKAGE_DIR (written by "
                                   "`atomc codegen`) with the swap runtime on token data.")
    p.add_argument("package", nargs="?",
                   help="generated package directory (or package = \"DIR\" in --config)")
    p.add_argument("--config", metavar="TOML",
                   help="read options from this TOML file (`lr = 3e-4`, one option a line, "
                        "named as the flags without their dashes); flags given here override it")
    p.add_argument("--steps", type=int,
                   help="optimizer steps to run (in total, with --resume); required")
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
    p.add_argument("--activations", choices=["auto", "recompute", "keep"],
                   help="default: the plan's (auto: its per-operator keep/send/recompute policy)")
    p.add_argument("--optimizer-states", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of AdamW's moments on the host (default float32; bfloat16 "
                        "halves them, the update computes in float32)")
    p.add_argument("--data", default="stdlib",
                   help="training data: a token-id file (.bin with --data-dtype or a PATH.json "
                        "sidecar, .npy), a text or JSONL file (with --tokenizer; text without "
                        "one is read as bytes), a dataset directory (save_to_disk), or "
                        "'stdlib' (the Python standard library's sources as bytes; default)")
    p.add_argument("--data-format", choices=["tokens", "text", "jsonl", "dataset"],
                   help="how to read --data and --eval-data (default: from the path: a "
                        "directory is a dataset, .bin/.npy token ids, .jsonl JSONL, else text)")
    p.add_argument("--data-dtype", choices=["uint8", "uint16", "int16", "uint32", "int32",
                                            "int64"],
                   help="integer type of a .bin token file (default: its PATH.json sidecar)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenize text, JSONL and dataset text with the transformers tokenizer "
                        "saved in this local directory (or a tokenizer.json file)")
    p.add_argument("--text-field", default="text",
                   help="the text field of JSONL records and dataset rows (default text)")
    p.add_argument("--eval-data", metavar="PATH",
                   help="held-out data, read as --data is: its loss is reported")
    p.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps (default 0: at the end only)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="batches of --eval-data per evaluation, the same each time (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint",
                   help="write a checkpoint here at the end (and every --every steps)")
    p.add_argument("--every", type=int, default=0,
                   help="checkpoint interval in steps (0: only at the end)")
    p.add_argument("--resume", help="continue from this checkpoint (and where its data stood)")
    _weights_options(p)
    _offload_option(p)
    p.add_argument("--log-dir", metavar="DIR",
                   help="record loss, learning rate, gradient norm, tokens/s and device busy "
                        "time per step in DIR/metrics.jsonl")
    p.add_argument("--log-every", type=int, default=1,
                   help="record every N steps (default 1); a recorded step waits for its "
                        "optimizer updates")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the record as TensorBoard scalars in --log-dir (needs the "
                        "tensorboard package)")
    p.add_argument("--trace", help="write the measured event trace of the last steps (JSON)")
    p.add_argument("--timeline", help="draw the measured timeline of the last steps (SVG)")
    p.set_defaults(func=run_train)
    _note_command_line(p)
    register_export(sub)


def _note_command_line(parser: argparse.ArgumentParser) -> None:
    """Have `parser` record which options its command line gave (`args.given_options`) and
    what its options are (`args.option_actions`, read when it parses, so an option added to
    the parser anywhere is a key of the settings file too): a --config file fills in the
    others. A second parse, into a namespace where every option is unset, tells them apart."""
    parse = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, rest = parse(args, namespace)
        actions = {a.dest: a for a in parser._actions if a.dest != argparse.SUPPRESS}
        # an appending option adds to what is there: it starts from None, not the marker
        unset = {d: None if isinstance(a, argparse._AppendAction) else _UNSET
                 for d, a in actions.items()}
        probe = argparse.Namespace(**unset)
        parse(args, probe)
        # a positional that may be left out is set to its default when it is
        ns.given_options = frozenset(
            d for d, v in vars(probe).items()
            if d in actions and v is not unset[d]
            and (actions[d].option_strings or v != actions[d].default))
        ns.option_actions = actions
        return ns, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def apply_settings_file(args: argparse.Namespace) -> None:
    """Options from --config for those the command line did not give."""
    if args.config is None:
        return
    from atomc.runtime.config import read_settings_file
    actions = {d: a for d, a in args.option_actions.items() if d not in ("help", "config")}
    for dest, value in read_settings_file(args.config, actions).items():
        if dest not in args.given_options:
            setattr(args, dest, value)


def _check_options(args: argparse.Namespace) -> None:
    if not args.package:
        raise UsageError("give the package directory: atomc train PACKAGE_DIR (or package = "
                         "\"DIR\" in the --config file)")
    if args.steps is None:
        raise UsageError("give the number of steps: --steps N (or steps = N in the --config "
                         "file)")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be 1 or more")
    for name in ("eval_every", "every"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be 0 or "
                             f"more")
    for name in ("eval_batches", "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be 1 or "
                             f"more")
    if args.eval_every and not args.eval_data:
        raise UsageError("--eval-every evaluates on --eval-data: give the held-out data")
    if args.tensorboard and not args.log_dir:
        raise UsageError("--tensorboard writes into --log-dir: give the directory")


def _offload_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload-dir", action="append", default=[], metavar="PATH",
                   help="a directory on an NVMe drive for the model states the plan keeps on "
                        "disk (atomc partition --offload-dir); give one per drive, and the "
                        "same drives to resume a checkpoint")


def _weights_options(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument("--weights", metavar="PATH",
                   help="pretrained weights: a checkpoint directory or file (safetensors, "
                        "sharded with its index, or a .bin/.pt state dict), read tensor by "
                        "tensor into host memory (docs/checkpoints.md)")
    p.add_argument("--adapter", metavar="PATH",
                   help="with --weights: a peft adapter's weights (adapter_model.safetensors "
                        "or its directory); without it a peft model's adapter starts as the "
                        "model file builds it")


def _weights_paths(args: argparse.Namespace) -> list[str] | None:
    if args.adapter and not args.weights:
        raise UsageError("--adapter adds a peft adapter to the base weights: give them with "
                         "--weights")
    return [p for p in (args.weights, args.adapter) if p] or None


def _initial_weights(args: argparse.Namespace) -> list[str] | None:
    """--weights (and --adapter), unless --resume continues a run: its checkpoint has the
    weights it trained (the command that started the run may be given again with --resume)."""
    paths = _weights_paths(args)
    if paths and args.resume:
        print(f"resuming from {args.resume}: its weights replace {' and '.join(paths)}")
        return None
    return paths


def run_train(args: argparse.Namespace) -> int:
    from atomc.data import PackedBatches, held_out, model_vocabulary, token_input
    from atomc.runtime.record import RunRecord, summary_writer_class

    apply_settings_file(args)
    _check_options(args)
    if args.tensorboard:
        summary_writer_class()  # refused before anything is built when tensorboard is absent
    # the data first: a bad path, tokenizer or token file is refused before the model is built
    train_source, eval_source = _open_sources(args)
    trainer = _build_trainer(args)
    record = None
    try:
        _, (micro, seq_len), dtype = token_input(trainer.package)
        rows = trainer.accum * micro
        vocab = model_vocabulary(trainer.package, trainer.executor.loss_fn)
        shape = {"dtype": dtype, "vocab": vocab, "model": str(args.package)}
        data = PackedBatches(train_source, rows, seq_len, **shape)
        held = (held_out(eval_source, rows, seq_len, args.eval_batches, **shape)
                if eval_source is not None else [])
        print(trainer.describe())
        print(f"data: {train_source.description}, {rows} sequences of {seq_len} tokens a step"
              + (f"; held out: {len(held)} batches of {eval_source.description}"
                 if eval_source is not None else ""))
        start = trainer.step_count
        if args.resume:
            print(data.resume(trainer.data_position))
        if start >= args.steps:
            print(f"the checkpoint is at step {start}, --steps is {args.steps}: nothing to do")
            return 0
        if args.log_dir:
            record = RunRecord(args.log_dir, tensorboard=args.tensorboard, start_step=start)
            record.run(package=str(args.package), device=str(trainer.device),
                       accum=trainer.accum, micro_batch=micro, seq_len=seq_len,
                       tokens_per_step=rows * seq_len, data=train_source.description,
                       eval_data=eval_source.description if eval_source else None,
                       start_step=start, steps=args.steps)
            record.start(data.stream.tokens)
        _train_steps(args, trainer, data, held, record, vocab is not None)
        _write_results(args, trainer)
    finally:
        if record is not None:
            record.close()
        trainer.close()
    return 0


def _open_sources(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training data and the held-out data (None without --eval-data), each opened with
    the options its format reads."""
    from atomc.data import load_tokenizer, open_source
    from atomc.data.sources import check_options, used_options

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None

    paths = [args.data, *([args.eval_data] if args.eval_data else [])]
    check_options(paths, args.data_format, {"--data-dtype": args.data_dtype is not None,
                                            "--tokenizer": tokenizer is not None,
                                            "--text-field": args.text_field != "text"})

    def source(path: str, role: str) -> Any:
        # each file with the options its format reads (the other file may read the rest)
        used = used_options(path, args.data_format)
        return open_source(path, fmt=args.data_format,
                           dtype=args.data_dtype if "--data-dtype" in used else None,
                           tokenizer=tokenizer if "--tokenizer" in used else None,
                           text_field=args.text_field if "--text-field" in used else "text",
                           role=role)

    return (source(args.data, "train"),
            source(args.eval_data, "eval") if args.eval_data else None)


def _build_trainer(args: argparse.Namespace) -> Any:
    from atomc.runtime import SwapTrainer, warmup_cosine

    schedule = warmup_cosine(args.warmup, args.steps) if args.warmup else None
    return SwapTrainer.from_package(
        args.package, device=args.device, accum=args.accum, seed=args.seed,
        activations=args.activations,
        optimizer={"lr": args.lr, "weight_decay": args.weight_decay,
                   "max_grad_norm": args.max_grad_norm, "lr_schedule": schedule,
                   "states": args.optimizer_states},
        transfer_dtype=args.transfer_dtype, autocast=args.autocast, checkpoint=args.resume,
        weights=_initial_weights(args), trace=bool(args.trace or args.timeline or args.log_dir),
        offload_dirs=tuple(args.offload_dir))


def _train_steps(args: argparse.Namespace, trainer: Any, data: Any, held: list, record: Any,
                 vocab_known: bool) -> None:
    """The steps from the trainer's step count to --steps, with their evaluations, records and
    checkpoints."""
    from atomc.runtime.evaluate import eval_loss

    def evaluate(done: int) -> None:
        loss = sum(eval_loss(trainer, b) for b in held) / len(held)
        bar.write(f"step {done}: eval loss {loss:.4f}")
        if record is not None:
            record.eval(done, loss)

    start = trainer.step_count
    bar = tqdm(range(start, args.steps), desc="training", unit="step", initial=start,
               total=args.steps)
    for step in bar:
        batch = data.next()
        try:
            loss = trainer.step(batch)
        except IndexError as e:
            if vocab_known:
                raise  # the ids were checked against the vocabulary: not the data's fault
            raise UsageError(
                f"{args.package} failed on {data.source.description} at step {step} "
                f"(IndexError: {e}); its vocabulary could not be read from the model, and "
                f"an id beyond it is the usual cause: give data tokenized for this model "
                f"(--debug shows where it failed)") from e
        trainer.data_position = data.position()
        done = step + 1
        bar.set_postfix(loss=f"{loss:.4f}")
        if record is not None and (done % args.log_every == 0 or done == args.steps):
            trace = trainer.last_trace()
            record.train(done, loss=loss, lr=trainer.optimizer.config.lr_at(step),
                         grad_norm=trainer.optimizer.step_grad_norm(),
                         tokens=data.stream.tokens,
                         device_busy=trace.busy_fraction() if trace else None,
                         step_ms=trace.wall_ms if trace else None)
        paused = False  # tokens/s counts training time: not evaluations, not checkpoints
        if held and (done == args.steps or (args.eval_every and done % args.eval_every == 0)):
            evaluate(done)
            paused = True
        if args.checkpoint and args.every and done % args.every == 0:
            trainer.save_checkpoint(args.checkpoint)
            paused = True
        if paused and record is not None:
            record.start(data.stream.tokens)
    bar.close()


def _write_results(args: argparse.Namespace, trainer: Any) -> None:
    """The last loss, and the checkpoint, record, trace and timeline asked for."""
    from atomc.runtime.trace import to_timeline

    print(f"step {trainer.step_count}: loss {trainer.last_loss:.4f}")
    if args.checkpoint:
        print(f"wrote {trainer.save_checkpoint(args.checkpoint)}")
    if args.log_dir:
        print(f"wrote the record in {args.log_dir}")
    if not (args.trace or args.timeline):
        return
    traces = list(trainer.traces.values())
    if args.trace:
        write_json(args.trace, {"kind": "atomc.swap-trace",
                                "steps": [t.to_json() for t in traces]})
        print(f"wrote {args.trace}")
    if args.timeline:
        timeline = to_timeline(traces, len(trainer.store.layouts), trainer.accum,
                               label=f"{args.package}: measured on {trainer.device}")
        write_timeline_svg(timeline, args.timeline)
        print(f"wrote {args.timeline}")


def register_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a package's trained weights as transformers/peft/safetensors load "
                       "them",
        description="Write the weights of a training checkpoint of PACKAGE_DIR (atomc train "
                    "--checkpoint) to DIR: safetensors shards with their index under the "
                    "model's own names, with config.json for a model built from a "
                    "transformers config (AutoModelForCausalLM.from_pretrained(DIR) loads it), "
                    "a peft model's adapter in peft's format (docs/checkpoints.md).")
    p.add_argument("package", help="generated package directory")
    p.add_argument("--checkpoint", help="a checkpoint atomc train --checkpoint wrote")
    _weights_options(p)  # instead of --checkpoint: weights written again in the model's format
    _offload_option(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="directory to write (new, empty, or an earlier export: replaced whole)")
    p.add_argument("--max-shard-size", default="2GB",
                   help="largest safetensors shard (default 2GB; the export holds one shard in "
                        "memory as it writes it)")
    p.add_argument("--dtype", metavar="DTYPE",
                   help="write floating-point weights as float32, bfloat16 or float16 "
                        "(default: the masters' dtype)")
    p.set_defaults(func=run_export)


def _no_loss(outputs: Any, batch: tuple) -> Any:
    raise UsageError("atomc export does not train: no loss is computed")


def run_export(args: argparse.Namespace) -> int:
    from atomc.runtime import SwapTrainer

    weights = _weights_paths(args)
    if (args.checkpoint is None) == (weights is None):
        raise UsageError("give what to export: --checkpoint FILE (atomc train --checkpoint) or "
                         "--weights PATH, one of them")
    # on the CPU: the weights are in host memory, no device is needed to write them
    trainer = SwapTrainer.from_package(args.package, device="cpu", checkpoint=args.checkpoint,
                                       weights=weights, loss_fn=_no_loss,
                                       threaded_optimizer=False,
                                       offload_dirs=tuple(args.offload_dir))
    try:
        out = trainer.save_pretrained(args.output, max_shard_size=args.max_shard_size,
                                      dtype=args.dtype)
    finally:
        trainer.close()
    files = sorted(f.name for f in out.iterdir())
    print(f"wrote {out} (step {trainer.step_count}): {', '.join(files)}")
    return 0


__all__ = ["apply_settings_file", "register", "register_export", "run_export", "run_train"]
