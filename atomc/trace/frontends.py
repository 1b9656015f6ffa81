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
import linecache
import logging
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils._pytree import TreeSpec, tree_structure

from atomc.errors import TraceError
from atomc.trace.dynamic import (
    FINAL,
    LayerDropDecided,
    conversions_that_change_nothing,
    distributions_unvalidated,
    functions_checked,
    functions_kept_whole,
    is_internal,
)
from atomc.trace.normalise import MODES


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


# GraphModule.meta key of a symbolic trace's output structure (LeafTracer.output_spec)
OUTPUT_SPEC = "atomc_output_spec"


class LeafTracer(fx.Tracer):
    """symbolic_trace's tracer with user-given module types kept whole, and torch.nn's own
    layers whole only when they have no sub-modules."""

    # A buffer read as an attribute is a graph input, as a parameter is. fx's default runs
    # what the forward does with it at trace time: `self.codebook.t()` became a constant of
    # the trace-time values, and `self.ema.mul_(0.99).add_(x)` lost its mul_, so a buffer
    # the forward updates (an EMA codebook, running statistics of the model's own) trained
    # on stale values and updated wrongly.
    proxy_buffer_attributes = True

    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types
        # the forward's result with its container classes (an OrderedDict, a dict class of the
        # model's): fx's output node keeps the structure but makes every dict a plain one
        self.output_spec: TreeSpec | None = None
        self._outer: object = None
        self._depth = 0

    def create_arg(self, a):
        if self._depth == 0:
            self._outer = a
        self._depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._depth -= 1

    def trace(self, root, concrete_args=None):
        # buffer tensor -> the value the forward assigned to it, for the rest of this trace
        self.assigned: dict[int, fx.Proxy] = {}
        with contextlib.ExitStack() as patches:
            # the forward's own no_grad regions switch gradients off while it is traced (see
            # create_node); from a caller's no_grad, the whole graph would look like one
            patches.enter_context(torch.enable_grad())
            patches.enter_context(functions_kept_whole())
            for name in _SIZED_FACTORIES:
                patches.enter_context(mock.patch.object(torch, name, _sizes_as_tuple(
                    getattr(torch, name))))
            if isinstance(root, nn.Module):
                patches.enter_context(self._buffer_assignments(root))
            return super().trace(root, concrete_args)

    def _buffer_assignments(self, root: nn.Module):
        """`self.steps += 1` or `self.mean = m * self.mean + ...` in a forward: the graph
        writes the value into the buffer (a copy_, as torch.export writes a buffer mutation)
        and the rest of the forward reads the value itself, as the eager model does. Left to
        nn.Module, the module would keep the trace's Proxy as its buffer."""
        names = {id(m): name for name, m in root.named_modules()}
        setattr_ = nn.Module.__setattr__

        def assign(module: nn.Module, name: str, value: object) -> None:
            buffers = module.__dict__.get("_buffers") or {}
            if (isinstance(value, fx.Proxy) and buffers.get(name) is not None
                    and id(module) in names):
                prefix = names[id(module)]
                stored = self.create_proxy("get_attr", f"{prefix}.{name}" if prefix else name,
                                           (), {})
                stored.copy_(value.detach())
                self.assigned[id(buffers[name])] = value
                return
            setattr_(module, name, value)

        return mock.patch.object(nn.Module, "__setattr__", assign)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        """A node made inside the forward's `torch.no_grad()` region is tagged with it, as
        torch.export's regions are once inlined (atomc.trace.normalise.MODES): symbolic tracing
        runs the region's `with` but records nothing of it, and the generated code, the
        profile and which values carry gradients must know."""
        if kind == "output":  # fx converts the forward's result just before this node
            self.output_spec = tree_structure(self._outer)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not torch.is_grad_enabled() and kind not in ("placeholder", "output"):
            node.meta[MODES] = (("grad", False),)
        if kind not in ("placeholder", "output", "get_attr"):
            node.meta["stack_trace"] = _model_stack()
        return node

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if id(attr_val) in self.assigned:
            return self.assigned[id(attr_val)]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

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


# frames of tracing itself, never the model's code
_ATOMC = str(Path(__file__).resolve().parent.parent)
_TRACING = (str(Path(torch.__file__).resolve().parent / "fx"),
            str(Path(torch.__file__).resolve().parent / "nn" / "modules" / "module.py"), _ATOMC)


def _model_stack() -> str:
    """The frames of the model's code that made a node, as torch.export records them (`File
    "...", line N, in f`, outermost first): codegen names values after what that code calls
    them. fx's own `record_stack_traces` formats whole tracebacks and doubles a trace's
    time. The frames stop at the tracer: whoever called atomc is not the model."""
    lines = []
    frame = sys._getframe(2)
    while frame is not None:
        file = frame.f_code.co_filename
        if lines and (file.startswith(_ATOMC) or (frame.f_code.co_name == "trace"
                                                  and file.startswith(_TRACING[0]))):
            break
        if not file.startswith(_TRACING):
            lines.append(f'  File "{file}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        frame = frame.f_back
    return "\n".join(reversed(lines))


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
    gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    gm.meta[OUTPUT_SPEC] = tracer.output_spec
    return gm


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
    with _quiet_torch_logs(), functions_checked(), conversions_that_change_nothing():
        program = torch.export.export(model, inputs, strict=False)
    gm = program.module()
    # The unlifted module carries pytree and guard plumbing; the compute graph is what we need.
    return gm


def trace(model: nn.Module, inputs: tuple, leaf_types: tuple[type, ...], model_path: Path,
          frontend: str = "auto") -> tuple[fx.GraphModule, str]:
    """(GraphModule, frontend name). `frontend` is "auto", "fx" or "export"."""
    failures: list[str] = []
    value_read = False
    defaults = _defaults_after(model, len(inputs))
    if frontend in ("auto", "fx"):
        try:
            with LayerDropDecided(), distributions_unvalidated():
                return trace_fx(model, leaf_types, len(inputs), defaults), "fx"
        except FINAL as e:
            raise type(e)(f"cannot trace the model in {model_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - fx raises many kinds; all mean "try the next"
            failures.append(f"torch.fx.symbolic_trace: {describe_failure(e, model_path)}")
    if frontend in ("auto", "export"):
        try:
            with LayerDropDecided(), distributions_unvalidated():
                return trace_export(model, inputs), "export"
        except FINAL as e:
            raise type(e)(f"cannot trace the model in {model_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - export raises many kinds; all are reported below
            failures.append(f"torch.export: {describe_failure(e, model_path)}")
            value_read = reads_values(e)
    if value_read:
        # a leaf module would not help: atomc still runs it, on meta tensors, which have no values
        advice = (f". {VALUE_ADVICE[0].upper()}{VALUE_ADVICE[1:]}, in the model and in any "
                  f"module marked as a leaf: meta tensors have no values to read")
    else:
        advice = (". Make the failing line traceable, or mark the module that contains it as a "
                  "leaf (LEAF_MODULES in the model file)")
    raise TraceError(f"cannot trace the model in {model_path}: " + "; ".join(failures) + advice)


VALUE_ADVICE = ("compute without reading tensor values in forward (torch.where or a mask in place "
                "of `if` on a tensor; no .item() or .tolist())")

_VALUE_MESSAGES = ("cannot be called on meta tensors", "Cannot copy out of meta tensor",
                   "data-dependent", "data dependent")


def reads_values(exc: BaseException) -> bool:
    """Whether `exc` says the code read a tensor's value (`if x.sum() > 0`, `.item()`): a trace
    cannot follow that, and meta and fake tensors have no values to give."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException,
                        GuardOnDataDependentSymNode)):
        return True
    return any(m in str(exc) for m in _VALUE_MESSAGES)


def describe_failure(exc: BaseException, model_path: Path, node: fx.Node | None = None) -> str:
    """The exception in one line, with the model file's line it came from: from its traceback,
    or, where that holds none (an operator of a traced graph failed when atomc ran it), from
    the stack `node` was recorded with."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {first}"[:300]
    if "in output, which is not a known type" in first:
        # the usual cause: a Hugging Face model returning its key/value cache
        message += (" [the model returns an object torch.export cannot flatten: return tensors, "
                    "tuples or dicts of them (for Hugging Face models pass use_cache=False)]")
    frames = [(f.filename, f.lineno or 0, f.line or "")
              for f in traceback.extract_tb(exc.__traceback__)]
    if node is not None and not any(_same_file(f[0], model_path) for f in frames):
        frames = _recorded_frames(node)
    return message + _location(frames, model_path)


def _recorded_frames(node: fx.Node) -> list[tuple[str, int, str]]:
    """The model's frames that made a graph node, outermost first, from the stack recorded
    with it (torch.export's `stack_trace`, and symbolic tracing's as atomc records it)."""
    frames = []
    for match in _FRAME.finditer(node.meta.get("stack_trace") or ""):
        file, line = match["file"], int(match["line"])
        frames.append((file, line, linecache.getline(file, line)))
    return frames


def _same_file(filename: str, path: Path) -> bool:
    return Path(filename).resolve() == path.resolve()


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _location(frames: list[tuple[str, int, str]], model_path: Path) -> str:
    """The model file's innermost line among `frames` (outermost first), and the line of a
    library that failed beyond it."""
    where = ""
    for file, line, code in frames:
        if _same_file(file, model_path):
            where = f" (at {model_path.name}:{line}: {code.strip()})"
    # the line that failed, where it is the code of a library the model calls (a Hugging Face
    # model's forward): the model file's own line alone names only the call into it
    libraries = [f for f in frames if not is_internal(f[0])]
    if libraries and not _same_file(libraries[-1][0], model_path):
        file, line, code = libraries[-1]
        where += f" (failed in {_short_path(file)}:{line}: {code.strip()})"
    return where


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    return str(Path(*parts[parts.index("site-packages") + 1:])) if "site-packages" in parts \
        else filename
