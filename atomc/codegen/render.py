"""Codegen, step 2: render each split piece as a readable `nn.Module` with Jinja2 templates.

Input: the pieces of `split.split_plan` and the TracedModel. Output: Python source text per
sub-model, the package `__init__.py`, and the list of the model file's helpers (functions and
classes the graph calls) that `check.copy_helpers` brings into the package.

The constructor rebuilds each leaf module with the hyperparameters read off the traced
instance (`nn.Linear(32, 96)`), verified by building it again on the meta device and comparing
its parameters, buffers and `extra_repr`. `forward` is straight-line code, one statement per
graph node, with the traced shape as a comment.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.resources
import inspect
import math
import operator
import pprint
import site
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from atomc import __version__
from atomc.codegen import reparam
from atomc.codegen.split import Piece
from atomc.dtypes import dtype_name
from atomc.errors import CodegenError
from atomc.ir import OpGraph, Plan
from atomc.profile.ops import is_inplace, written_in_place
from atomc.trace import TracedModel, dtype_args, grad_values, model_dtype
from atomc.trace.dynamic import autograd_function_of
from atomc.trace.frontends import layer_class
from atomc.trace.normalise import MODES

# Names the generated modules bind at top level (or that read badly as locals).
_RESERVED = {"self", "torch", "nn", "F", "operator", "math", "device", "dtype", "constant", "l",
             "O", "I"}

_DROPOUT_OPS = {"aten.dropout.default", "aten.native_dropout.default",
                "aten.feature_dropout.default", "aten.alpha_dropout.default",
                "aten.feature_alpha_dropout.default"}

_VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default"}

_INFIX = dict(fx.graph.magic_methods)
_INFIX.pop("getitem")
_INFIX_OPERATORS = {getattr(operator, name): fmt for name, fmt in _INFIX.items()
                    if hasattr(operator, name)}

_SKIP_CTOR_PARAMS = {"device", "dtype"}


_F_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
               F.feature_alpha_dropout}
_SDPA = {"aten.scaled_dot_product_attention.default"}
_BATCH_NORMS = {"aten.batch_norm.default", "aten.native_batch_norm.default",
                "aten._native_batch_norm_legit.default"}


def _follow_training_mode(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Dropout as traced in training mode, made to follow `self.training` again.

    Tracing resolves `self.training` to a constant: `F.dropout(x, p, training=True)`, export's
    `aten.dropout(x, p, True)`, attention's `dropout_p=0.1` (from `p if self.training else
    0.0`). Dropout is a training-time operation; the generated code applies it in training
    mode only, as nn.Dropout does.
    """
    if fn in _F_DROPOUTS or str(fn) in _DROPOUT_OPS:
        return _replace_arg(args, kwargs, 2, "training" if fn in _F_DROPOUTS else "train",
                            lambda v: _Expr("self.training") if v is True else v)
    if fn is F.batch_norm or str(fn) in _BATCH_NORMS:
        # with running statistics, batch statistics in training and the running ones in
        # evaluation, as nn.BatchNorm decides; without them (track_running_stats=False), always
        # batch statistics
        running_mean = (args[1] if fn is F.batch_norm else args[3]) if len(args) > 3 else None
        if running_mean is None:
            return args, kwargs
        return _replace_arg(args, kwargs, 5, "training",
                            lambda v: _Expr("self.training") if v is True else v)
    if fn is F.scaled_dot_product_attention or str(fn) in _SDPA:
        return _replace_arg(args, kwargs, 4, "dropout_p",
                            lambda v: _Expr(f"{v!r} if self.training else 0.0")
                            if isinstance(v, float) and v > 0 else v)
    return args, kwargs


def _replace_arg(args: tuple, kwargs: dict, index: int, name: str, change) -> tuple[tuple, dict]:
    if len(args) > index:
        return (*args[:index], change(args[index]), *args[index + 1:]), kwargs
    if name in kwargs:
        return args, {**kwargs, name: change(kwargs[name])}
    return args, kwargs


class _Expr:
    """Source text to paste as is (a local name, `self.training`, `device`)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


# ---------------------------------------------------------------------------------------------
# Where functions and classes come from


@cache
def _site_roots() -> tuple[Path, ...]:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(Path(path).resolve())
    try:
        roots.update(Path(p).resolve() for p in site.getsitepackages())
        roots.add(Path(site.getusersitepackages()).resolve())
    except AttributeError:  # virtualenvs with an old site module
        pass
    return tuple(sorted(roots))


@cache
def _distributed_packages() -> frozenset[str]:
    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - broken metadata of some unrelated distribution
        return frozenset()


def is_installed(module_name: str) -> bool:
    """True when a fresh interpreter elsewhere can import `module_name`: stdlib or installed."""
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) if module is not None else None
    if file is not None:
        path = Path(file).resolve()
        if any(path.is_relative_to(root) for root in _site_roots()):
            return True
    return top in _distributed_packages()


def _resolve(path: str) -> Any:
    """The object a dotted path names, importing the longest module prefix."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001 - not a module (or one that fails to import)
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


class Resolver:
    """Turns callables and classes into source expressions, and records needed helpers."""

    def __init__(self, traced: TracedModel):
        self.model_module: ModuleType = traced.module
        self.model_path = Path(getattr(traced.module, "__file__", "") or traced.graph.model_path)
        self.helpers: dict[str, Any] = {}  # name in the model file -> object
        self.helper_users: dict[str, str] = {}  # name -> what needed it (for error messages)

    def _describe(self, obj: Any) -> str:
        try:
            line = inspect.getsourcelines(obj)[1]
            return f"{getattr(obj, '__qualname__', obj)!s} ({self.model_path.name}:{line})"
        except (OSError, TypeError):
            return str(getattr(obj, "__qualname__", obj))

    def helper(self, obj: Any, why: str) -> str:
        """Name of a model-file function or class, to be copied into `_helpers.py`."""
        name = getattr(obj, "__name__", None)
        qualname = getattr(obj, "__qualname__", name) or ""
        if isinstance(obj, type(lambda: 0)) and name == "<lambda>":
            raise CodegenError(f"{why} calls a lambda ({self._describe(obj)}); atomc can only copy "
                               f"functions defined with def at the top level of "
                               f"{self.model_path.name}: give it a name with def")
        if "<locals>" in qualname:
            raise CodegenError(
                f"{why} uses {qualname}, which is defined inside another function (a closure over "
                f"its local state); atomc can only copy top-level functions and classes of "
                f"{self.model_path.name} into the generated package: move it to the top level")
        if name is None or getattr(self.model_module, name, None) is not obj or qualname != name:
            raise CodegenError(
                f"{why} uses {obj!r}, which is not a top-level function or class of "
                f"{self.model_path.name} under its own name; atomc cannot copy it into the "
                f"generated package: define it at the top level of the model file with def or "
                f"class")
        self.helpers[name] = obj
        self.helper_users.setdefault(name, why)
        return name

    def function(self, fn: Any, imports: set[str], why: str) -> str:
        if isinstance(fn, torch._ops.OpOverload):
            imports.add("import torch")
            return f"torch.ops.{fn}"
        if isinstance(fn, torch._ops.OpOverloadPacket):
            imports.add("import torch")
            return f"torch.ops.{fn}"
        if isinstance(fn, torch._ops.HigherOrderOperator):
            raise CodegenError(f"{why} calls the higher-order operator {fn}; atomc cannot "
                               f"generate code for it: avoid torch.cond/torch.no_grad regions "
                               f"inside forward")
        function = autograd_function_of(fn)
        if function is not None:  # a custom autograd.Function, kept whole by the tracer
            return f"{self.cls(function, imports, why)}.apply"
        name = getattr(fn, "__name__", None)
        module = getattr(fn, "__module__", None)
        if module == self.model_module.__name__ or name == "<lambda>":
            return self.helper(fn, why)
        if name is not None:
            if getattr(F, name, None) is fn:
                imports.add("import torch.nn.functional as F")
                return f"F.{name}"
            if getattr(torch, name, None) is fn:
                imports.add("import torch")
                return f"torch.{name}"
            if getattr(builtins, name, None) is fn:
                return name
            if getattr(operator, name, None) is fn:
                imports.add("import operator")
                return f"operator.{name}"
            if getattr(math, name, None) is fn:
                imports.add("import math")
                return f"math.{name}"
        if "<locals>" in (getattr(fn, "__qualname__", "") or ""):
            return self.helper(fn, why)
        try:
            path = fx.node._get_qualified_name(fn)
        except (RuntimeError, AttributeError, TypeError):
            path = None
        if path is None or not _resolves_to(path, fn):
            raise CodegenError(
                f"{why} calls {fn!r}, which atomc cannot name from the generated package "
                f"(no importable module path); define it at the top level of the model file")
        top = path.split(".")[0]
        if top == "torch":
            imports.add("import torch")
            return path
        mod_path = module if module and path.startswith(module + ".") else path.rpartition(".")[0]
        if mod_path in sys.modules and sys.modules[mod_path] is self.model_module:
            return self.helper(fn, why)
        if not is_installed(mod_path):
            where = getattr(sys.modules.get(mod_path), "__file__", "?")
            raise CodegenError(
                f"{why} calls {path}, defined in module {mod_path} ({where}), which is neither the "
                f"model file nor an installed package, so the generated package could not import "
                f"it on another machine; move the function into the model file or install its "
                f"module")
        imports.add(f"import {mod_path}")
        return path

    def cls(self, klass: type, imports: set[str], why: str) -> str:
        name = klass.__name__
        if getattr(nn, name, None) is klass:
            imports.add("from torch import nn")
            return f"nn.{name}"
        if klass.__module__ == self.model_module.__name__:
            return self.helper(klass, why)
        if "<locals>" in klass.__qualname__:
            raise CodegenError(f"{why} uses class {klass.__qualname__}, which is defined inside a "
                               f"function; move it to the top level of the model file")
        module = klass.__module__
        if not is_installed(module):
            raise CodegenError(
                f"{why} uses class {module}.{klass.__qualname__}, defined in "
                f"{getattr(sys.modules.get(module), '__file__', '?')}, which is neither the model "
                f"file nor an installed package; move the class into the model file or install it")
        path = f"{module}.{klass.__qualname__}"
        if not _resolves_to(path, klass):
            raise CodegenError(f"{why} uses class {path}, which cannot be imported under that name")
        if module.split(".")[0] == "torch":
            imports.add("import torch")
        else:
            imports.add(f"import {module}")
        return path


def _resolves_to(path: str, obj: Any) -> bool:
    try:
        return _resolve(path) is obj
    except (ImportError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Constants


def render_constant(value: Any, resolver: Resolver, imports: set[str], why: str,
                    device_type: str | None = None) -> str:
    """Python source for a constant argument; CodegenError for what cannot be written down."""
    def r(v: Any) -> str:
        return render_constant(v, resolver, imports, why, device_type)

    if isinstance(value, _Expr):
        return value.text
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    if isinstance(value, complex):
        return repr(value)
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.dtype):
        imports.add("import torch")
        return f"torch.{dtype_name(value)}"
    if isinstance(value, torch.device):
        if device_type is not None and value.type == device_type:
            return "device"  # traced on this device: run on whatever device the inputs are on
        imports.add("import torch")
        return f"torch.device({str(value)!r})"
    if isinstance(value, (torch.memory_format, torch.layout)):
        imports.add("import torch")
        return str(value)
    if isinstance(value, torch.Size):
        imports.add("import torch")
        return f"torch.Size({r(list(value))})"
    if isinstance(value, slice):
        return f"slice({r(value.start)}, {r(value.stop)}, {r(value.step)})"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [r(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(r(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{r(k)}: {r(v)}" for k, v in value.items()) + "}"
    if isinstance(value, enum.Enum):
        return f"{resolver.cls(type(value), imports, why)}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        ctor = resolver.cls(type(value), imports, why)
        fields = [f for f in dataclasses.fields(value) if f.init]
        args = ", ".join(f"{f.name}={r(getattr(value, f.name))}" for f in fields)
        return f"{ctor}({args})"
    if isinstance(value, torch.Tensor):
        raise CodegenError(f"{why} has a tensor constant of shape {list(value.shape)}; atomc "
                           f"cannot write tensor values into code: register it as a buffer in the "
                           f"model")
    raise CodegenError(f"{why} has a constant {value!r} of type {type(value).__name__}, which "
                       f"atomc cannot write as code; pass it as a plain number, string or tuple")


def describe_value(value: Any) -> str:
    """Shape comment: `[2, 16, 32] float32`, `int 16`, `3 x [2, 16, 32] float32`."""
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {dtype_name(value.dtype)}"
    if isinstance(value, torch.Size):
        return f"size {tuple(value)}"
    if isinstance(value, bool):
        return f"bool {value}"
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} {value}"
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, (tuple, list)):
        parts = [describe_value(v) for v in value]
        if parts and len(set(parts)) == 1:
            return f"{len(parts)} x {parts[0]}"
        return "(" + ", ".join(parts) + ")"
    if value is None:
        return "None"
    return type(value).__name__


def boundary_spec(value: Any, grad: bool = False) -> dict[str, Any]:
    """A boundary value's entry in BOUNDARIES; `grad`: whether it requires gradients when the
    model trains (atomc.trace.grad_values), so a runtime's leaf for it takes one."""
    if isinstance(value, torch.Tensor):
        return {"shape": [int(d) for d in value.shape], "dtype": dtype_name(value.dtype),
                "grad": bool(grad)}
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "int"}
    return {"kind": "other"}


def py_literal(value: Any, indent: int = 0, width: int = 100) -> str:
    """Deterministic Python literal (pprint), continuation lines indented by `indent`."""
    text = pprint.pformat(value, width=max(40, width - indent), sort_dicts=False)
    return text.replace("\n", "\n" + " " * indent)


# ---------------------------------------------------------------------------------------------
# Leaf modules


def _simple_attrs(module: nn.Module) -> dict[str, Any]:
    kinds = (int, float, bool, str, tuple, type(None))
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and isinstance(v, kinds)}


def _same_module(a: nn.Module, b: nn.Module) -> str:
    """'' when `b` rebuilds `a` (same parameters, buffers, hyperparameters); else the difference."""
    if layer_class(a) is not layer_class(b):
        return f"class {type(b).__name__} instead of {type(a).__name__}"
    if a.extra_repr() != b.extra_repr():
        return f"{b.extra_repr()!r} instead of {a.extra_repr()!r}"
    sa = {k: tuple(v.shape) for k, v in a.state_dict(keep_vars=True).items()}
    sb = {k: tuple(v.shape) for k, v in b.state_dict(keep_vars=True).items()}
    if sa != sb:
        return f"state {sb} instead of {sa}"
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return f"parameters {sorted(pb)} instead of {sorted(pa)}"
    attrs_a, attrs_b = _simple_attrs(a), _simple_attrs(b)
    for key, value in attrs_a.items():
        if key in attrs_b and attrs_b[key] != value:
            return f"{key}={attrs_b[key]!r} instead of {value!r}"
    return ""


def _signature_args(module: nn.Module) -> tuple[list[Any], dict[str, Any]] | None:
    """Constructor arguments read back from same-named attributes, defaults left out."""
    try:
        sig = inspect.signature(type(module).__init__)
    except (TypeError, ValueError):
        return None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return None
        if name in _SKIP_CTOR_PARAMS:
            positional = False
            continue
        if not hasattr(module, name):
            if p.default is p.empty:
                return None
            positional = False
            continue
        value = getattr(module, name)
        if isinstance(value, torch.Tensor) or (value is None and isinstance(p.default, bool)):
            value = value is not None  # `bias=True` stored as a Parameter (or None)
        if isinstance(value, nn.Module) or (callable(value) and not isinstance(value, type)):
            return None
        if p.default is not p.empty:
            positional = False
            try:
                if type(value) is type(p.default) and value == p.default:
                    continue
            except Exception:  # noqa: BLE001 - a value whose == fails is kept explicit
                pass
        if positional and p.kind is not p.KEYWORD_ONLY:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _repr_args(module: nn.Module) -> tuple[list[Any], dict[str, Any]] | None:
    """Constructor arguments parsed from `extra_repr()`, which torch writes in call syntax."""
    text = module.extra_repr()

    def collect(*a: Any, **k: Any) -> tuple[list[Any], dict[str, Any]]:
        return list(a), k

    try:
        return eval(f"_collect({text})", {"_collect": collect, "torch": torch, "inf": math.inf,
                                          "nan": math.nan, "__builtins__": {}})
    except Exception:  # noqa: BLE001 - extra_repr is free text; this candidate just fails
        return None


def module_constructor(module: nn.Module, fqn: str, resolver: Resolver, imports: set[str]) -> str:
    """`nn.Linear(32, 96)`: source that rebuilds `module`, checked by rebuilding it on meta."""
    klass = layer_class(module)
    why = f"module {fqn} ({klass.__name__})"
    failures = []
    for args_kwargs in (_signature_args(module), _repr_args(module)):
        if args_kwargs is None:
            continue
        args, kwargs = args_kwargs
        try:
            with torch.device("meta"):
                rebuilt = reparam.rewrap(module, klass(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the user's constructor may raise anything
            failures.append(f"{type(e).__name__}: {e}")
            continue
        difference = _same_module(module, rebuilt)
        if difference:
            failures.append(difference)
            continue
        ctor = resolver.cls(klass, imports, why)
        parts = [render_constant(a, resolver, imports, why) for a in args]
        parts += [f"{k}={render_constant(v, resolver, imports, why)}" for k, v in kwargs.items()]
        text = f"{ctor}({', '.join(parts)})"
        dtypes = {t.dtype for t in list(module.parameters()) + list(module.buffers())
                  if t.is_floating_point()}
        if len(dtypes) == 1 and (dtype := dtypes.pop()) != torch.get_default_dtype():
            imports.add("import torch")
            text += f".to(torch.{dtype_name(dtype)})"
        return reparam.wrapped_source(module, text, imports, lambda v: (
            module_constructor(v, f"{fqn}'s parametrization", resolver, imports)
            if isinstance(v, nn.Module) else render_constant(v, resolver, imports, why)))
    detail = f" ({'; '.join(failures)})" if failures else ""
    raise CodegenError(
        f"cannot rebuild {why} from its attributes{detail}: atomc rebuilds leaf modules by reading "
        f"each constructor argument back from the attribute of the same name; store every "
        f"constructor argument of {klass.__name__} as self.<name>, or do not make it a leaf module")


# ---------------------------------------------------------------------------------------------
# Sub-models


class Namer:
    """Local variable names: the fx node names, renamed where they clash with module names."""

    def __init__(self, reserved: set[str], graph_names: set[str]):
        self.reserved = set(reserved)
        self.graph_names = set(graph_names)  # every node name of the model: never reused
        self.names: dict[str, str] = {}

    def __call__(self, node_name: str) -> str:
        if node_name not in self.names:
            name = node_name
            n = 1
            while name in self.reserved or (name != node_name and name in self.graph_names):
                name = f"{node_name}_{n}"
                n += 1
            self.names[node_name] = name
        return self.names[node_name]


@dataclass
class SubmodelSource:
    index: int
    class_name: str
    module_name: str  # submodel_0
    text: str
    param_names: dict[str, str]  # local -> canonical FQN (parameters and persistent buffers)
    param_locals: list[str]  # which of param_names are parameters
    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]
    constants: dict[str, torch.Tensor]  # FQN -> traced value of the constants it holds


def _environment() -> jinja2.Environment:
    root = importlib.resources.files("atomc.templates")
    loader = jinja2.FunctionLoader(lambda name: (root / name).read_text(encoding="utf-8"))
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, autoescape=False,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


_UNREACHED = "  # reaches no output: no gradient, as in the model"


def params_without_gradient(traced: TracedModel) -> frozenset[str]:
    """FQNs of the parameters from which no path of the graph reaches its output (code whose
    result nothing uses: CANINE's character-level head in a sequence classifier). The model's
    own backward leaves their .grad None, so torch's optimizers skip them, weight decay
    included; the sub-models hold them with requires_grad=False, which the runtime's optimizer
    skips alike (a gradient of zeros would decay them)."""
    gm = traced.gm
    cached = gm.meta.get("atomc_unreached")
    if cached is not None:
        return cached
    canon: dict[int, str] = {}
    for fqn, p in traced.model.named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), fqn)
    # what the output depends on, and every write (an in-place op or item assignment whose
    # result is unused writes a value that is: `h[:, 0] = self.cls_token`, `h.add_(bias)`)
    live: set[fx.Node] = set()
    # (fx's `is_impure` would also count a dead dropout, whose random draw writes nothing)
    todo = [n for n in gm.graph.nodes
            if n.op == "output" or is_inplace(n) or n.target is operator.setitem]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    modules = dict(gm.named_modules())
    reached: set[str] = set()
    for n in live:
        if n.op == "get_attr":
            reached.add(canon.get(id(operator.attrgetter(str(n.target))(gm)), ""))
        elif n.op == "call_module":
            reached.update(canon.get(id(p), "") for _, p in
                           modules[str(n.target)].named_parameters(remove_duplicate=False))
    found = frozenset(f for f in canon.values() if f not in reached)
    gm.meta["atomc_unreached"] = found
    return found


class PieceRenderer:
    def __init__(self, piece: Piece, traced: TracedModel, plan: Plan, resolver: Resolver,
                 helper_names: set[str], dtype_args: dict[str, tuple[tuple, ...]]):
        self.piece = piece
        self.traced = traced
        self.plan = plan
        self.resolver = resolver
        self.imports: set[str] = {"import torch", "from torch import nn"}
        self.values = traced.values
        self.device_type = traced.device.type
        self.namer = Namer(_RESERVED | helper_names, {n.name for n in traced.gm.graph.nodes})
        self.canon_params: dict[int, str] = {}
        self.canon_buffers: dict[int, str] = {}
        for fqn, p in traced.model.named_parameters(remove_duplicate=False):
            self.canon_params.setdefault(id(p), fqn)
        for fqn, b in traced.model.named_buffers(remove_duplicate=False):
            self.canon_buffers.setdefault(id(b), fqn)
        self.uses_device = False
        self.uses_dtype = False
        self.dtype_args = dtype_args  # node name -> argument paths that follow the model's dtype
        self.unreached = params_without_gradient(traced)
        self.constants: dict[str, torch.Tensor] = {}  # FQN -> traced value of each constant held
        self.why = f"sub-model {piece.index}"
        self.attr_expr: dict[str, str] = {}  # get_attr target -> `self.…`

    # -- constructor --------------------------------------------------------------------------

    def constructor(self) -> tuple[list[str], dict[str, str], list[str]]:
        lines: list[str] = []
        owner: dict[str, str] = {}  # canonical FQN -> local path holding it
        order: list[tuple[str, str, bool]] = []  # (local path, FQN, is parameter) for PARAM_NAMES
        module_nodes = [n for n in self.piece.graph.nodes if n.op == "call_module"]
        local_modules = list(dict.fromkeys(str(n.target) for n in module_nodes))
        standalone = [self.piece.attrs[str(n.target)] for n in self.piece.graph.nodes
                      if n.op == "get_attr"]
        standalone = list({a.local: a for a in standalone}.values())

        module_lines: list[str] = []
        tie_lines: list[str] = []
        frozen: list[str] = []
        module_params: list[tuple[str, str, bool]] = []
        for local in local_modules:
            fqn, module = self.piece.modules[local]
            ctor = module_constructor(module, fqn, self.resolver, self.imports)
            note = f"  # {fqn}" if fqn.replace(".", "_") != local or "." in fqn else ""
            module_lines.append(f"self.{local} = {ctor}{note}")
            non_persistent = {f"{prefix}.{name}".lstrip(".")
                              for prefix, m in module.named_modules()
                              for name in getattr(m, "_non_persistent_buffers_set", ())}
            for name, p in module.named_parameters(remove_duplicate=False):
                self._hold(owner, f"{local}.{name}", self.canon_params[id(p)], True, tie_lines,
                           module_params)
                if not p.requires_grad:
                    frozen.append(f"self.{local}.{name}.requires_grad_(False)")
                elif self.canon_params[id(p)] in self.unreached:
                    frozen.append(f"self.{local}.{name}.requires_grad_(False){_UNREACHED}")
            for name, b in module.named_buffers(remove_duplicate=False):
                if name in non_persistent or id(b) not in self.canon_buffers:
                    continue
                self._hold(owner, f"{local}.{name}", self.canon_buffers[id(b)], False, tie_lines,
                           module_params)

        attr_lines: list[str] = []
        own_params: list[tuple[str, str, bool]] = []
        for attr in standalone:
            if attr.fqn in owner:
                self.attr_expr[attr.local] = f"self.{owner[attr.fqn]}"
                continue
            self.attr_expr[attr.local] = f"self.{attr.local}"
            owner[attr.fqn] = attr.local
            note = f"  # {attr.fqn}" if attr.fqn != attr.local else ""
            if not attr.persistent:  # a constant: its value ships with the package
                self.constants[attr.fqn] = attr.value
                self.imports.add("from ._constants import constant")
                attr_lines.append(f"self.register_buffer({attr.local!r}, constant({attr.fqn!r}), "
                                  f"persistent=False)")
                continue
            shape = ", ".join(str(int(d)) for d in attr.value.shape) or "()"
            dtype = attr.value.dtype
            dtype_arg = ("" if dtype == torch.get_default_dtype()
                         else f", dtype=torch.{dtype_name(dtype)}")
            empty = f"torch.empty({shape}{dtype_arg})"
            if attr.is_buffer:
                attr_lines.append(f"self.register_buffer({attr.local!r}, {empty}){note}")
            else:
                unreached = attr.fqn in self.unreached and attr.value.requires_grad
                grad = "" if attr.value.requires_grad and not unreached else ", requires_grad=False"
                note = _UNREACHED if unreached else note
                attr_lines.append(f"self.{attr.local} = nn.Parameter({empty}{grad}){note}")
            own_params.append((attr.local, attr.fqn, not attr.is_buffer))
        # nn.Module lists its own attributes before its children's
        order = own_params + module_params
        lines = attr_lines + module_lines + tie_lines + frozen
        param_names = {local: fqn for local, fqn, _ in order}
        param_locals = [local for local, _, is_param in order if is_param]
        return lines, param_names, param_locals

    @staticmethod
    def _hold(owner: dict[str, str], path: str, fqn: str, is_param: bool, ties: list[str],
              order: list[tuple[str, str, bool]]) -> None:
        if fqn in owner:
            if owner[fqn].split(".")[0] != path.split(".")[0]:  # the module ties its own
                ties.append(f"self.{path} = self.{owner[fqn]}  # tied: one {fqn}")
            return
        owner[fqn] = path
        order.append((path, fqn, is_param))

    # -- forward ------------------------------------------------------------------------------

    def arg(self, value: Any) -> str:
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                return self.attr_expr[str(value.target)]
            return self.namer(value.name)
        if isinstance(value, (tuple, list)) and any(isinstance(v, fx.Node) for v in _flat(value)):
            items = [self.arg(v) for v in value]
            if isinstance(value, list):
                return "[" + ", ".join(items) + "]"
            return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
        if isinstance(value, dict) and any(isinstance(v, fx.Node) for v in _flat(value)):
            return "{" + ", ".join(f"{self.arg(k)}: {self.arg(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice) and any(isinstance(v, fx.Node) for v in _flat(value)):
            return f"slice({self.arg(value.start)}, {self.arg(value.stop)}, {self.arg(value.step)})"
        text = render_constant(value, self.resolver, self.imports, self.why,
                               device_type=self.device_type)
        if text == "device":
            self.uses_device = True
        return text

    def operand(self, value: Any) -> str:
        text = self.arg(value)
        if isinstance(value, fx.Node) or text.isidentifier() or text.replace(".", "").isalnum():
            return text
        return f"({text})"

    def index(self, value: Any) -> str:
        if isinstance(value, slice):
            parts = ["" if v is None else self.arg(v)
                     for v in (value.start, value.stop, value.step)]
            text = f"{parts[0]}:{parts[1]}"
            return text + (f":{parts[2]}" if parts[2] else "")
        if isinstance(value, tuple) and value:
            items = [self.index(v) for v in value]
            return ", ".join(items) + ("," if len(items) == 1 else "")
        if value is None:
            return "None"
        return self.arg(value)

    def call_args(self, args: tuple, kwargs: dict) -> str:
        parts = [self.arg(a) for a in args] + [f"{k}={self.arg(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def expression(self, node: fx.Node) -> str:
        self.why = f"node {node.name} of sub-model {self.piece.index}"
        if node.op == "call_module":
            return f"self.{node.target}({self.call_args(node.args, node.kwargs)})"
        if node.op == "call_method":
            args, kwargs = self._dtype_limits(tuple(node.args), dict(node.kwargs))
            obj = self.operand(args[0])
            return f"{obj}.{node.target}({self.call_args(args[1:], kwargs)})"
        if node.op != "call_function":
            raise AssertionError(node.op)
        fn = node.target
        args, kwargs = self._dtype_limits(*self._generic_dtypes(node))
        if fn is operator.getitem and not kwargs:
            return f"{self.operand(args[0])}[{self.index(args[1])}]"
        if fn is builtins.getattr and len(args) == 2 and isinstance(args[1], str) \
                and args[1].isidentifier() and not kwargs:
            return f"{self.operand(args[0])}.{args[1]}"
        if fn in _INFIX_OPERATORS and not kwargs:
            return _INFIX_OPERATORS[fn].format(*(self.operand(a) for a in args))
        if str(fn) in _VIEW_OPS:
            # export records a view wherever the tracing device's strides allowed one (it drops
            # `.contiguous()` when it was a no-op there); reshape is that view where the running
            # device's strides allow it too, and a copy where they do not
            fn = torch.ops.aten.reshape.default
        args, kwargs = _follow_training_mode(fn, args, kwargs)
        callee = self.resolver.function(fn, self.imports, self.why)
        return f"{callee}({self.call_args(args, kwargs)})"

    def _dtype_limits(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Scalars that are the traced dtype's extremes, as that dtype's extremes at run time.

        Attention masks fill with `torch.finfo(scores.dtype).min`; the trace recorded float32's
        (-3.4e38), which overflows bfloat16 when the sub-model runs under autocast. A scalar
        equal to the largest or most negative value of the first tensor argument's traced dtype
        (or of a dtype argument that follows the model's) becomes `torch.finfo(x.dtype).min`.
        """
        first = next((a for a in args if isinstance(a, fx.Node)
                      and isinstance(self.values.get(a.name), torch.Tensor)), None)
        if first is not None:
            dtype, source = self.values[first.name].dtype, f"{self.operand(first)}.dtype"
        elif isinstance(kwargs.get("dtype"), _Expr):
            dtype, source = model_dtype(self.traced.model), str(kwargs["dtype"])
        else:
            return args, kwargs
        if not dtype.is_floating_point:
            return args, kwargs
        info = torch.finfo(dtype)
        names = {info.min: "min", info.max: "max"}

        def limit(a: Any) -> Any:
            if type(a) is float and a in names:
                return _Expr(f"torch.finfo({source}).{names[a]}")
            return a

        return tuple(limit(a) for a in args), {k: limit(v) for k, v in kwargs.items()}

    def _generic_dtypes(self, node: fx.Node) -> tuple[tuple, dict]:
        """The node's arguments, with the dtypes that follow the model's dtype as `dtype`."""
        args, kwargs = tuple(node.args), dict(node.kwargs)
        paths = self.dtype_args.get(node.name, ())
        if not paths:
            return args, kwargs
        self.uses_dtype = True

        def put(value: Any, rest: tuple) -> Any:
            if not rest:
                return _Expr("dtype")
            head, *tail = rest
            if isinstance(value, dict):
                return {**value, head: put(value[head], tuple(tail))}
            items = list(value)
            items[head] = put(items[head], tuple(tail))
            return type(value)(items) if isinstance(value, tuple) else items

        for where, *rest in paths:
            if where == "args":
                args = put(args, tuple(rest))
            else:
                kwargs = put(kwargs, tuple(rest))
        return args, kwargs

    def statement(self, node: fx.Node) -> str:
        if node.op == "call_function" and node.target is operator.setitem and not node.users:
            target, idx, value = node.args
            return f"{self.operand(target)}[{self.index(idx)}] = {self.arg(value)}"
        expr = self.expression(node)
        comment = describe_value(self.values.get(node.name))
        if not node.users:
            return f"{expr}  # {comment}"
        return f"{self.namer(node.name)} = {expr}  # {comment}"

    def forward(self, op_nodes: dict[str, Any]) -> tuple[list[str], list[str]]:
        graph = self.piece.graph
        params = [self.namer(n.name) for n in graph.nodes if n.op == "placeholder"]
        body: list[str] = []
        for name in self.piece.inputs:
            body.append(f"# {name}: {describe_value(self.values.get(name))}")
        for node in graph.nodes:
            if node.op == "placeholder" and written_in_place(node):
                # the caller's tensor may be a leaf that takes gradients (the swap runtime's
                # inputs are), or be needed again (recomputation): write a copy
                name = self.namer(node.name)
                body.append(f"{name} = {name}.clone()  # written in place below")
        block = None
        code: list[str] = []
        open_modes: tuple = ()  # the `with` blocks the current statement is inside
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            modes = tuple(node.meta.get(MODES, ())) if node.op != "output" else ()
            keep = 0
            while keep < min(len(modes), len(open_modes)) and modes[keep] == open_modes[keep]:
                keep += 1
            open_modes = open_modes[:keep]
            if node.op == "output":
                code.append(self._return(node))
                continue
            op = op_nodes.get(node.name)
            node_block = op.block if op is not None else ""
            if node_block != block and node_block:
                code.append("")
                code.append(f"{'    ' * len(open_modes)}# {node_block}")
            block = node_block
            for mode in modes[keep:]:
                code.append(f"{'    ' * len(open_modes)}with {self._mode(mode)}:")
                open_modes += (mode,)
            indent = "    " * len(open_modes)
            if self._training_only(node):
                code.append(f"{indent}if self.training:")
                indent += "    "
            code.append(f"{indent}{self.statement(node)}")
        if self.uses_device:
            body.append(f"device = {self._device_source()}  # where this sub-model runs")
        if self.uses_dtype:
            body.append(f"dtype = {self._dtype_source()}  # {self._dtype_note()}")
        return params, body + code

    def _training_only(self, node: fx.Node) -> bool:
        """An in-place update of a BatchNorm's buffer (`num_batches_tracked += 1`): BatchNorm
        makes it in training only, and tracing in training mode left out its `if`."""
        if not (is_inplace(node) and node.args and isinstance(node.args[0], fx.Node)):
            return False
        target = node.args[0]
        attr = self.piece.attrs.get(str(target.target)) if target.op == "get_attr" else None
        if attr is None or not attr.is_buffer:
            return False
        owner = attr.fqn.rpartition(".")[0]
        try:
            module = self.traced.model.get_submodule(owner)
        except AttributeError:
            return False
        return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats

    def _mode(self, mode: tuple) -> str:
        """`torch.no_grad()` or `torch.autocast(device.type, ...)`: a traced region's mode."""
        if mode[0] == "grad":
            return "torch.enable_grad()" if mode[1] else "torch.no_grad()"
        _, _, dtype, enabled, cache_enabled = mode
        # the traced device type (often meta, where autocast does not exist) is not where the
        # sub-model runs: a region's mode applies to whatever device it runs on
        self.uses_device = True
        parts = ["device.type"]
        if enabled and dtype is not None:
            parts.append(f"dtype=torch.{dtype_name(dtype)}")
        if not enabled:
            parts.append("enabled=False")
        if not cache_enabled:
            parts.append("cache_enabled=False")
        return f"torch.autocast({', '.join(parts)})"

    def _dtype_source(self) -> str:
        """The dtype of the sub-model's largest floating weight: the model's own dtype."""
        best, size = None, -1
        for attr in self.piece.attrs.values():
            v = attr.value
            if attr.persistent and v.is_floating_point() and v.numel() > size:
                best, size = self.attr_expr.get(attr.local, f"self.{attr.local}"), v.numel()
        for local, (_, module) in self.piece.modules.items():
            for name, p in module.named_parameters():
                if p.is_floating_point() and p.numel() > size:
                    best, size = f"self.{local}.{name}", p.numel()
        if best is not None:
            return f"{best}.dtype"
        for name in self.piece.inputs:
            v = self.values.get(name)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return f"{self.namer(name)}.dtype"
        return "torch.get_default_dtype()"

    def _dtype_note(self) -> str:
        traced = dtype_name(model_dtype(self.traced.model))
        return f"the weights' dtype, traced as {traced}"

    def _return(self, node: fx.Node) -> str:
        self.why = f"the output of sub-model {self.piece.index}"
        value = node.args[0]
        if self.piece.is_last:
            if self.piece.structure is not None:
                by_name = {n.name: n for n in self.piece.graph.nodes}
                return f"return {self._structure(self.piece.structure, by_name)}"
            return f"return {self.arg(value)}"
        items = [self.arg(v) for v in value]
        if len(items) == 1:
            return f"return ({items[0]},)"
        return "return (" + ", ".join(items) + ")"

    def _structure(self, value: Any, by_name: dict[str, fx.Node]) -> str:
        """The model's output container as code, its class kept: a ModelOutput, a namedtuple."""
        if isinstance(value, fx.Node):
            return self.arg(by_name[value.name])

        def r(v: Any) -> str:
            return self._structure(v, by_name)

        kind = type(value)
        if kind in _PLAIN or not isinstance(value, (tuple, list, dict)):
            if isinstance(value, tuple):
                items = [r(v) for v in value]
                return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
            if isinstance(value, list):
                return "[" + ", ".join(r(v) for v in value) + "]"
            if isinstance(value, dict):
                return "{" + ", ".join(f"{k!r}: {r(v)}" for k, v in value.items()) + "}"
            return self.arg(value)
        ctor = self.resolver.cls(kind, self.imports, self.why)
        if isinstance(value, dict):  # ModelOutput and other dict classes: keyword arguments
            if all(isinstance(k, str) and k.isidentifier() for k in value):
                return f"{ctor}(" + ", ".join(f"{k}={r(v)}" for k, v in value.items()) + ")"
            return f"{ctor}({{" + ", ".join(f"{k!r}: {r(v)}" for k, v in value.items()) + "})"
        if hasattr(kind, "_fields"):  # a namedtuple
            return f"{ctor}(" + ", ".join(r(v) for v in value) + ")"
        return f"{ctor}([" + ", ".join(r(v) for v in value) + "])"

    def _device_source(self) -> str:
        for name in self.piece.inputs:
            if isinstance(self.values.get(name), torch.Tensor):
                return f"{self.namer(name)}.device"
        if self.attr_expr:
            return f"{next(iter(self.attr_expr.values()))}.device"
        for local in self.piece.modules:
            return f"next(self.{local}.parameters()).device"
        return "torch.get_default_device()"


# Containers written as literals; fx keeps a graph's own tuples and dicts as its immutable kinds.
_PLAIN = (tuple, list, dict, immutable_dict, immutable_list)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    if isinstance(value, slice):
        return [value.start, value.stop, value.step]
    return [value]


def _summary(piece: Piece, graph: OpGraph) -> str:
    """What a sub-model computes: its blocks and top-level modules, partial ones marked."""
    nodes = graph.nodes
    totals: dict[str, int] = {}
    for op in nodes:
        key = op.block or op.module_fqn.split(".")[0]
        if key and op.op not in ("placeholder", "output", "get_attr"):
            totals[key] = totals.get(key, 0) + 1
    mine: dict[str, int] = {}
    for op in nodes[piece.start:piece.stop]:
        key = op.block or op.module_fqn.split(".")[0]
        if key and op.op not in ("placeholder", "output", "get_attr"):
            mine[key] = mine.get(key, 0) + 1
    parts = [k if mine[k] == totals[k] else f"{k} (part)" for k in mine]
    return ", ".join(parts) if parts else "no modules"


def render_submodel(piece: Piece, traced: TracedModel, plan: Plan, plan_hash: str,
                    resolver: Resolver, helper_names: set[str],
                    env: jinja2.Environment) -> SubmodelSource:
    renderer = PieceRenderer(piece, traced, plan, resolver, helper_names, dtype_args(traced))
    op_nodes = {op.name: op for op in traced.graph.nodes}
    init_lines, param_names, param_locals = renderer.constructor()
    params, forward_lines = renderer.forward(op_nodes)
    helpers = sorted(resolver.helpers)
    if helpers:
        renderer.imports.add(f"from ._helpers import {', '.join(helpers)}")
    num = len(plan.submodels)
    values = traced.values
    grads = grad_values(traced)
    inputs = {name: boundary_spec(values.get(name), grads.get(name, False))
              for name in piece.inputs}
    outputs = {name: boundary_spec(values.get(name), grads.get(name, False))
               for name in piece.outputs}
    text = env.get_template("submodel.py.jinja").render(
        index=piece.index,
        num_submodels=num,
        class_name=f"Submodel{piece.index}",
        model_path=plan.model_path,
        config=plan.config,
        batch_size=plan.batch_size,
        options=plan.options,
        plan_hash=plan_hash,
        graph_hash=plan.graph_hash,
        atomc_version=__version__,
        frontend=traced.graph.frontend,
        first_node=piece.start,
        last_node=piece.stop - 1,
        summary=_summary(piece, traced.graph),
        is_last=piece.is_last,
        imports="\n".join(sorted(renderer.imports)),
        inputs_literal=py_literal(tuple(piece.inputs), indent=4),
        outputs_literal=py_literal(tuple(piece.outputs), indent=4),
        init_lines=init_lines,
        params=params,
        forward_lines=forward_lines,
    )
    return SubmodelSource(piece.index, f"Submodel{piece.index}", f"submodel_{piece.index}", text,
                          param_names, param_locals, inputs, outputs, renderer.constants)


def render_package_init(subs: list[SubmodelSource], traced: TracedModel, plan: Plan, plan_hash: str,
                        env: jinja2.Environment) -> str:
    graph = traced.graph
    holders: dict[str, list[tuple[int, str]]] = {}
    for sub in subs:
        for local in sub.param_locals:
            holders.setdefault(sub.param_names[local], []).append((sub.index, local))
    tied = {fqn: h for fqn, h in holders.items() if len({i for i, _ in h}) > 1}
    covered = {fqn for sub in subs for fqn in sub.param_names.values()}
    original_names = [name for name, _ in _state_dict_names(traced.model)
                      if graph.aliases.get(name, name) in covered]
    aliases = {a: c for a, c in graph.aliases.items() if c in covered}
    plan_info = {
        "plan_hash": plan_hash,
        "graph_hash": plan.graph_hash,
        "profile_hash": plan.profile_hash,
        "model_path": plan.model_path,
        "config": plan.config,
        "batch_size": plan.batch_size,
        "options": dict(plan.options),
        "frontend": graph.frontend,
        "accum": plan.accum,
        "activations": plan.activations,
        "device": plan.device,
        "capacity_bytes": plan.capacity_bytes,
        "node_ranges": [[s.start, s.stop] for s in plan.submodels],
        "atomc_version": __version__,
        "transfer_dtype": plan.transfer_dtype,
        "autocast": plan.autocast,
    }
    tensors = [{"inputs": s.inputs, "outputs": s.outputs} for s in subs]
    params = {fqn for sub in subs for local, fqn in sub.param_names.items()
              if local in sub.param_locals}
    full_precision = sorted(params & set(graph.full_precision))
    return env.get_template("package_init.py.jinja").render(
        num_submodels=len(subs),
        model_path=plan.model_path,
        config=plan.config,
        batch_size=plan.batch_size,
        plan_hash=plan_hash,
        atomc_version=__version__,
        accum=plan.accum,
        activations=plan.activations,
        frontend=graph.frontend,
        submodels=[(s.module_name, s.class_name) for s in subs],
        model_inputs=py_literal(tuple(n.name for n in graph.nodes if n.op == "placeholder")),
        boundaries=py_literal(tensors),
        plan=py_literal(plan_info),
        param_names=py_literal([s.param_names for s in subs]),
        tied=py_literal(tied),
        aliases=py_literal(aliases),
        original_names=py_literal(tuple(original_names)),
        full_precision=py_literal(tuple(full_precision)),
    )


def _state_dict_names(model: nn.Module) -> list[tuple[str, Any]]:
    """The original model's state-dict names in its own order (aliases of tied weights included)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()]
