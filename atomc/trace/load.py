"""Load a user's model file by path and check it keeps the model-file contract.

The contract (README, "Model files"):
    build_model(config: str | None, **options) -> nn.Module
    example_inputs(model, batch_size: int, **options) -> tuple of tensors
    loss_fn(outputs, batch) -> scalar tensor          (optional; needed for training)
    LEAF_MODULES = (MyBlock, ...)                     (optional; traced as single operators)
Options (such as seq_len) are passed only to functions whose signature names them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from atomc.errors import ModelFileError

REQUIRED = ("build_model", "example_inputs")


def load_model_file(path: str | Path) -> ModuleType:
    """Import the file at `path` as a fresh module (not cached in sys.modules under its name)."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file {p} does not exist; give the path of a .py file "
                             f"that defines build_model() and example_inputs()")
    if p.is_dir() or p.suffix != ".py":
        raise ModelFileError(f"model file {p} is not a .py file; give a Python file that "
                             f"defines build_model() and example_inputs()")
    digest = hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:12]
    name = f"atomc_model_{p.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered so that dataclasses, pickling and inspect.getsource work on its contents.
    sys.modules[name] = module
    # Python puts a script's directory on sys.path, and model files rely on it to import the
    # model.py they wrap (`from model import GPT`); it stays there for imports made later, in
    # build_model() or in the copies of the file's helpers.
    folder = str(p.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        # compiled from its source every time, never from cached bytecode: Python trusts a
        # cache whose source has the same size and modification second, and a model file
        # edited within the second it was last loaded (one number changed) would run as before
        exec(compile(p.read_bytes(), str(p), "exec", dont_inherit=True), module.__dict__)
    except SyntaxError as e:
        del sys.modules[name]
        raise ModelFileError(f"{p}:{e.lineno}: syntax error: {e.msg}; fix the file and run "
                             f"again") from None
    except Exception as e:
        del sys.modules[name]
        where = _user_frame(e, p)
        raise ModelFileError(f"{p}{where}: importing the model file raised "
                             f"{type(e).__name__}: {e}") from e
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise ModelFileError(
            f"{p} does not define {' and '.join(f + '()' for f in missing)}; a model file must "
            f"define build_model(config) -> nn.Module and example_inputs(model, batch_size) -> "
            f"tuple (see the README's model-file contract)"
        )
    return module


def call_with_options(fn: Callable[..., Any], args: tuple, options: dict[str, Any],
                      path: Path) -> Any:
    """Call a contract function, passing only the options its signature accepts."""
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if k not in params and not takes_kwargs]
    if unknown:
        raise ModelFileError(
            f"{path}: {fn.__name__}() takes no option {', '.join(map(repr, unknown))}; "
            f"add the parameter to {fn.__name__}() or drop the command-line flag"
        )
    try:
        return fn(*args, **options)
    except Exception as e:
        where = _user_frame(e, path)
        raise ModelFileError(f"{path}{where}: {fn.__name__}() raised {type(e).__name__}: "
                             f"{e}") from e


def _user_frame(exc: BaseException, path: Path) -> str:
    """':LINE' of the deepest frame inside the user's file, if any."""
    line = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = f":{frame.lineno}"
    return line
