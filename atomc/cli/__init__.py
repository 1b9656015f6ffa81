"""`atomc` command line: one subcommand per stage, each reading the previous stage's JSON.

Each module of this package adds the subcommands of one stage or two (a `register(subparsers)`
function that sets `func`). User errors (AtomcError) print one line and exit 2; `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from atomc import __version__
from atomc.errors import AtomcError

# The modules that add subcommands, in the order `atomc --help` lists them, with the commands
# each adds. Imported by name so that a command imports its own module only: `atomc partition`
# and `atomc show` run without torch, and the modules whose commands need torch import it when
# the command runs, not when `atomc --help` builds every parser.
COMMANDS = {
    "atomc.cli.profile": ("profile", "profiles"),
    "atomc.cli.partition": ("partition", "show"),
    "atomc.cli.codegen": ("codegen",),
    "atomc.cli.train": ("train", "export"),
    "atomc.cli.calibrate": ("calibrate",),
    "atomc.cli.place": ("network", "place"),
    "atomc.cli.launch": ("launch", "peer"),
    "atomc.cli.swarm": ("swarm",),
    "atomc.cli.compare": ("compare",),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone where one module adds it."""
    parser = argparse.ArgumentParser(
        prog="atomc",
        description="Compile PyTorch models into swappable sub-models and train them beyond GPU "
                    "memory.",
    )
    parser.add_argument("--version", action="version", version=f"atomc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    known = any(command in names for names in COMMANDS.values())
    for name, names in COMMANDS.items():
        if not known or command in names:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Swapped sub-models and their activations come in many sizes: without expandable segments
    # the CUDA caching allocator fragments, and a plan that fits its budget (measured on an
    # H100: 2.96 GiB allocated under a 4 GiB cap) ran out with 0.66 GiB reserved but unused.
    # Read when CUDA first allocates, so set before any command touches the GPU.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except AtomcError as e:
        if args.debug:
            raise
        print(f"atomc {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"atomc {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `atomc ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    return int(result or 0)

