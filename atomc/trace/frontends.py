"""Frontends that turn an nn.Module into a torch.fx GraphModule.

Tried in order: torch.fx.symbolic_trace (module-level graph, readable generated code), then
torch.export (ATen-level graph) for models symbolic tracing rejects: control flow on shapes,
cache objects in outputs, unsupported builtins. When both fail, the error names each failure
and the line of the model file it happened on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import re
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch import fx, nn
from torch.autograd.function import FunctionCtx
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from atomc.errors import TraceError


def layer_class(module: nn.Module) -> type:
    """The layer's own class: parametrize turns a module into an instance of a subclass made
    for it (`ParametrizedLinear`), which no code can name."""
    if parametrize.is_parametrized(module):
        return type(module).__mro__[1]
    return type(module)


# factories whose size may be given as separate arguments: torch.ones(batch, length)
_SIZED_FACTORIES = ("ones", "zeros", "empty", "rand", "randn")


def _sizes_as_tuple(factory: Callable) -> Callable:
    """`torch.ones(b, n)` with traced sizes fails in torch's argument parser before fx sees it
    (only a size given as one sequence may hold Proxies); the same call with `(b, n)` traces."""

    @functools.wraps(factory)
    def call(*args, **kwargs):
        if len(args) > 1 and any(isinstance(a, fx.Proxy) for a in args):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return call


_APPLY = torch.autograd.Function.__dict__["apply"].__func__
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


@contextlib.contextmanager
def _functions_kept_whole() -> Iterator[None]:
    """Symbolic tracing would run a custom autograd.Function's forward on Proxies and record
    its operations, and training would differentiate those instead of calling the Function's
    own backward (a gradient reversal layer's, YOSO's approximate one). One call node to
    `TheFunction.apply` keeps both."""

    def apply(cls, *args, **kwargs):
        for value in tree_leaves((args, kwargs)):
            if isinstance(value, fx.Proxy) and _custom(cls):
                # named after the Function (round_straight_through), not "apply"
                name = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
                return value.tracer.create_proxy("call_function", FunctionCall(cls), args,
                                                 kwargs, name=name)
        return _APPLY(cls, *args, **kwargs)

    with mock.patch.object(torch.autograd.Function, "apply", classmethod(apply)):
        yield


@contextlib.contextmanager
def _functions_seen(seen: dict[type, tuple[str, tuple, dict]]) -> Iterator[None]:
    """Records the custom autograd.Functions a run calls: the line that calls each first, and
    the arguments it was called with."""

    def apply(cls, *args, **kwargs):
        if _custom(cls):
            seen.setdefault(cls, (_caller(), args, kwargs))
        return _APPLY(cls, *args, **kwargs)

    with mock.patch.object(torch.autograd.Function, "apply", classmethod(apply)):
        yield


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
        own = _APPLY(cls, *own_args, **own_kwargs)
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


class LeafTracer(fx.Tracer):
    """symbolic_trace's tracer with user-given module types kept whole, and torch.nn's own
    layers whole only when they have no sub-modules."""

    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types

    def trace(self, root, concrete_args=None):
        with contextlib.ExitStack() as patches:
            patches.enter_context(_functions_kept_whole())
            for name in _SIZED_FACTORIES:
                patches.enter_context(mock.patch.object(torch, name, _sizes_as_tuple(
                    getattr(torch, name))))
            return super().trace(root, concrete_args)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        if parametrize.is_parametrized(m):
            # torch.nn's layer with a weight computed by torch (weight_norm, spectral_norm):
            # whole, as the plain layer is (codegen rebuilds it with the same calls,
            # atomc.codegen.reparam); a module of the user's is traced through as always
            alone = all(name == "parametrizations" for name, _ in m.named_children())
            return alone and layer_class(m).__module__.startswith(("torch.nn.", "torch.ao.nn."))
        # fx keeps every torch.nn module whole; a composite one (TransformerEncoder,
        # MultiheadAttention) is traced through instead: the partitioner may cut inside it, and
        # codegen rebuilds only layers whose constructor arguments it can read back
        if next(m.children(), None) is not None:
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _defaults_after(model: nn.Module, given: int) -> dict[str, object]:
    """The forward's parameters after the `given` positional inputs, at their defaults: the
    model file's example inputs are every input the model is called with."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward Python cannot read (compiled): nothing to bind
        return {}
    bound: dict[str, object] = {}
    for param in params[given:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            raise TraceError(f"{type(model).__name__}.forward takes {param.name!r}, which the "
                             f"model file's example_inputs() does not give (it gives {given} "
                             f"input(s)); return it from example_inputs() or give it a default")
        bound[param.name] = param.default
    return bound


def trace_fx(model: nn.Module, leaf_types: tuple[type, ...], given: int,
             defaults: dict[str, object]) -> fx.GraphModule:
    tracer = LeafTracer(leaf_types)
    # Bound, not traced: a placeholder for `mask=None` would take the `mask is not None`
    # branch (a Proxy is not None) and become an input no one gives
    graph = tracer.trace(model, concrete_args=defaults or None)
    # fx still makes a placeholder for each bound parameter, read only by its checks that the
    # same value is passed again (`_assert_is_none(mask)`, `_assert(scale == 2.0)`): no one
    # passes it, so the placeholder and its checks go
    bound = set([n for n in graph.nodes if n.op == "placeholder"][given:])
    for node in graph.nodes:
        if node.op == "call_function" and any(a in bound for a in node.all_input_nodes):
            bound.add(node)
    for node in reversed(list(graph.nodes)):
        if node in bound and not node.users:
            graph.erase_node(node)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and partial graphs about failures we report in one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def trace_export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    seen: dict[type, tuple[str, tuple, dict]] = {}
    with _quiet_torch_logs(), _functions_seen(seen):
        program = torch.export.export(model, inputs, strict=False)
    # export records a Function's forward operations and drops its backward: training takes
    # autograd's derivative of the forward. That is the Function's own gradient when its
    # backward is only a hand-written derivative (BLOOM's GeLU), and silently wrong when it is
    # another (an approximation, a gradient reversal, a straight-through estimator)
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
    gm = program.module()
    # The unlifted module carries pytree and guard plumbing; the compute graph is what we need.
    return gm


class RandomSkip(TraceError):
    """The model decides at random whether a part of it runs (LayerDrop)."""


class CustomBackward(TraceError):
    """torch.export traced through a custom autograd.Function and lost its backward."""


_COMPARISONS = {
    # whether `draw OP p` holds for every draw in [0, 1) (True), for none (False), or depends;
    # `p > draw` reaches the mode as draw.lt(p), the operator methods by their plain names
    "lt": lambda p: True if p >= 1 else False if p <= 0 else None,
    "le": lambda p: True if p >= 1 else False if p < 0 else None,
    "gt": lambda p: True if p < 0 else False if p >= 1 else None,
    "ge": lambda p: True if p <= 0 else False if p >= 1 else None,
}


_RAND = torch.rand  # the tracer wraps torch.rand (see _sizes_as_tuple) while it traces


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
                    f"{_caller()} compares a random draw torch.rand([]) with {args[1]}: the "
                    "model skips part of itself at random in training (LayerDrop), which fixed "
                    "sub-models cannot do; set that probability (the config's layerdrop) to 0")
            return decided
        out = func(*args, **kwargs)
        if func is _RAND and isinstance(out, torch.Tensor) and out.dim() == 0:
            self.draws[id(out)] = out
        return out


def _caller() -> str:
    """The innermost line of the model's own code (not torch's, not this module's)."""
    for frame in reversed(traceback.extract_stack()):
        parts = Path(frame.filename).parts
        if "torch" not in parts and frame.filename != __file__:
            return f"{Path(frame.filename).name}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "the model"


def trace(model: nn.Module, inputs: tuple, leaf_types: tuple[type, ...], model_path: Path,
          frontend: str = "auto") -> tuple[fx.GraphModule, str]:
    """(GraphModule, frontend name). `frontend` is "auto", "fx" or "export"."""
    failures: list[str] = []
    defaults = _defaults_after(model, len(inputs))
    if frontend in ("auto", "fx"):
        try:
            with LayerDropDecided():
                return trace_fx(model, leaf_types, len(inputs), defaults), "fx"
        except RandomSkip as e:
            raise RandomSkip(f"cannot trace the model in {model_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - fx raises many kinds; all mean "try the next"
            failures.append(f"torch.fx.symbolic_trace: {_describe(e, model_path)}")
    if frontend in ("auto", "export"):
        try:
            with LayerDropDecided():
                return trace_export(model, inputs), "export"
        except (RandomSkip, CustomBackward) as e:
            raise type(e)(f"cannot trace the model in {model_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - export raises many kinds; all are reported below
            failures.append(f"torch.export: {_describe(e, model_path)}")
    raise TraceError(
        f"cannot trace the model in {model_path}: " + "; ".join(failures)
        + ". Make the failing line traceable (e.g. avoid Python control flow on tensor values), "
        "or mark the module that contains it as a leaf (LEAF_MODULES in the model file)"
    )


def _describe(exc: BaseException, model_path: Path) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {first}"[:300]
    if "in output, which is not a known type" in first:
        # the usual cause: a Hugging Face model returning its key/value cache
        message += (" [the model returns an object torch.export cannot flatten: return tensors, "
                    "tuples or dicts of them (for Hugging Face models pass use_cache=False)]")
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == model_path.resolve():
            where = f" (at {model_path.name}:{frame.lineno}: {(frame.line or '').strip()})"
    return message + where
