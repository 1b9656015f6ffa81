"""Codegen, between cutting and writing: each piece's graph made to read as a person's code.

What the tracer recorded and a person would not write, changed without changing what is
computed:

- `fold_modules`: a torch.nn layer that torch.export traced through (`aten.linear` reading the
  flattened weight `model_layers_0_q_proj_weight`) is called as the layer again
  (`self.q_proj(x)`), as symbolic tracing keeps it, with the original parameter names;
- `drop_no_ops`: `alias`, and a `.to()` that keeps an integer or boolean tensor's dtype and
  device, return their input: their readers read the input;
- `merge_repeats`: an operator computed again from the same inputs (export records
  `torch.arange(16)` once per call that asked for it) is computed once, where the value takes
  no gradient: merging two differentiable reads would sum their gradients in another order (and
  two `.float()` casts' gradients in float32), which is not the model's arithmetic.

The graph keeps its node names: codegen's tables (traced values, dtype arguments, source
names) are keyed by them.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from atomc.codegen.constructors import module_constructor
from atomc.codegen.resolve import Resolver
from atomc.codegen.split import Piece, identifier_for
from atomc.errors import CodegenError
from atomc.profile.ops import INPLACE_MODULE, is_inplace, writes_input, written_in_place
from atomc.trace import TracedModel, grad_values
from atomc.trace.frontends import layer_class
from atomc.trace.normalise import MODES


def tidy(piece: Piece, traced: TracedModel, resolver: Resolver,
         dtype_args: dict[str, tuple[tuple, ...]]) -> None:
    """All of this module's rewrites of one piece, in place."""
    if traced.graph.frontend == "export":
        fold_modules(piece, traced, resolver)
    drop_no_ops(piece, traced, dtype_args)
    merge_repeats(piece, grad_values(traced))
    short_locals(piece, tuple(traced.graph.blocks))
    piece.graph.lint()


# ---------------------------------------------------------------------------------------------
# no-ops and repeats


def _is_no_op(node: fx.Node, traced: TracedModel, dtype_args: dict) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = str(node.target)
    if name == "aten.alias.default":
        return True
    if not name.startswith("aten.to.") or node.name in dtype_args or not node.args:
        return False
    source = node.args[0]
    before = traced.values.get(source.name) if isinstance(source, fx.Node) else None
    after = traced.values.get(node.name)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    if before.is_floating_point() or before.is_complex() or before.dtype != after.dtype:
        return False  # a floating dtype may follow the model's when the package runs
    given = dict(node.kwargs)
    for extra in node.args[1:]:
        if isinstance(extra, torch.dtype):
            given["dtype"] = extra
        elif isinstance(extra, torch.device):
            given["device"] = extra
        elif extra not in (False, None):
            return False
    for key, value in given.items():
        if key == "device" and value not in (None, traced.device) and \
                torch.device(value).type != traced.device.type:
            return False
        if key == "layout" and value not in (None, torch.strided):
            return False
        if key in ("copy", "non_blocking") and value:
            return False
        if key == "memory_format" and value is not None:
            return False
    return True


def drop_no_ops(piece: Piece, traced: TracedModel, dtype_args: dict) -> None:
    graph = piece.graph
    for node in list(graph.nodes):
        if _is_no_op(node, traced, dtype_args):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _key(node: fx.Node) -> Any:
    def freeze(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ("node", value.name)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(freeze(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, freeze(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return ("slice", freeze(value.start), freeze(value.stop), freeze(value.step))
        return (type(value).__name__, repr(value))

    return (node.op, str(node.target), freeze(node.args), freeze(node.kwargs),
            tuple(node.meta.get(MODES, ())))


def merge_repeats(piece: Piece, grads: dict[str, int]) -> None:
    """One node for an ATen operator computed again from the same inputs, where the value
    never takes a gradient (`grads`: atomc.trace.grad_values), neither result is written in place
    and nothing is written in between."""
    graph = piece.graph
    outputs = set(piece.outputs)
    seen: dict[Any, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if _writes(node):
            seen.clear()  # what was read before may differ after
            continue
        target = node.target
        if not (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded not in target.tags):
            continue
        if node.name in grads:  # it requires gradients, now or once written
            continue
        key = _key(node)
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        if node.name in outputs or written_in_place(node) or written_in_place(first):
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)


def _writes(node: fx.Node) -> bool:
    """Whether the node may write a value in place: an in-place operator, an item assignment,
    a module call (a layer may update its buffers) or a function atomc does not know."""
    if is_inplace(node) or node.target is operator.setitem or node.op == "call_module":
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    module = getattr(target, "__module__", None) or ""
    return not (module.startswith(("torch", "_operator", "operator", "math"))
                or target is getattr)


# ---------------------------------------------------------------------------------------------
# torch.nn layers


def _innermost_call(meta: dict) -> tuple[str, str] | None:
    """(call key, module FQN) of the innermost module whose forward made a node."""
    stack = meta.get("nn_module_stack")
    if not stack:
        return None
    key, (fqn, _) = list(stack.items())[-1]
    return key, str(fqn)


def _foldable(module: nn.Module) -> bool:
    """A torch.nn layer without children that takes one input: the layer symbolic tracing
    keeps whole (atomc.trace.frontends.LeafTracer) and constructors can rebuild."""
    if next(module.children(), None) is not None or parametrize.is_parametrized(module):
        return False
    if not layer_class(module).__module__.startswith("torch.nn."):
        return False
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def fold_modules(piece: Piece, traced: TracedModel, resolver: Resolver) -> None:
    """Call each torch.nn layer whose whole forward the piece holds as the layer again."""
    meta = {n.name: n.meta for n in traced.gm.graph.nodes}
    calls: dict[str, list[str]] = {}  # call key -> its node names in the whole graph
    for node in traced.gm.graph.nodes:
        if node.op == "call_function":
            found = _innermost_call(node.meta)
            if found is not None:
                calls.setdefault(found[0], []).append(node.name)
    graph = piece.graph
    groups: list[tuple[str, str, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        found = _innermost_call(meta.get(node.name, {})) if node.op == "call_function" else None
        if found is not None and groups and groups[-1][0] == found[0]:
            groups[-1][2].append(node)
        elif found is not None:
            groups.append((found[0], found[1], [node]))
        else:
            groups.append(("", "", [node]))
    for key, fqn, nodes in groups:
        if not key or [n.name for n in nodes] != calls.get(key):
            continue  # not a layer, or one whose forward the plan cut
        _fold(piece, traced, resolver, fqn, nodes)


def _fold(piece: Piece, traced: TracedModel, resolver: Resolver, fqn: str,
          nodes: list[fx.Node]) -> None:
    try:
        module = traced.model.get_submodule(fqn)
    except AttributeError:
        return
    if not _foldable(module):
        return
    own = {id(t) for t in (*module.parameters(), *module.buffers())}
    group = set(nodes)
    inputs: list[fx.Node] = []
    weights: set[int] = set()
    for node in nodes:
        for x in node.all_input_nodes:
            if x in group:
                continue
            attr = piece.attrs.get(str(x.target)) if x.op == "get_attr" else None
            if attr is not None and id(attr.value) in own:
                weights.add(id(attr.value))
            elif x not in inputs:
                inputs.append(x)
    if len(inputs) != 1 or any(id(p) not in weights for p in module.parameters()):
        return
    last = nodes[-1]
    if any(u not in group for n in nodes[:-1] for u in n.users):
        return
    if len({tuple(n.meta.get(MODES, ())) for n in nodes}) != 1:
        return
    try:
        module_constructor(module, fqn, resolver, set())
    except CodegenError:
        return
    local = next((k for k, (f, m) in piece.modules.items() if m is module), None)
    if local is None:
        local = identifier_for(fqn, piece)
        piece.modules[local] = (fqn, module)
    used = [x for n in nodes for x in n.all_input_nodes if x.op == "get_attr"]
    last.op = "call_module"
    last.target = local
    last.args = (inputs[0],)
    last.kwargs = {}
    last.meta[INPLACE_MODULE] = writes_input(module)
    for node in reversed(nodes[:-1]):
        piece.graph.erase_node(node)
    for attr_node in used:
        if not attr_node.users and attr_node.graph is piece.graph:
            piece.graph.erase_node(attr_node)
            if not any(n.op == "get_attr" and n.target == attr_node.target
                       for n in piece.graph.nodes):
                piece.attrs.pop(str(attr_node.target), None)


# ---------------------------------------------------------------------------------------------
# attribute names


def short_locals(piece: Piece, blocks: tuple[str, ...] = (), root: str = "") -> None:
    """Each layer and weight the piece holds, named by the shortest end of its path that no
    other one shares (`q_proj`, or `layers_0_q_proj` beside `layers_1_q_proj`), never from a
    bare index; a weight with its layer (`norm_weight`). Where the piece holds parts of several
    of the model's repeated `blocks`, what is in a block is named with it (`layers_1_q_proj`
    beside `layers_0_k_proj`). Paths are taken from `root` on (a layer's class names what it
    holds from the layer)."""
    paths = {local: fqn for local, (fqn, _) in piece.modules.items()}
    paths.update({local: attr.fqn for local, attr in piece.attrs.items()})
    if root:
        paths = {local: fqn[len(root) + 1:] if fqn.startswith(root + ".") else fqn
                 for local, fqn in paths.items()}
    owner = {local: next((b for b in blocks if fqn.startswith(b + ".")), "")
             for local, fqn in paths.items()}
    several = len({b for b in owner.values() if b}) > 1

    def candidates(local: str) -> list[str]:
        parts = paths[local].split(".")
        prefix: list[str] = []
        if several and owner[local]:
            block = owner[local].split(".")
            parts = parts[len(block):]
            k = 1
            while k < len(block) and block[-k].isdigit():
                k += 1
            prefix = block[-k:]
        least = 1 if local in piece.modules else 2
        names = []
        for k in range(min(least, len(parts)), len(parts) + 1):
            if not prefix and parts[-k].isdigit() and k < len(parts):
                continue
            names.append(identifier_for(".".join(prefix + parts[-k:]), None))
        return names or [identifier_for(paths[local], None)]

    options = {local: candidates(local) for local in paths}
    pick = dict.fromkeys(paths, 0)
    while True:
        names = {local: options[local][pick[local]] for local in paths}
        counts: dict[str, int] = {}
        for n in names.values():
            counts[n] = counts.get(n, 0) + 1
        moved = False
        for local, n in names.items():
            if counts[n] > 1 and pick[local] + 1 < len(options[local]):
                pick[local] += 1
                moved = True
        if not moved:
            break
    if len(set(names.values())) != len(names):
        return  # paths that differ only in separators: keep split's names
    for node in piece.graph.nodes:
        if node.op in ("call_module", "get_attr") and str(node.target) in names:
            node.target = names[str(node.target)]
    piece.modules = {names[k]: v for k, v in piece.modules.items()}
    attrs = {}
    for local, attr in piece.attrs.items():
        attr.local = names[local]
        attrs[attr.local] = attr
    piece.attrs = attrs
