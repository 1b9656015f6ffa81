"""Run one traced operator alone: its module or function, with inputs of the recorded shapes.

Profiling each operator alone, with its own freshly materialised inputs and parameters, is
what lets a model larger than the device be profiled (ATOM III-D): only one operator's
tensors are on the device at a time. On the meta device the same code counts FLOPs and the
bytes autograd saves without allocating anything.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from atomc.trace.graph import ALIASES, VIEW_NAMES, tensors_in
from atomc.trace.normalise import MODES

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift}


@dataclass
class OpCall:
    """A ready-to-run operator: call `fn()`; `grad_inputs` are what its backward differentiates."""

    fn: Callable[[], Any]
    grad_inputs: list[torch.Tensor]
    params: list[torch.Tensor]
    input_bytes: int
    param_bytes: int


INPLACE_MODULE = "atomc_inplace"  # node.meta of a call_module node in a graph without its modules


def writes_input(module: nn.Module) -> bool:
    """torch.nn's activations and dropouts built with inplace=True write their input
    (torchvision's ResNets and most CNNs use nn.ReLU(inplace=True))."""
    return getattr(module, "inplace", None) is True


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_module":
        if INPLACE_MODULE in node.meta:  # a copied graph (codegen's pieces) has no modules
            return bool(node.meta[INPLACE_MODULE])
        gm = node.graph.owning_module
        return gm is not None and writes_input(gm.get_submodule(str(node.target)))
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if isinstance(node.target, torch._ops.OpOverload):  # ATen: the schema says what it writes
            return any(a.alias_info is not None and a.alias_info.is_write
                       for a in node.target._schema.arguments)
        name = getattr(node.target, "__name__", "")
        return (name.endswith("_") and not name.startswith("_")) or _inplace_argument(node)
    return False


def _inplace_argument(node: fx.Node) -> bool:
    """A function called with `inplace=True`, by keyword or by position: torch.nn.functional's
    relu, dropout, hardtanh and the like (torchvision's DenseNet: `F.relu(x, inplace=True)`)."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or other arguments
        return False
    return bound.arguments.get("inplace") is True


def _writes(node: fx.Node, value: fx.Node) -> bool:
    """Whether in-place `node` writes `value` (its first argument, or a written ATen one)."""
    if isinstance(node.target, torch._ops.OpOverload):
        args = dict(zip((a.name for a in node.target._schema.arguments), node.args))
        args.update(node.kwargs)
        return any(a.alias_info is not None and a.alias_info.is_write and args.get(a.name) is value
                   for a in node.target._schema.arguments)
    return _first_input(node) is value


def _first_input(node: fx.Node) -> Any:
    """The value an in-place method, function or module writes: its first argument, passed
    by position or (a module called as `self.act(input=x)`) by keyword."""
    if node.args:
        return node.args[0]
    return next(iter(node.kwargs.values()), None)


def _is_view_of(node: fx.Node, value: fx.Node) -> bool:
    """Whether `node`'s result may be `value`'s storage: the recorded run saw it so (see
    atomc.trace.graph.ALIASES: nn.Identity, Dropout(p=0), nn.Flatten), or its operator returns
    a view of its first argument."""
    if value.name in node.meta.get(ALIASES, ()):
        return True
    if not node.args or node.args[0] is not value:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None \
            and not returns[0].alias_info.is_write
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in VIEW_NAMES | _CASTS


# conversions return their input itself when it already has the dtype: the traced dtype's run
# may see a copy where a run in another dtype gets the input back
_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16"}


def written_in_place(node: fx.Node) -> bool:
    """Whether an operator of the graph writes `node`'s value in place, directly or through a
    view of it (`x.add_(y)`, `x[:, 0] = 0`, `x.view(-1).mul_(2)`)."""
    seen, todo = set(), [node]
    while todo:
        value = todo.pop()
        seen.add(value)
        for user in value.users:
            if is_inplace(user) and _writes(user, value):
                return True
            if user.op == "call_function" and user.target is operator.setitem \
                    and user.args[0] is value:
                return True
            if user not in seen and _is_view_of(user, value):
                todo.append(user)
    return False


def _materialise(value: Any, device: torch.device, seed: int,
                 constants: frozenset[int] = frozenset()) -> Any:
    """A tensor of the same shape, strides and dtype on `device`; other values kept.

    Strides matter: `.contiguous()` on a transposed input copies, on a contiguous one it
    does nothing. Integer tensors are zeros, which are valid indices for any lookup.
    """
    gen_device = device if device.type != "meta" else None

    def make(v: Any) -> Any:
        if isinstance(v, torch.device):
            return device
        if not isinstance(v, torch.Tensor):
            return v
        # Filled through a compact base: expanded inputs (stride 0) share memory between
        # elements, and in-place fills refuse such tensors.
        shape, stride = tuple(v.shape), tuple(v.stride())
        span = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride))
        base = torch.empty(span, dtype=v.dtype, device=device)
        if gen_device is not None:
            if v.dtype.is_floating_point or v.dtype.is_complex:
                base.normal_(generator=_generator(gen_device, seed))
            elif v.dtype == torch.bool:
                base.fill_(True)
            else:
                base.zero_()
        t = base.as_strided(shape, stride).detach()  # a leaf of its own, not a view of base
        if v.dtype.is_floating_point and id(v) not in constants:
            t.requires_grad_(True)
        return t

    return tree_map(make, value)


def materialise(value: Any, device: torch.device, seed: int = 0,
                constants: frozenset[int] = frozenset()) -> Any:
    """`value` (tensors anywhere inside it) made real on `device`, shapes and strides kept;
    floating tensors whose id is not in `constants` require gradients."""
    return _materialise(value, device, seed, constants)


_GENERATORS: dict[str, torch.Generator] = {}


def _generator(device: torch.device, seed: int) -> torch.Generator:
    key = str(device)
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device)
    return _GENERATORS[key].manual_seed(seed)


def materialise_module(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of a (possibly meta) module with real, initialised storage on `device`."""
    mod = copy.deepcopy(module)
    if device.type == "meta":
        return mod.to(device)
    mod = mod.to_empty(device=device)
    with torch.no_grad():
        for sub in mod.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
        for p in mod.parameters(recurse=False):  # parameters no reset_parameters covers
            if not torch.isfinite(p).all():
                p.normal_(0, 0.02)
    return mod


_DETACH = {torch.ops.aten.detach.default, torch.detach, torch.Tensor.detach, "detach"}


def grad_flow(gm: fx.GraphModule, values: dict[str, Any]) -> dict[str, bool]:
    """Node name -> whether its floating outputs carry gradients in training.

    Model inputs and trainable parameters do; buffers and constants do not (BatchNorm's
    running statistics), nor what a no_grad region or `detach` computes, nor a value computed
    only from values that do not (a router's `topk` indices made float and counted with
    `histc`: autograd refuses such an operator in its timed backward). Computed once per graph.
    """
    cached = gm.meta.get("atomc_grad_flow")
    if cached is not None and cached[0] is values:
        return cached[1]
    flows: dict[str, bool] = {}
    for node in gm.graph.nodes:
        value = values.get(node.name)
        floating = any(t.is_floating_point() for t in tensors_in(value))
        if node.op == "placeholder":
            flows[node.name] = floating
        elif node.op == "get_attr":
            flows[node.name] = isinstance(value, nn.Parameter) and value.requires_grad
        elif node.op == "output":
            continue
        else:
            grad_modes = [m[1] for m in node.meta.get(MODES, ()) if m[0] == "grad"]
            target = node.target if node.op != "call_method" else str(node.target)
            off = (grad_modes and not grad_modes[-1]) or target in _DETACH
            flows[node.name] = floating and not off and (
                node.op == "call_module"  # its own parameters
                or any(flows.get(n.name, False) for n in node.all_input_nodes))
    gm.meta["atomc_grad_flow"] = (values, flows)
    return flows


def build_call(gm: fx.GraphModule, node: fx.Node, values: dict[str, Any], device: torch.device,
               seed: int = 0) -> OpCall:
    """Prepare `node` to run alone on `device` with inputs shaped as in `values`."""
    def arg_value(n: fx.Node) -> Any:
        return values[n.name]

    # inputs that carry no gradient in training take none here (see grad_flow)
    flows = grad_flow(gm, values)
    still = frozenset(id(t) for n in node.all_input_nodes if not flows.get(n.name, False)
                      for t in tensors_in(values[n.name]))
    args = _materialise(fx.node.map_arg(node.args, arg_value), device, seed, still)
    kwargs = _materialise(fx.node.map_arg(node.kwargs, arg_value), device, seed + 1, still)
    params: list[torch.Tensor] = []
    if node.op == "call_module":
        module = materialise_module(gm.get_submodule(str(node.target)), device)
        params = [p for p in module.parameters() if p.requires_grad]
        target: Callable[..., Any] = module
    elif node.op == "call_method":
        method = str(node.target)

        def target(self_arg: Any, *a: Any, **k: Any) -> Any:
            return getattr(self_arg, method)(*a, **k)
    else:
        target = node.target  # type: ignore[assignment]
    inputs = tensors_in((args, kwargs))
    grad_inputs = [t for t in inputs if t.requires_grad] + params
    clone_first = is_inplace(node) and bool(args or kwargs)

    def fn() -> Any:
        if clone_first and args:
            first, *rest = args
            return target(first.clone(), *rest, **kwargs)
        if clone_first:  # its input passed by keyword (see _first_input)
            key = next(iter(kwargs))
            return target(*args, **{**kwargs, key: kwargs[key].clone()})
        return target(*args, **kwargs)

    return OpCall(
        fn=fn, grad_inputs=grad_inputs, params=params,
        input_bytes=sum(t.numel() * t.element_size() for t in inputs),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
    )


def differentiable_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tensors_in(out) if t.requires_grad and t.grad_fn is not None]


def backward_fn(call: OpCall, outputs: list[torch.Tensor]) -> Callable[[], Any] | None:
    """The operator's backward on fixed output gradients, repeatable (graph retained)."""
    targets = [t for t in call.grad_inputs if t.requires_grad]
    if not outputs or not targets:
        return None
    grads = [torch.ones_like(t) for t in outputs]

    def fn() -> Any:
        return torch.autograd.grad(outputs, targets, grads, retain_graph=True, allow_unused=True)

    return fn


@dataclass
class MetaStats:
    """What an operator costs regardless of the device: FLOPs and bytes."""

    fwd_flops: int
    bwd_flops: int
    output_bytes: int  # outputs that are new storage (views cost nothing)
    saved_bytes: int  # tensors autograd keeps, parameters excluded
    input_bytes: int
    param_bytes: int
    has_backward: bool


def analyse(gm: fx.GraphModule, node: fx.Node, values: dict[str, Any]) -> MetaStats:
    """FLOPs and saved bytes of `node`, on meta tensors."""
    meta = torch.device("meta")
    call = build_call(gm, node, values, meta)
    param_ids = {id(p) for p in call.params}
    inputs = [t for t in call.grad_inputs if id(t) not in param_ids]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in param_ids and id(t) not in param_ids:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    with torch.enable_grad(), FlopCounterMode(display=False) as fwd_counter, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call.fn()
    outs = tensors_in(out)
    output_bytes = sum(t.numel() * t.element_size() for t in outs
                       if not any(torch._C._is_alias_of(t, i) for i in inputs))
    grad_outs = differentiable_outputs(out)
    bwd = backward_fn(call, grad_outs)
    bwd_flops = 0
    if bwd is not None:
        with FlopCounterMode(display=False) as bwd_counter:
            bwd()
        bwd_flops = bwd_counter.get_total_flops()
    return MetaStats(
        fwd_flops=fwd_counter.get_total_flops(), bwd_flops=bwd_flops, output_bytes=output_bytes,
        saved_bytes=sum(saved.values()), input_bytes=call.input_bytes, param_bytes=call.param_bytes,
        has_backward=bwd is not None,
    )
