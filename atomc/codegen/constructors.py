"""Codegen's module constructors: source that rebuilds a leaf module (`nn.Linear(32, 96)`) with
the hyperparameters read off the traced instance, checked by building it again on the meta
device and comparing its parameters, buffers and `extra_repr`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from atomc.codegen import reparam
from atomc.codegen.literals import render_constant
from atomc.codegen.resolve import Resolver
from atomc.dtypes import dtype_name
from atomc.errors import CodegenError
from atomc.trace.frontends import layer_class

_SKIP_CTOR_PARAMS = {"device", "dtype"}


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
