"""What a model decides while it runs that a traced graph must keep: whether LayerDrop skips
a layer (a random draw compared with a probability), which backward a custom autograd
Function runs (its own, not autograd's derivative of its forward), and whether a module that
converts itself in its forward changes anything. Used by the frontends while they trace
(atomc.trace.frontends) and by codegen to name a kept Function."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import fx, nn
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from atomc.errors import TraceError


class RandomSkip(TraceError):
    """The model decides at random whether a part of it runs (LayerDrop)."""


class CustomBackward(TraceError):
    """torch.export traced through a custom autograd.Function and lost its backward."""


# failures no other frontend avoids: the model's own behaviour, not a tracer's limit
FINAL = (RandomSkip, CustomBackward)


_INTERNAL = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parents[1]))
# the standard library's folder, which holds the site-packages of a Python built from source
_STDLIB = str(Path(contextlib.__file__).resolve().parent)
_INSTALLED = ("site-packages", "dist-packages")


@functools.lru_cache(maxsize=4096)  # a stack's files repeat: one realpath each
def is_internal(filename: str) -> bool:
    """A frame of torch, of the standard library or of atomc: not the model's own code (nor
    a library's it calls, such as transformers or torchvision, whose folder's name begins
    with torch's)."""
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    if any(path.startswith(root + os.sep) for root in _INTERNAL):
        return True
    return path.startswith(_STDLIB + os.sep) and not any(
        part in _INSTALLED for part in Path(path[len(_STDLIB):]).parts)


def caller() -> str:
    """The innermost line of the model's own code (or of a library it calls)."""
    for frame in reversed(traceback.extract_stack()):
        if not is_internal(frame.filename):
            return f"{Path(frame.filename).name}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "the model"


# ---------------------------------------------------------------------------------------------
# Custom autograd Functions


# torch's own `Function.apply`, a classmethod (a C-level classmethod descriptor from torch
# 2.14 on, which has no __func__): `_torch_apply(cls, ...)` binds it to `cls` either way
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"]


def _torch_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _TORCH_APPLY.__get__(None, cls)(*args, **kwargs)


_SETUP_CONTEXT = torch.autograd.Function.setup_context


class FunctionCall:
    """`TheFunction.apply` as a graph node's target. Not the bound method itself: fx would name
    that by where `apply` is defined (torch.autograd.function), which holds no such name."""

    def __init__(self, function: type):
        self.function = function
        self.__module__ = function.__module__
        self.__qualname__ = f"{function.__qualname__}.apply"
        self.__name__ = self.__qualname__  # fx names a target module.__name__

    def __call__(self, *args, **kwargs):
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


def autograd_function_of(fn: object) -> type | None:
    """The custom torch.autograd.Function a node's target applies, else None."""
    return fn.function if isinstance(fn, FunctionCall) else None


def _custom(cls: type) -> bool:
    # torch's own Functions (checkpointing's) differentiate their forward exactly
    return not cls.__module__.startswith("torch.")


def _apply_patched(apply: Callable) -> contextlib.AbstractContextManager:
    """Every Function's `apply` replaced by `apply(cls, *args, **kwargs)` for the block."""
    return mock.patch.object(torch.autograd.Function, "apply", classmethod(apply))


def functions_kept_whole() -> contextlib.AbstractContextManager:
    """Symbolic tracing would run a custom autograd.Function's forward on Proxies and record
    its operations, and training would differentiate those instead of calling the Function's
    own backward (a gradient reversal layer's, YOSO's approximate one). One call node to
    `TheFunction.apply` keeps both."""

    def apply(cls, *args, **kwargs):
        proxies = [v for v in tree_leaves((args, kwargs)) if isinstance(v, fx.Proxy)]
        if not proxies or not _custom(cls):
            return _torch_apply(cls, *args, **kwargs)
        # named after the Function (round_straight_through), not "apply"
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        return proxies[0].tracer.create_proxy("call_function", FunctionCall(cls), args, kwargs,
                                              name=name)

    return _apply_patched(apply)


@contextlib.contextmanager
def functions_checked() -> Iterator[None]:
    """Around torch.export, which records a Function's forward operations and drops its
    backward, so that training takes autograd's derivative of the forward. That is the
    Function's own gradient when its backward is only a hand-written derivative (BLOOM's GeLU),
    and silently wrong when it is another (an approximation, a gradient reversal, a
    straight-through estimator): raises CustomBackward after the block for those."""
    seen: dict[type, tuple[str, tuple, dict]] = {}  # the first call's line and arguments

    def apply(cls, *args, **kwargs):
        if _custom(cls) and cls not in seen:  # the stack walked once per Function
            seen[cls] = (caller(), args, kwargs)
        return _torch_apply(cls, *args, **kwargs)

    with _apply_patched(apply):
        yield
    other = {c: where for c, (where, args, kwargs) in seen.items()
             if not _backward_is_derivative(c, args, kwargs)}
    if other:
        names = ", ".join(f"{c.__module__}.{c.__qualname__} (called at {where})"
                          for c, where in other.items())
        raise CustomBackward(
            f"the model calls the custom autograd.Function {names}, whose backward is not "
            f"autograd's derivative of its forward (tried on random inputs of the traced "
            f"shapes); torch.export keeps its forward and drops its backward, so training would "
            f"use the wrong gradients. Make the model traceable by torch.fx (which keeps the "
            f"Function whole), or mark the module that calls it as a leaf (LEAF_MODULES)")


def _backward_is_derivative(cls: type, args: tuple, kwargs: dict) -> bool:
    """Whether the Function's backward gives autograd's gradients of its forward, on random
    inputs shaped like the traced ones. Any failure to tell (arguments that are modules, a
    forward that needs more of `ctx` than saving tensors) counts as no."""
    gen = torch.Generator().manual_seed(0)

    def real(v: object) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        shape = tuple(int(n) for n in v.shape)
        if v.is_floating_point():
            return (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
        return torch.zeros(shape, dtype=v.dtype)

    try:
        own_args, own_kwargs = tree_map(real, (args, kwargs))
        same_args, same_kwargs = tree_map(
            lambda v: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor)
            and v.is_floating_point() else v, (own_args, own_kwargs))
        own = _torch_apply(cls, *own_args, **own_kwargs)
        if cls.setup_context is not _SETUP_CONTEXT:  # forward(*args) with setup_context
            derived = cls.forward(*same_args, **same_kwargs)
        else:
            derived = cls.forward(FunctionCtx(), *same_args, **same_kwargs)
        return _same_gradients(own, tree_leaves((own_args, own_kwargs)), derived,
                               tree_leaves((same_args, same_kwargs)))
    except Exception:  # noqa: BLE001 - anything that stops the comparison means "cannot tell"
        return False


def _same_gradients(own: object, own_in: list, derived: object, derived_in: list) -> bool:
    outs = [o for o in tree_leaves(own) if isinstance(o, torch.Tensor) and o.requires_grad]
    alike = [o for o in tree_leaves(derived) if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(outs) != len(alike):
        return False
    ins = [(a, b) for a, b in zip(own_in, derived_in) if isinstance(a, torch.Tensor)
           and a.requires_grad]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    mine = torch.autograd.grad(outs, [a for a, _ in ins], grads, allow_unused=True)
    theirs = torch.autograd.grad(alike, [b for _, b in ins], grads, allow_unused=True)
    pairs = [*zip(outs, alike), *((torch.zeros(()) if g is None else g,
                                   torch.zeros(()) if h is None else h)
                                  for g, h in zip(mine, theirs))]
    # a value outside the forward's domain (acos of more than 1) tells nothing: no
    return all(a.isfinite().all() and torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-9)
               for a, b in pairs)


# ---------------------------------------------------------------------------------------------
# LayerDrop


_COMPARISONS = {
    # whether `draw OP p` holds for every draw in [0, 1) (True), for none (False), or depends;
    # `p > draw` reaches the mode as draw.lt(p), the operator methods by their plain names
    "lt": lambda p: True if p >= 1 else False if p <= 0 else None,
    "le": lambda p: True if p >= 1 else False if p < 0 else None,
    "gt": lambda p: True if p < 0 else False if p >= 1 else None,
    "ge": lambda p: True if p <= 0 else False if p >= 1 else None,
}


_RAND = torch.rand  # the fx tracer wraps torch.rand while it traces (frontends)


class LayerDropDecided(TorchFunctionMode):
    """Decides `torch.rand([]) < p` while tracing, when every draw gives the same answer.

    Hugging Face's LayerDrop skips a whole layer in training when a scalar uniform draw falls
    below the config's probability. Traced, the comparison is control flow on a random value:
    torch.export cannot guard on it, and symbolic tracing would bake in whatever one draw said.
    With the probability 0 (most configs) every draw keeps the layer, which a fixed graph
    represents exactly; any other probability is refused, since sub-models cannot skip layers.
    """

    def __init__(self):
        super().__init__()
        self.draws: dict[int, torch.Tensor] = {}  # id -> draw, kept alive so ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").strip("_")
        if name in _COMPARISONS and len(args) == 2 and id(args[0]) in self.draws \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
            decided = _COMPARISONS[name](args[1])
            if decided is None:
                raise RandomSkip(
                    f"{caller()} compares a random draw torch.rand([]) with {args[1]}: the "
                    "model skips part of itself at random in training (LayerDrop), which fixed "
                    "sub-models cannot do; set that probability (the config's layerdrop) to 0")
            return decided
        out = func(*args, **kwargs)
        if func is _RAND and isinstance(out, torch.Tensor) and out.dim() == 0:
            self.draws[id(out)] = out
        return out


@contextlib.contextmanager
def conversions_that_change_nothing() -> Iterator[None]:
    """A module's `.to(...)` inside a forward returns the module when it would change none of
    its tensors (SwitchTransformers' router: `self.classifier = self.classifier.to(self.dtype)`
    on every call). torch.export swaps each parameter for its converted self, and refuses
    (`Couldn't swap Linear.weight`) though the conversion does nothing; one that does change
    a tensor is left to torch (and so refused)."""
    convert = nn.Module.to

    def to(module: nn.Module, *args: object, **kwargs: object) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and all(
                (device is None or t.device == device)
                and (dtype is None or t.dtype == dtype
                     or not (t.is_floating_point() or t.is_complex()))
                for t in itertools.chain(module.parameters(), module.buffers())):
            return module
        return convert(module, *args, **kwargs)

    with mock.patch.object(nn.Module, "to", to):
        yield


@contextlib.contextmanager
def distributions_unvalidated() -> Iterator[None]:
    """torch.distributions checks its arguments (`Normal(loc, scale)`: scale > 0) by reading
    tensor values, which no trace can follow; the checks raise or do nothing, so they go, as
    assertions do (the model file can still pass validate_args=True, which then fails)."""
    Distribution = torch.distributions.Distribution
    before = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(before)
