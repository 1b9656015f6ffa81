"""Leaf layers whose weight torch computes from other tensors: torch.nn.utils.parametrize
(`parametrizations.weight_norm`, `spectral_norm`, a user's `register_parametrization`) and
the older forward-pre-hook versions (`torch.nn.utils.weight_norm`, `spectral_norm`).

A weight-normalised nn.Linear holds `parametrizations.weight.original0/1` (or `weight_g` and
`weight_v`) instead of `weight`, and spectral norm keeps its power-iteration vectors as buffers
that every training forward updates. The tracer keeps such a layer whole, as it keeps the plain
layer (atomc.trace.frontends), and codegen rebuilds it the way its author wrote it: the plain
layer from its attributes, then the same calls, e.g. `spectral_norm(nn.Linear(128, 32))`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

_NN = "from torch import nn"
_PARAMETRIZATIONS = "from torch.nn.utils import parametrizations"
_PARAMETRIZE = "from torch.nn.utils import parametrize"


@dataclass(frozen=True)
class Wrap:
    """One call that wraps a layer: `fn(layer, *args, **kwargs)` returns it, written `source`
    in generated code (which then needs `imports`)."""

    fn: Callable[..., nn.Module]
    source: str
    imports: str
    args: tuple
    kwargs: dict[str, Any]


def wrappers(module: nn.Module) -> list[Wrap]:
    """The calls that turn the plain layer into `module`, in order."""
    calls: list[Wrap] = []
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            calls.append(Wrap(nn.utils.weight_norm, "nn.utils.weight_norm", _NN, (hook.name,),
                              {"dim": hook.dim}))
        elif isinstance(hook, SpectralNorm):
            calls.append(Wrap(nn.utils.spectral_norm, "nn.utils.spectral_norm", _NN,
                              (hook.name,), {"n_power_iterations": hook.n_power_iterations,
                                             "eps": hook.eps, "dim": hook.dim}))
    if parametrize.is_parametrized(module):
        for name, chain in module.parametrizations.items():
            for p in chain:
                if type(p) is parametrizations._WeightNorm:
                    calls.append(Wrap(parametrizations.weight_norm,
                                      "parametrizations.weight_norm", _PARAMETRIZATIONS, (name,),
                                      {"dim": p.dim}))
                elif type(p) is parametrizations._SpectralNorm:
                    calls.append(Wrap(parametrizations.spectral_norm,
                                      "parametrizations.spectral_norm", _PARAMETRIZATIONS,
                                      (name,), {"n_power_iterations": p.n_power_iterations,
                                                "eps": p.eps, "dim": p.dim}))
                else:
                    calls.append(Wrap(parametrize.register_parametrization,
                                      "parametrize.register_parametrization", _PARAMETRIZE,
                                      (name, p), {"unsafe": True} if chain.unsafe else {}))
    return calls


def rewrap(module: nn.Module, plain: nn.Module) -> nn.Module:
    """`plain` (a layer rebuilt on the meta device) wrapped as `module` is, to check a rebuild
    against."""
    for w in wrappers(module):
        args = tuple(copy.deepcopy(a).to("meta") if isinstance(a, nn.Module) else a
                     for a in w.args)
        with torch.device("meta"):
            plain = w.fn(plain, *args, **w.kwargs)
    return plain


def wrapped_source(module: nn.Module, plain: str, imports: set[str],
                   constant: Callable[[Any], str]) -> str:
    """Source of `module` from the source of its plain layer; `constant` renders an argument
    (a parametrization module: its constructor)."""
    text = plain
    for w in wrappers(module):
        imports.add(w.imports)
        sig = inspect.signature(w.fn)
        given = sig.bind(None, *w.args, **w.kwargs).arguments  # the layer first
        parts = [text]
        positional = True  # until an argument is left out (it has its default value)
        for p in list(sig.parameters.values())[1:]:
            value = given.get(p.name, p.default)
            if p.default is not p.empty and type(value) is type(p.default) \
                    and value == p.default:
                positional = False
                continue
            if positional and p.kind is p.POSITIONAL_OR_KEYWORD:
                parts.append(constant(value))
            else:
                parts.append(f"{p.name}={constant(value)}")
        text = f"{w.source}({', '.join(parts)})"
    return text
