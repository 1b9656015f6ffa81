"""Stage 1, trace: a model file -> torch.fx GraphModule and its OpGraph IR.

Public: `trace_model(path, config=None, batch_size=1, options=None, ...) -> TracedModel`.
Big models are built on the meta device and every node's output is computed on meta
tensors, so a 175B-parameter model traces in seconds without allocating its weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

from atomc.device import names_cpu
from atomc.dtypes import cast_floating
from atomc.errors import ModelFileError, TraceError
from atomc.ir import OpGraph
from atomc.trace.fake import all_faked, faked_on
from atomc.trace.frontends import VALUE_ADVICE, describe_failure, reads_values, trace
from atomc.trace.graph import (
    ValueRecorder,
    build_opgraph,
    normalise_get_attrs,
    owner_of,
    tensors_in,
)
from atomc.trace.load import call_with_options, load_model_file
from atomc.trace.normalise import (
    MODES,
    drop_assertions,
    inline_modes,
    mark_dtype_args,
    register_constants,
)

__all__ = [
    "TracedModel",
    "buffer_values",
    "build_and_inputs",
    "constant_values",
    "dtype_args",
    "dtype_values",
    "grad_values",
    "load_model_file",
    "model_dtype",
    "parameters_on_meta",
    "requires_grad_at",
    "runs_on_for",
    "trace_model",
]


@dataclass
class TracedModel:
    """What tracing produced; torch objects live here, never in the IR."""

    graph: OpGraph
    gm: fx.GraphModule
    model: nn.Module
    inputs: tuple
    values: dict[str, Any]  # node name -> value computed on `device` (meta by default)
    module: ModuleType  # the imported model file
    device: torch.device
    leaf_types: tuple[type, ...] = ()
    train: bool = True
    runs_on: str | None = "cpu"  # the device type a meta-device model's code saw (atomc.trace.fake)
    # node name -> argument paths whose dtype follows the model's (see `dtype_args`)
    _dtype_args: dict[str, tuple[tuple, ...]] | None = field(default=None, repr=False)
    _grad_values: dict[str, int] | None = field(default=None, repr=False)  # see `grad_values`
    _dtype_values: frozenset[str] | None = field(default=None, repr=False)  # see `dtype_values`


def build_and_inputs(path: str | Path, config: str | None, batch_size: int, options: dict[str, int],
                     device: str | torch.device = "meta") -> tuple[ModuleType, nn.Module, tuple]:
    """Import the model file, build the model and its example inputs on `device`."""
    p = Path(path)
    module = load_model_file(p)
    if batch_size < 1:
        raise ModelFileError(f"batch size {batch_size} is not positive; give --batch-size 1 or "
                             f"more")
    with torch.device(device):
        try:
            model = call_with_options(module.build_model, (config,), options, p)
        except ModelFileError as on_meta:
            if torch.device(device).type != "meta":
                raise
            try:
                model = _built_with_values(module, config, options, p)
            except ModelFileError as on_cpu:
                raise ModelFileError(f"{on_meta}; built again on the CPU with its parameters "
                                     f"on meta: {on_cpu}") from None
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"{p}: build_model() returned {type(model).__name__}, expected an "
                                 f"nn.Module")
        inputs = call_with_options(module.example_inputs, (model, batch_size), options, p)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple) or not tensors_in(inputs):
        raise ModelFileError(f"{p}: example_inputs() returned {type(inputs).__name__}, expected a "
                             f"tuple of tensors (the model's positional inputs)")
    return module, model, inputs


def _built_with_values(module: ModuleType, config: str | None, options: dict[str, int],
                       path: Path) -> nn.Module:
    """build_model() for a constructor that reads tensor values, which the meta device has not
    (timm's `[x.item() for x in torch.linspace(0, rate, depth)]`): built on the CPU with every
    parameter sent to meta as it is registered, then moved to meta whole."""
    with torch.device("cpu"), parameters_on_meta():
        model = call_with_options(module.build_model, (config,), options, path)
    return model.to("meta") if isinstance(model, nn.Module) else model


def trace_model(path: str | Path, config: str | None = None, batch_size: int = 1,
                options: dict[str, int] | None = None, *, device: str | torch.device = "meta",
                frontend: str = "auto", leaf_modules: tuple[type, ...] = (),
                train: bool = True, runs_on: str | None = "cpu") -> TracedModel:
    """Trace the model of a model file; `train` traces in training mode (dropout on).

    `runs_on` ("cpu" or "cuda") is the device type the model's code sees when it is traced on
    the meta device: the one its generated code will run on (see `runs_on_for`).
    """
    p = Path(path)
    options = dict(options or {})
    module, model, inputs = build_and_inputs(p, config, batch_size, options, device)
    model.train(train)
    leaf_types = tuple(leaf_modules) + tuple(getattr(module, "LEAF_MODULES", ()))
    with faked_on(model, inputs, runs_on) as faked:
        gm, used = _trace_graph(model, faked.inputs, leaf_types, p, frontend)
        recorder = ValueRecorder(gm)
        versions = {name: w._version for name, w in gm.named_parameters(remove_duplicate=False)}
        try:
            with torch.no_grad(), faked.running(), _buffers_kept(model, gm):
                recorder.run(*faked.inputs)
        except Exception as e:
            raise TraceError(_run_failure(e, recorder.current, gm, leaf_types, p, device)) from e
        _refuse_weights_changed_in_forward(gm, versions, p)
    faked.unfake(gm)
    values = faked.to_meta(recorder.values)
    graph = build_opgraph(gm, model, values, model_path=str(p), config=config,
                          batch_size=batch_size, options=options, frontend=used)
    where = torch.device(device)
    return TracedModel(graph, gm, model, inputs, values, module, where, leaf_types, train,
                       runs_on if where.type == "meta" else where.type)


def _run_failure(exc: Exception, node: fx.Node | None, gm: fx.GraphModule,
                 leaf_types: tuple[type, ...], path: Path, device: str | torch.device,
                 how: str = "") -> str:
    """One line for a traced graph that did not run: the operator, what failed where, and
    advice that fits: marking a module as a leaf does not help when it reads tensor values, nor
    when the module already is one."""
    what = describe_failure(exc, path, node)
    name, leaf = "", False
    if node is not None and node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        name, leaf = type(module).__name__, bool(leaf_types) and isinstance(module, leaf_types)
    elif node is not None:
        name = owner_of(node)[1]  # the module whose forward the failing line is in
    at = f" at graph node {node.name}" if node is not None else ""
    if name:
        at += f" ({name}, a leaf module)" if leaf else f" (in {name})"
    kind = torch.device(device).type
    head = f"the traced graph of {path} did not run {how}on {kind} tensors{at}: {what}"
    if reads_values(exc):
        return (f"{head}; it reads a tensor's value, which meta tensors (atomc traces and "
                f"profiles on them, leaf modules included) do not have: {VALUE_ADVICE}")
    if leaf:
        return (f"{head}; a leaf module still runs on {kind} tensors: make "
                f"its forward run on them (every operator it calls needs a meta kernel), or "
                f"leave it out of LEAF_MODULES to trace through it")
    if name:
        return (f"{head}; mark {name} as a leaf (LEAF_MODULES in the model "
                f"file) to run it whole, or make the failing line run on meta tensors")
    return f"{head}; make the failing line run on meta tensors"


def runs_on_for(device: str | None) -> str:
    """The device type a profile's or a plan's device name (cpu, cuda:0 (NVIDIA ...), a
    hardware profile's name: a GPU) stands for; None: where this machine would measure."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if names_cpu(device) else "cuda"


@contextlib.contextmanager
def _buffers_kept(*modules: nn.Module) -> Iterator[None]:
    """Undo what one recorded run writes into buffers (BatchNorm's running statistics and
    `num_batches_tracked`): the model keeps the state its file built, as if never run."""
    saved = [(b, b.clone()) for m in modules for b in m.buffers()]
    try:
        yield
    finally:
        for buf, value in saved:
            buf.copy_(value)


def _trace_graph(model: nn.Module, inputs: tuple, leaf_types: tuple[type, ...], path: Path,
                 frontend: str) -> tuple[fx.GraphModule, str]:
    gm, used = trace(model, inputs, leaf_types, path, frontend)
    _refuse_gradients_in_forward(gm, path)
    inline_modes(gm)
    register_constants(gm)
    drop_assertions(gm)
    normalise_get_attrs(gm)
    return gm, used


def _refuse_weights_changed_in_forward(gm: fx.GraphModule, versions: dict[str, int],
                                       path: Path) -> None:
    """A forward that writes a parameter in place (nn.Embedding(max_norm=...) renormalises the
    rows it looks up) would train apart from the model: the swap runtime keeps each weight's
    master in host memory and updates it there, so the write to the device copy is lost."""
    changed = [name for name, w in gm.named_parameters(remove_duplicate=False)
               if w._version != versions.get(name, w._version)]
    if changed:
        raise TraceError(
            f"the forward of the model in {path} changes parameter(s) {', '.join(changed)} in "
            f"place (nn.Embedding's max_norm renormalises the rows it looks up, for one); the "
            f"swap runtime keeps every weight's master copy in host memory and updates it "
            f"there, so the change would be lost and training would drift from the model's "
            f"own: drop the in-place change (max_norm=None), or renormalise the weights "
            f"between optimizer steps")


_GRADIENT_CALLS = (torch.autograd.grad, torch.autograd.backward)


def _refuse_gradients_in_forward(gm: fx.GraphModule, path: Path) -> None:
    """A forward that differentiates itself (a gradient penalty's torch.autograd.grad) cannot be
    cut: each sub-model's backward is the runtime's, one sub-model at a time."""
    for node in gm.graph.nodes:
        if ((node.op == "call_function" and node.target in _GRADIENT_CALLS)
                or (node.op == "call_method" and node.target == "backward")):
            what = getattr(node.target, "__qualname__", None) or str(node.target)
            raise TraceError(
                f"the forward of the model in {path} computes a gradient itself ({what} at "
                f"graph node {node.name}, e.g. a gradient penalty); atomc cuts the forward into "
                f"sub-models whose backward its runtime runs one at a time, and does not "
                f"support a forward that differentiates itself (nor profiles one inside a leaf "
                f"module): train this model without the in-forward gradient, or without atomc")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of the model's weights have (float32 for a fresh model)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.get_default_dtype()


def dtype_args(traced: TracedModel) -> dict[str, tuple[tuple, ...]]:
    """Node name -> argument paths (("args", 1), ("kwargs", "dtype")) whose dtype is the model's.

    torch.export records `x.to(input_dtype)` and `x.to(torch.float32)` alike when the model
    traced in float32; generated code must keep the first generic and the second fixed. The
    model is traced a second time, on the meta device in float64, and the dtype arguments that
    changed with it are the generic ones (on the meta device, as the command line traces,
    the second trace costs no memory). symbolic_trace graphs keep `x.dtype` as a node, so
    their constants are the model's own. Raises TraceError when the model traces to another
    graph in another dtype (Python control flow on dtypes).
    """
    if traced._dtype_args is not None:
        return traced._dtype_args
    if traced.graph.frontend != "export":
        traced._dtype_args, traced._dtype_values = {}, frozenset()
        return traced._dtype_args
    g = traced.graph
    path = Path(g.model_path)
    if not path.exists() and getattr(traced.module, "__file__", None):
        path = Path(traced.module.__file__)

    def retrace(dtype: torch.dtype) -> fx.GraphModule:
        rng = torch.get_rng_state()
        try:
            # on the traced device: export drops no-op copies (`.contiguous()`) by device
            _, model, inputs = build_and_inputs(path, g.config, g.batch_size, dict(g.options),
                                                traced.device)
            cast_floating(model, dtype).train(traced.train)
            inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                           else x for x in inputs)
            with faked_on(model, inputs, traced.runs_on) as faked:
                gm, _ = _trace_graph(model, faked.inputs, traced.leaf_types, path, "export")
            faked.unfake(gm)
            return gm
        finally:
            torch.set_rng_state(rng)

    try:
        traced._dtype_args, traced._dtype_values = mark_dtype_args(
            traced.gm, traced.values, model_dtype(traced.model), retrace)
    except ValueError as e:
        raise TraceError(f"{path}: {e}: generated code could only run in the dtype it was traced "
                         f"in; remove Python branches on dtypes from forward, or mark the module "
                         f"that has them as a leaf (LEAF_MODULES)") from e
    return traced._dtype_args


def dtype_values(traced: TracedModel) -> frozenset[str]:
    """The nodes whose floating value has the model's dtype in any dtype the model runs in (a
    weight-less sub-model takes its `dtype` from such an input, not from a value the model
    casts to float32 itself); empty where no argument follows the model's dtype (`dtype_args`
    is empty, and generated code reads no `dtype`)."""
    dtype_args(traced)
    assert traced._dtype_values is not None
    return traced._dtype_values


class _GradRecorder(fx.Interpreter):
    """Runs the graph with autograd on, each node under the grad mode of its region (MODES),
    and notes from which node on each value requires gradients. `device`: what a meta device
    named in the graph stands for (the device type the trace ran its fakes on: strides, and so
    which views work, follow that device's kernels)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device):
        super().__init__(gm)
        self.device = device
        self.grad_since: dict[str, int] = {}
        self.current: fx.Node | None = None
        self._position = -1
        # floating values that do not require gradients yet: a later in-place write of a value
        # that does (`out[:, t] = h` into a `zeros_like`) makes them, and views of them, require
        # one from that node on
        self._waiting: dict[str, list[torch.Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        self._position += 1
        grad = [m[1] for m in n.meta.get(MODES, ()) if m[0] == "grad"]
        with torch.set_grad_enabled(grad[-1] if grad else True):
            result = super().run_node(n)
        tensors = tensors_in(result)
        if any(t.requires_grad for t in tensors):
            self.grad_since[n.name] = -1  # from the start: before every cut the value crosses
        else:
            floating = [t for t in tensors if t.is_floating_point() or t.is_complex()]
            if floating:
                self._waiting[n.name] = floating
        for name, waiting in list(self._waiting.items()):
            if name != n.name and any(t.requires_grad for t in waiting):
                self.grad_since[name] = self._position
                del self._waiting[name]
        return result

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)

        def on_device(a: Any) -> Any:
            # plain containers only: map_aggregate would rebuild a torch.return_types value
            # (max(dim=...)'s values and indices) that getattr reads next as a plain tuple
            if isinstance(a, torch.device) and a.type == "meta":
                return self.device
            if type(a) is tuple:
                return tuple(on_device(x) for x in a)
            if isinstance(a, list):  # fx's immutable_list is a list
                return [on_device(x) for x in a]
            if isinstance(a, dict):
                return {k: on_device(v) for k, v in a.items()}
            return a

        return on_device(args), on_device(kwargs)


def grad_values(traced: TracedModel) -> dict[str, int]:
    """Node name -> -1 where its value requires gradients when the model trains from the node
    that makes it on; the position (in the graph's node order) of the in-place write from
    which on it does, where it is made without and written later; absent where it never
    does. A value's maker may run in a later sub-model than its range says (the items of a
    tuple are taken where the tuple is made), an in-place write never does. What
    autograd itself says when the traced graph runs once with gradients on (each node under its
    region's grad mode, the parameters trainable as the model's are, the inputs as the model
    file gives them), on fake tensors, so that no weight is allocated or written.

    A runtime makes a value that crosses a cut an autograd leaf; it takes a gradient exactly
    when the value requires one at that cut (`requires_grad_at`). A value made without one
    can come to require one later: `out = torch.zeros_like(x)` filled by `out[:, t] = h` step
    by step requires one from the first write on, so a cut between writes hands a gradient
    back. A router's expert counts (`histc` of the chosen experts, float, computed from
    integers), what a no_grad region or `detach` computes and comparisons never do, and a leaf
    that required one would be refused by the integer `cumsum` that reads it (autograd has no
    integer gradients). Asking autograd, not a list of operators, keeps the answer right for
    every operator and custom Function.
    """
    if traced._grad_values is not None:
        return traced._grad_values
    gm = traced.gm
    path = Path(getattr(traced.module, "__file__", None) or traced.graph.model_path)
    recorder = None
    try:
        with torch.random.fork_rng(devices=[]), \
                all_faked(gm, traced.inputs, traced.runs_on) as (mode, device, inputs), mode:
            recorder = _GradRecorder(gm, device)
            recorder.run(*inputs)
    except Exception as e:
        node = recorder.current if recorder is not None else None
        raise TraceError(_run_failure(e, node, gm, traced.leaf_types, path, traced.device,
                                      "with autograd ")) from e
    traced._grad_values = recorder.grad_since
    return traced._grad_values


def requires_grad_at(grads: dict[str, int], name: str, cut: int) -> bool:
    """Whether value `name`, crossing the cut before node position `cut` (every node before it
    has run), requires gradients there, from `grad_values`."""
    return grads.get(name, cut) < cut


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device and their buffers real.

    Buffers such as `position_ids` or rotary `inv_freq` are computed in constructors from the
    configuration; building the model on the CPU with every parameter sent to meta as it is
    registered gives their values at the cost of the buffers alone (the parameters' storage is
    allocated untouched and freed, and their initialisation runs on meta).
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def buffer_values(traced: TracedModel, fqns: list[str]) -> dict[str, torch.Tensor]:
    """Real values (on the CPU) of the model's buffers `fqns`, also for a model traced on meta.

    The model is built again on the CPU with its parameters on meta, which gives the buffers
    its constructor computes from the configuration. A constructor that computes a buffer on
    the device of a weight it built before (a shifted-window attention mask made with
    `device=self.qkv.weight.device`) makes it on meta again; such buffers are taken from a
    build with real weights on the CPU (the host holds the weights when training anyway).
    """
    buffers = dict(traced.model.named_buffers(remove_duplicate=False))
    if all(buffers[f].device.type != "meta" for f in fqns):
        return {f: buffers[f].detach().cpu() for f in fqns}
    model, _ = _built_on_cpu(traced, weights=False)
    built = dict(model.named_buffers(remove_duplicate=False))
    if any(built[f].device.type == "meta" for f in fqns):
        model, _ = _built_on_cpu(traced, weights=True)
        built = dict(model.named_buffers(remove_duplicate=False))
    return {f: _with_values(built[f], f"buffer {f}", traced) for f in fqns}


def _built_on_cpu(traced: TracedModel, weights: bool) -> tuple[nn.Module, tuple]:
    """The traced model and its inputs built again on the CPU, under the RNG state it found;
    `weights=False` keeps every parameter on meta (see parameters_on_meta)."""
    g = traced.graph
    path = Path(getattr(traced.module, "__file__", None) or g.model_path)
    with torch.random.fork_rng(devices=[]), (
            contextlib.nullcontext() if weights else parameters_on_meta()):
        _, model, inputs = build_and_inputs(path, g.config, g.batch_size, dict(g.options), "cpu")
    return model, inputs


def _with_values(t: torch.Tensor, what: str, traced: TracedModel) -> torch.Tensor:
    if t.device.type == "meta":
        path = getattr(traced.module, "__file__", None) or traced.graph.model_path
        raise TraceError(f"{what} of the model in {path} is on the meta device even when the "
                         f"model is built on the CPU with real weights, so atomc cannot store "
                         f"its values; compute it in the constructor on the CPU or on the "
                         f"device of a weight, not on a fixed 'meta' device")
    return t.detach()


def constant_values(traced: TracedModel, names: list[str]) -> dict[str, torch.Tensor]:
    """Values of tensors torch.export lifted out of forward (`x[:, [-1]]`'s index), by name.

    A trace on the meta device creates them on meta, without values. The model is built again
    on the CPU with its parameters on meta (tensors its constructor computes, such as Meta
    llama's complex rotary frequencies kept as a plain attribute, get their values) and
    exported with uninitialised weights: export reads only their shapes, so their pages are
    reserved but never written. A tensor the constructor computes on the device of a weight
    is meta in that build too; it is taken from a build with real weights.
    """
    values = {n: _fetch_attr(traced.gm, n) for n in names}
    if all(v.device.type != "meta" for v in values.values()):
        return {n: v.detach() for n, v in values.items()}
    path = Path(getattr(traced.module, "__file__", None) or traced.graph.model_path)
    found: dict[str, torch.Tensor] = {}
    for weights in (False, True):
        model, inputs = _built_on_cpu(traced, weights)
        if not weights:
            model.to_empty(device="cpu")
        model.train(traced.train)
        inputs = tuple(torch.zeros_like(x, device="cpu") if isinstance(x, torch.Tensor) else x
                       for x in inputs)
        with torch.random.fork_rng(devices=[]):
            gm, _ = _trace_graph(model, inputs, traced.leaf_types, path, "export")
        for n in names:
            try:
                found[n] = _fetch_attr(gm, n).detach()
            except AttributeError:
                raise TraceError(f"{path}: the constant {n} of the meta-device trace is not in a "
                                 f"CPU trace of the model; register it as a buffer of the "
                                 f"model") from None
        if all(v.device.type != "meta" for v in found.values()):
            break
    return {n: _with_values(v, f"the constant {n}", traced) for n, v in found.items()}


def _fetch_attr(root: Any, target: str) -> Any:
    for part in target.split("."):
        root = getattr(root, part)
    return root
