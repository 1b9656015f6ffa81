"""GraphModule + values on meta tensors -> OpGraph (the IR the later stages read)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils._pytree import tree_flatten

from atomc.dtypes import dtype_name
from atomc.ir import OpGraph, OpNode, TensorSpec


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in t.shape), dtype_name(t.dtype),
                      int(t.numel() * t.element_size()))


def tensors_in(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


# methods and functions whose result shares its first argument's storage (fx graphs; ATen
# operators say so in their schema)
VIEW_NAMES = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
              "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "flatten",
              "unflatten", "unfold", "diagonal", "as_strided", "chunk", "split", "unbind",
              "movedim", "swapaxes", "contiguous", "__getitem__", "getitem", "real", "imag"}


def target_name(node: fx.Node) -> str:
    if node.op in ("call_function",):
        return fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
    return str(node.target)


# node.meta key: names of the node's inputs whose storage its result shares, as the recorded run
# saw it (views, and modules or functions that return their input: nn.Identity, Dropout(p=0),
# nn.Flatten), so that an in-place write through the result is seen as a write of the input
ALIASES = "atomc_aliases"


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch._C._is_alias_of(a, b)
    except RuntimeError:  # a tensor without storage (sparse, nested): nothing to share
        return False


class ValueRecorder(fx.Interpreter):
    """Runs the graph (on meta tensors for big models) and keeps every node's value; marks in
    `node.meta[ALIASES]` the inputs each result shares storage with."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, Any] = {}
        self.current: fx.Node | None = None  # the node running (or that failed)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        result = super().run_node(n)
        self.values[n.name] = result
        n.meta.pop(ALIASES, None)
        if n.op in ("call_module", "call_function", "call_method"):
            outs = tensors_in(result)
            shared = tuple(a.name for a in n.all_input_nodes
                           if any(shares_storage(o, t) for t in tensors_in(self.env.get(a))
                                  for o in outs))
            if shared:
                n.meta[ALIASES] = shared
        return result


def normalise_get_attrs(gm: fx.GraphModule) -> None:
    """One get_attr per user, placed right before it.

    torch.export hoists every parameter access to the top of the graph, and both frontends
    share one get_attr between users. Either would make a parameter look like an activation
    crossing a cut; next to its user, each sub-model reads its own parameters.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        for user in list(node.users):
            with graph.inserting_before(user):
                copy = graph.get_attr(node.target)
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)
        graph.erase_node(node)
    # export's guard-checking plumbing: takes the inputs, returns nothing, used by nobody
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def find_blocks(model: nn.Module) -> list[str]:
    """FQNs of repeated blocks: children of ModuleList/Sequential containers of one class."""
    blocks: list[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if any(fqn == b or fqn.startswith(b + ".") for b in blocks):
            continue  # a container inside a block: the outer block is the repeat unit
        prefix = f"{fqn}." if fqn else ""
        blocks.extend(f"{prefix}{name}" for name, _ in children)
    return blocks


_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
          *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def is_norm_weight(model: nn.Module, fqn: str) -> bool:
    """True for a parameter of a normalisation layer: torch's own, or a class named *Norm*
    (LlamaRMSNorm, T5LayerNorm, nanoGPT's LayerNorm), whose statistics want full precision."""
    owner_path = fqn.rpartition(".")[0]
    try:
        owner = model.get_submodule(owner_path) if owner_path else model
    except AttributeError:
        return False
    return isinstance(owner, _NORMS) or "Norm" in type(owner).__name__


def build_opgraph(gm: fx.GraphModule, model: nn.Module, values: dict[str, Any], *, model_path: str,
                  config: str | None, batch_size: int, options: dict[str, int],
                  frontend: str) -> OpGraph:
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    params: dict[str, TensorSpec] = {}
    frozen: list[str] = []
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases[fqn] = canonical[id(p)]
        else:
            canonical[id(p)] = fqn
            params[fqn] = tensor_spec(p)
            if not p.requires_grad:
                frozen.append(fqn)
    buffers = {fqn: tensor_spec(b) for fqn, b in model.named_buffers()}
    buffer_ids = {id(b): fqn for fqn, b in model.named_buffers()}
    blocks = find_blocks(model)
    modules = dict(gm.named_modules())

    nodes: list[OpNode] = []
    standardized: set[str] = set()  # weights the graph takes statistics of (full precision)
    for node in gm.graph.nodes:
        value = values.get(node.name)
        outputs = tuple(tensor_spec(t) for t in tensors_in(value)) if node.op != "output" else ()
        param_fqns: list[str] = []
        buffer_fqns: list[str] = []
        module_fqn, module_type, extra = "", "", ""
        if node.op == "call_module":
            mod = modules[str(node.target)]
            module_fqn, module_type = str(node.target), type(mod).__name__
            extra = mod.extra_repr()
            param_fqns = _unique(canonical[id(p)]
                                 for _, p in mod.named_parameters(remove_duplicate=False))
            buffer_fqns = [buffer_ids[id(b)] for b in mod.buffers() if id(b) in buffer_ids]
            standardized.update(canonical[id(p)] for p in normalised_weights(mod))
        else:
            module_fqn, module_type = owner_of(node)
            if node.op == "get_attr":
                attr = _fetch(gm, str(node.target))
                if isinstance(attr, nn.Parameter) or id(attr) in canonical:
                    param_fqns = [canonical[id(attr)]]
                    if _takes_statistics(node) or _scales_a_statistic(node):
                        standardized.add(param_fqns[0])
                elif id(attr) in buffer_ids:
                    buffer_fqns = [buffer_ids[id(attr)]]
        block = next((b for b in reversed(blocks)
                      if module_fqn == b or module_fqn.startswith(b + ".")
                      or (node.op == "get_attr" and str(node.target).startswith(b + "."))), "")
        inputs = tuple(n.name for n in node.all_input_nodes)
        nodes.append(OpNode(
            name=node.name, op=node.op, target=target_name(node), module_fqn=module_fqn,
            module_type=module_type, block=block, inputs=inputs, outputs=outputs,
            param_fqns=tuple(param_fqns), buffer_fqns=tuple(buffer_fqns),
            signature=_signature(node, module_type, extra, values, params, param_fqns),
            cast_to=_constant_dtype(node, outputs),
        ))
    dtypes = {s.dtype for s in params.values()}
    return OpGraph(
        model_path=model_path, config=config, batch_size=batch_size, options=dict(options),
        frontend=frontend, dtype=dtypes.pop() if len(dtypes) == 1 else "mixed", nodes=tuple(nodes),
        params=params, buffers=buffers, aliases=aliases, blocks=tuple(blocks),
        full_precision=tuple(f for f in params
                             if is_norm_weight(model, f) or f in standardized),
        frozen=tuple(frozen) or None,  # None: every weight trains (and hashes as before)
    )


def normalised_weights(layer: nn.Module) -> list[nn.Parameter]:
    """The parameters a weight-normalised or spectral-normalised layer computes its weight
    from (parametrize's originals; the older hooks' weight_g and weight_v, or weight_orig):
    torch takes a norm or a power iteration over them, which wants full precision, and
    spectral norm's vectors, float32 buffers, meet them in one matrix-vector product."""
    found: list[nn.Parameter] = []
    for hook in layer._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)):
            suffixes = ("_g", "_v") if isinstance(hook, WeightNorm) else ("_orig",)
            found += [getattr(layer, hook.name + s) for s in suffixes]
    if parametrize.is_parametrized(layer):
        for chain in layer.parametrizations.values():
            if any(type(p) in (parametrizations._WeightNorm, parametrizations._SpectralNorm)
                   for p in chain):
                found += [p for name, p in chain.named_parameters(recurse=False)
                          if name.startswith("original")]
    return found


# Statistics over a weight's own values (weight standardization in BiT's convolutions, weight
# norm, cosine classifiers' normalize): autocast leaves the weight float32 and takes them in
# float32; over a bfloat16 copy they are off by enough to move the first loss by 1% (BiT).
_STATISTICS = {"batch_norm", "layer_norm", "group_norm", "instance_norm", "native_batch_norm",
               "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
               "native_layer_norm", "native_group_norm", "var_mean", "std_mean", "var", "std",
               "mean", "norm", "vector_norm", "linalg_vector_norm", "linalg_norm", "normalize",
               "rms_norm", "renorm", "_weight_norm", "_weight_norm_interface",
               "norm_except_dim"}
# what carries a weight's values on to a statistic: its views, copies and casts
_CARRIES = VIEW_NAMES | {"_unsafe_view", "clone", "detach", "to", "_to_copy", "float", "double",
                         "half", "bfloat16", "type_as"}


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return ""


def _takes_statistics(node: fx.Node) -> bool:
    """Whether a statistic is taken over `node`'s value, directly or through views of it."""
    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        name = _op_name(user)
        if name in _STATISTICS:
            return True
        if name in _CARRIES:
            todo.extend(user.users)
    return False


# what scales a weight on its way to a statistic's weight or bias (NFNet's `gain * scale`)
_SCALES = {"mul", "div", "truediv", "add", "sub", "neg"}


def _scales_a_statistic(node: fx.Node) -> bool:
    """Whether `node`'s value, through views, casts and scaling, is the weight or bias of a
    statistic (a functional norm's affine parameters; NFNet's gains scale its standardized
    convolution weights). Such a parameter is a norm weight, full precision as a norm layer's
    are: torch's CPU norms take a bfloat16 input with float32 affine parameters, not the
    other way round."""
    todo, seen = [(node, user) for user in node.users], set()
    while todo:
        source, user = todo.pop()
        if (source, user) in seen:
            continue
        seen.add((source, user))
        name = _op_name(user)
        if name in _STATISTICS:
            if any(a is source for a in (*user.args[1:], *user.kwargs.values())):
                return True
        elif name in _CARRIES or name in _SCALES:
            todo.extend((user, u) for u in user.users)
    return False


def _constant_dtype(node: fx.Node, outputs: tuple[TensorSpec, ...]) -> str:
    """The dtype a constant argument of `node` names, where its one output has that dtype in
    the trace (so the argument is what sets it, not, say, a view's reinterpretation)."""
    if node.op not in ("call_function", "call_method") or len(outputs) != 1:
        return ""
    named = {dtype_name(a) for a in (*node.args, *node.kwargs.values())
             if isinstance(a, torch.dtype)}
    return outputs[0].dtype if named == {outputs[0].dtype} else ""


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def owner_of(node: fx.Node) -> tuple[str, str]:
    """Innermost module a non-module node was traced inside (from nn_module_stack)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    fqn, cls = list(stack.values())[-1]
    name = cls if isinstance(cls, str) else cls.__name__
    return str(fqn), name.rsplit(".", 1)[-1]


def _describe_arg(a: Any, values: dict[str, Any]) -> str:
    if isinstance(a, fx.Node):
        v = values.get(a.name)
        if isinstance(v, torch.Tensor):
            return f"T{tuple(v.shape)}:{dtype_name(v.dtype)}"
        return f"V{type(v).__name__}"  # non-tensor values (sizes, devices) do not change cost
    if isinstance(a, (list, tuple)):
        return "(" + ",".join(_describe_arg(x, values) for x in a) + ")"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}={_describe_arg(v, values)}" for k, v in sorted(a.items())) + "}"
    return repr(a)


def _signature(node: fx.Node, module_type: str, extra: str, values: dict[str, Any],
               params: dict[str, TensorSpec], param_fqns: list[str]) -> str:
    """Equal signature, equal cost: target, module hyperparameters, argument shapes, dtypes."""
    parts = [node.op, target_name(node) if node.op != "call_module" else module_type, extra,
             _describe_arg(node.args, values), _describe_arg(node.kwargs, values),
             ",".join(f"{params[f].shape}:{params[f].dtype}" for f in param_fqns if f in params)]
    if node.op in ("placeholder", "output", "get_attr"):
        parts.append(node.name)  # never shared: they carry no compute but name distinct values
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
