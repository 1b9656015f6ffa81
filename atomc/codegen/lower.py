"""Codegen's operators: a graph call as the Python a person writes, with operator precedence.

torch.export records ATen operators (`torch.ops.aten.slice.Tensor(x, 3, 4, 9223372036854775807)`);
people write `x[..., 4:]`, `x.transpose(1, 2)`, `a + b`, `F.scaled_dot_product_attention(...)`.
`lower_aten` maps an ATen call to such a `Form` by the operator's schema: operators with infix
syntax become operators, slicing and indexing become subscripts, a Tensor method of the same
schema becomes a method call, a `torch` function of the same schema a function call, and the
`torch.nn.functional` calls whose ATen operator differs in arguments (`embedding`,
`batch_norm`...) are mapped argument by argument. Arguments left at their defaults are left
out; optional ones are written by keyword. What has no such form stays `torch.ops.aten...`.

`Code` is rendered source with its precedence, so that inlined expressions get exactly the
parentheses they need.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

# Python's operator precedence, loosest first (the parts codegen writes).
TERNARY, OR, AND, NOT, COMPARE, BIT_OR, BIT_XOR, BIT_AND, SHIFT, SUM, PRODUCT, UNARY, POWER, \
    ATOM = range(14)

_BINARY_PRECEDENCE = {
    "|": BIT_OR, "^": BIT_XOR, "&": BIT_AND, "<<": SHIFT, ">>": SHIFT, "+": SUM, "-": SUM,
    "*": PRODUCT, "/": PRODUCT, "//": PRODUCT, "%": PRODUCT, "@": PRODUCT, "**": POWER,
    "==": COMPARE, "!=": COMPARE, "<": COMPARE, "<=": COMPARE, ">": COMPARE, ">=": COMPARE,
}


@dataclass(frozen=True)
class Code:
    """Source text of an expression and how tightly it binds."""

    text: str
    precedence: int = ATOM

    def at(self, level: int) -> str:
        """The text, parenthesised unless it binds at least as tightly as `level`."""
        return self.text if self.precedence >= level else f"({self.text})"


def binary(symbol: str, left: Code, right: Code) -> Code:
    level = _BINARY_PRECEDENCE[symbol]
    if symbol == "**":  # right-associative; `-x ** 2` is `-(x ** 2)`
        return Code(f"{left.at(POWER + 1)} ** {right.at(UNARY)}", POWER)
    if level == COMPARE:  # `a < b < c` chains: never let one comparison take another
        return Code(f"{left.at(COMPARE + 1)} {symbol} {right.at(COMPARE + 1)}", COMPARE)
    return Code(f"{left.at(level)} {symbol} {right.at(level + 1)}", level)


def unary(symbol: str, operand: Code) -> Code:
    if symbol == "not ":
        return Code(f"not {operand.at(NOT)}", NOT)
    return Code(f"{symbol}{operand.at(UNARY)}", UNARY)


def constant_code(text: str) -> Code:
    """A rendered constant's precedence: `-1` is a unary minus, `p if self.training else 0.0`
    a conditional, everything else codegen writes as a constant is an atom."""
    if " if " in text:
        return Code(text, TERNARY)
    if text.startswith("-"):
        return Code(text, UNARY)
    return Code(text, ATOM)


@dataclass
class Form:
    """How to write one call: `kind` is binary, unary, method, function, index or same."""

    kind: str
    name: str = ""  # operator symbol, method name or callee (`F.linear`, `torch.cat`)
    args: tuple = ()  # graph values: nodes or constants
    kwargs: dict[str, Any] = field(default_factory=dict)
    unpack: bool = False  # method: a size list written as separate arguments (`x.view(2, 8)`)
    index: tuple = ()  # index: the subscript's items (slice, None, Ellipsis, values)
    imports: tuple[str, ...] = ()


_INT64_MAX = 2**63 - 1

_INFIX = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "matmul": "@",
    "remainder": "%", "floor_divide": "//", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
    "gt": ">", "ge": ">=", "__and__": "&", "__or__": "|", "__xor__": "^", "bitwise_and": "&",
    "bitwise_or": "|", "bitwise_xor": "^", "__lshift__": "<<", "__rshift__": ">>",
}
_UNARY = {"neg": "-", "bitwise_not": "~"}

# methods whose single size-list argument reads better unpacked: `x.view(2, 16, -1)`
_SIZE_METHODS = {"view", "reshape", "expand", "permute", "repeat"}

# torch.nn.functional calls: ATen name -> (F name, {ATen argument: F argument}); the ATen
# arguments not listed keep their names, and those mapped to "" are left out (they are at
# the value F passes itself).
_FUNCTIONAL: dict[str, tuple[str, dict[str, str]]] = {
    "linear": ("linear", {}),
    "scaled_dot_product_attention": ("scaled_dot_product_attention", {}),
    "silu": ("silu", {}),
    "gelu": ("gelu", {}),
    "relu": ("relu", {}),
    "relu6": ("relu6", {}),
    "mish": ("mish", {}),
    "hardswish": ("hardswish", {}),
    "hardsigmoid": ("hardsigmoid", {}),
    "softplus": ("softplus", {}),
    "leaky_relu": ("leaky_relu", {}),
    "hardtanh": ("hardtanh", {}),
    "glu": ("glu", {}),
    "log_sigmoid": ("logsigmoid", {}),
    "one_hot": ("one_hot", {}),
    "pad": ("pad", {}),
    "layer_norm": ("layer_norm", {"cudnn_enable": ""}),
    "group_norm": ("group_norm", {"cudnn_enabled": ""}),
    "rms_norm": ("rms_norm", {}),
    "dropout": ("dropout", {"train": "training"}),
    "alpha_dropout": ("alpha_dropout", {"train": "training"}),
    "conv1d": ("conv1d", {}),
    "conv2d": ("conv2d", {}),
    "conv3d": ("conv3d", {}),
    "conv_transpose1d": ("conv_transpose1d", {}),
    "conv_transpose2d": ("conv_transpose2d", {}),
    "conv_transpose3d": ("conv_transpose3d", {}),
    "max_pool1d": ("max_pool1d", {}),
    "max_pool2d": ("max_pool2d", {}),
    "max_pool3d": ("max_pool3d", {}),
    "avg_pool1d": ("avg_pool1d", {}),
    "avg_pool2d": ("avg_pool2d", {}),
    "avg_pool3d": ("avg_pool3d", {}),
    "adaptive_avg_pool1d": ("adaptive_avg_pool1d", {}),
    "adaptive_avg_pool2d": ("adaptive_avg_pool2d", {}),
    "adaptive_avg_pool3d": ("adaptive_avg_pool3d", {}),
    "pixel_shuffle": ("pixel_shuffle", {}),
    "pixel_unshuffle": ("pixel_unshuffle", {}),
}
# how many leading arguments are written positionally (optional ones after them by keyword)
_F_KEYWORDS_FROM = {"linear": 3, "layer_norm": 4, "group_norm": 4, "rms_norm": 3, "pad": 2,
                    "conv1d": 3, "conv2d": 3, "conv3d": 3, "conv_transpose1d": 3,
                    "conv_transpose2d": 3, "conv_transpose3d": 3}

# keyword arguments at the value the Python call takes when they are not given
_QUIET_KWARGS = {("pin_memory", False), ("pin_memory", None), ("layout", None),
                 ("non_blocking", False), ("memory_format", None), ("implicit", False)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values with odd equality are never "the default"
        return False


def _bound(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every argument given, in schema order."""
    schema = op._schema.arguments
    out: list[tuple[Any, Any]] = []
    for i, arg in enumerate(schema):
        if i < len(args) and not arg.kwarg_only:
            out.append((arg, args[i]))
        elif arg.name in kwargs:
            out.append((arg, kwargs[arg.name]))
    return out


def _is_default(arg: Any, value: Any) -> bool:
    if (arg.name, value) in _QUIET_KWARGS:
        return True
    if arg.name == "layout" and value == torch.strided:
        return True
    if arg.has_default_value():
        return _same(value, arg.default_value)
    return False


def _call_form(kind: str, name: str, bound: list[tuple[Any, Any]], *, keywords_from: int | None,
               renames: dict[str, str] | None = None, imports: tuple[str, ...] = ()) -> Form:
    """Arguments at their defaults left out; those after the first left out, and optional
    ones (from `keywords_from` on), by keyword."""
    renames = renames or {}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    by_keyword = False
    for i, (arg, value) in enumerate(bound):
        if renames.get(arg.name) == "" or _is_default(arg, value):
            by_keyword = True
            continue
        if getattr(arg, "N", None) == 1 and isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]  # an `int[1]` argument: `mean(-1)` for `mean([-1])`
        optional = arg.has_default_value() or arg.kwarg_only
        if (by_keyword or arg.kwarg_only
                or (optional and keywords_from is not None and i >= keywords_from)):
            by_keyword = True
            kwargs[renames.get(arg.name, arg.name)] = value
        else:
            args.append(value)
    return Form(kind, name, tuple(args), kwargs, imports=imports)


def _dim_index(dim: int, ndim: int, item: Any) -> tuple:
    """The subscript that applies `item` at dimension `dim` of an `ndim`-dimensional tensor."""
    if dim < 0:
        dim += ndim
    if dim == ndim - 1 and ndim > 1:
        return (Ellipsis, item)
    return (*[slice(None)] * dim, item)


def _is_method(name: str) -> bool:
    method = getattr(torch.Tensor, name, None)
    return method is not None and not inspect.isfunction(method)  # C-bound: schema arguments


def _is_torch_function(name: str) -> bool:
    fn = getattr(torch, name, None)
    return fn is not None and inspect.isbuiltin(fn)


def _operator_form(name: str, overload: str, args: tuple, kwargs: dict, given: dict,
                   ndim: int | None) -> Form | None:
    """`op` as an operator or a subscript (`a + b`, `-x`, `x[:, 1:]`); None: not one of those."""
    first = args[0] if args else None
    if name == "alias":
        return Form("same", args=(first,))
    if name in _INFIX and overload in (
            "Tensor", "Scalar", "default", "Tensor_Scalar", "Tensor_Tensor"):
        alpha = given.get("alpha", 1)
        if _same(alpha, 1) and len(args) == 2:
            return Form("binary", _INFIX[name], (args[0], args[1]))
    if name == "rsub" and _same(given.get("alpha", 1), 1) and len(args) == 2:
        return Form("binary", "-", (args[1], args[0]))
    if name in _UNARY and len(args) == 1 and not kwargs:
        return Form("unary", _UNARY[name], (first,))
    if name == "slice" and overload == "Tensor" and ndim:
        dim = given.get("dim", 0)
        start, end, step = given.get("start"), given.get("end"), given.get("step", 1)
        if start == 0:
            start = None
        if isinstance(end, int) and end >= _INT64_MAX:
            end = None
        if step == 1:
            step = None
        return Form("index", args=(first,), index=_dim_index(dim, ndim, slice(start, end, step)))
    if name == "select" and overload == "int" and ndim:
        return Form("index", args=(first,), index=_dim_index(given["dim"], ndim, given["index"]))
    if name == "index" and overload == "Tensor":
        items = tuple(slice(None) if i is None else i for i in given["indices"])
        return Form("index", args=(first,), index=items)
    if name == "sym_size" and overload == "int":
        return Form("index", args=(Attribute(first, "shape"),), index=(given["dim"],))
    return None


def _special_call_form(name: str, overload: str, args: tuple, kwargs: dict,
                       bound: list[tuple[Any, Any]], given: dict) -> Form | None:
    """The calls whose Python spelling differs from the ATen schema beyond renamed arguments
    (copies, splits, embedding, batch norm, padding, ELU, softmax, einsum); None: another op."""
    first = args[0] if args else None
    if name in ("_to_copy", "lift_fresh_copy", "clone") and not any(
            k not in ("dtype", "device", "layout", "pin_memory", "non_blocking",
                      "memory_format") for k in kwargs):
        rest = [(a, v) for a, v in bound[1:] if not _is_default(a, v)]
        if name != "_to_copy" or not rest:
            return Form("method", "clone", (first,),
                        {a.name: v for a, v in rest if a.name == "memory_format"})
        form = _call_form("method", "to", bound, keywords_from=1)
        form.kwargs["copy"] = True
        return form
    if name == "split" and overload in ("Tensor", "default"):
        return Form("method", "split", (first, given["split_size"]),
                    {"dim": given["dim"]} if given.get("dim", 0) != 0 else {})
    if name == "split_with_sizes":
        return Form("method", "split", (first, given["split_sizes"]),
                    {"dim": given["dim"]} if given.get("dim", 0) != 0 else {})
    if name == "embedding":
        kw = {k: v for k, v in (("padding_idx", given.get("padding_idx", -1)),
                                ("scale_grad_by_freq", given.get("scale_grad_by_freq", False)),
                                ("sparse", given.get("sparse", False)))
              if not _same(v, {"padding_idx": -1}.get(k, False))}
        return Form("function", "F.embedding", (given["indices"], given["weight"]), kw,
                    imports=("import torch.nn.functional as F",))
    if name == "batch_norm":
        kw = {k: given[k] for k in ("training", "momentum", "eps") if k in given}
        return Form("function", "F.batch_norm", (first, given.get("running_mean"),
                                                 given.get("running_var")),
                    {"weight": given.get("weight"), "bias": given.get("bias"), **kw},
                    imports=("import torch.nn.functional as F",))
    if name == "constant_pad_nd":
        kw = {} if _same(given.get("value", 0), 0) else {"value": given["value"]}
        return Form("function", "F.pad", (first, given["pad"]), kw,
                    imports=("import torch.nn.functional as F",))
    if name == "elu" and all(_same(given.get(k, 1), 1) for k in ("scale", "input_scale")):
        kw = {} if _same(given.get("alpha", 1), 1) else {"alpha": given["alpha"]}
        return Form("function", "F.elu", (first,), kw,
                    imports=("import torch.nn.functional as F",))
    if name in ("_softmax", "_log_softmax") and not given.get("half_to_float", False):
        return Form("method", name[1:], (first, given["dim"]))
    if name == "einsum":
        return Form("function", "torch.einsum", (given["equation"], given["tensors"]),
                    imports=("import torch",))
    return None


def lower_aten(op: torch._ops.OpOverload, args: tuple, kwargs: dict,
               ndim: int | None) -> Form | None:
    """How a person writes `op(*args, **kwargs)`; None: as `torch.ops.aten...` (no such
    form). `ndim` is the first argument's traced rank."""
    name = op._schema.name.split("::")[-1]
    bound = _bound(op, args, kwargs)
    given = {a.name: v for a, v in bound}
    overload = op._overloadname
    form = (_operator_form(name, overload, args, kwargs, given, ndim)
            or _special_call_form(name, overload, args, kwargs, bound, given))
    if form is not None:
        return form
    if name in _FUNCTIONAL:
        f_name, renames = _FUNCTIONAL[name]
        return _call_form("function", f"F.{f_name}", bound,
                          keywords_from=_F_KEYWORDS_FROM.get(name, 1), renames=renames,
                          imports=("import torch.nn.functional as F",))
    if name.startswith("_"):
        return None
    schema = op._schema.arguments
    if schema and schema[0].name == "self" and str(schema[0].type) == "Tensor" \
            and _is_method(name):
        form = _call_form("method", name, bound, keywords_from=1)
        if (name in _SIZE_METHODS and len(form.args) == 2 and not form.kwargs
                and isinstance(form.args[1], (list, tuple)) and form.args[1]):
            form.unpack = True
        return form
    if _is_torch_function(name):
        return _call_form("function", f"torch.{name}", bound, keywords_from=1,
                          imports=("import torch",))
    return None


@dataclass(frozen=True)
class Attribute:
    """`value.name` as an argument of a Form (`x.shape` in `x.shape[1]`)."""

    value: Any
    name: str


# fx's own call_function targets with operator syntax
OPERATOR_SYMBOLS = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
    operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
UNARY_SYMBOLS = {operator.neg: "-", operator.pos: "+", operator.invert: "~",
                 operator.not_: "not "}
