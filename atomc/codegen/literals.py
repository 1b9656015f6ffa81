"""Codegen's literals: a traced constant as Python source (`torch.float16`, `slice(0, 4, None)`,
an enum member, a dataclass), the shape comment beside each statement, a boundary value's
entry in BOUNDARIES, and the deterministic literals of the package's tables.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pprint
from collections.abc import Callable
from typing import Any

import torch

from atomc.codegen.resolve import Resolver
from atomc.dtypes import dtype_name
from atomc.errors import CodegenError


class Expr:
    """Source text to paste as is (a local name, `self.training`, `device`)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def container_source(value: Any, item: Callable[[Any], str]) -> str | None:
    """A slice, tuple, list or dict as source, every item (a dict's keys too) written by
    `item`; None for anything else, a namedtuple included."""
    if isinstance(value, slice):
        return f"slice({item(value.start)}, {item(value.stop)}, {item(value.step)})"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [item(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(item(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{item(k)}: {item(v)}" for k, v in value.items()) + "}"
    return None


def render_constant(value: Any, resolver: Resolver, imports: set[str], why: str,
                    device_type: str | None = None) -> str:
    """Python source for a constant argument; CodegenError for what cannot be written down."""
    def r(v: Any) -> str:
        return render_constant(v, resolver, imports, why, device_type)

    if isinstance(value, Expr):
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
    text = container_source(value, r)
    if text is not None:
        return text
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
