"""Codegen, step 1: cut the traced graph where the plan says, with torch.fx `split_module`.

Input: a TracedModel and a Plan (consecutive node ranges). Output: one `Piece` per sub-model,
an fx Graph ready to be rendered as an `nn.Module`:

- its placeholders are the values it receives, in boundary order. Boundaries form a chain:
  sub-model i+1 receives exactly what sub-model i returns, and sub-model 0 receives the
  model's inputs. A value read further on (a skip connection, an early model output) is passed
  through the sub-models in between, so a runtime only ever hands one sub-model's outputs to
  the next, and a pipeline stage only talks to its neighbours;
- parameters and buffers are its own (`get_attr` nodes), never inputs;
- it returns the values the next sub-model receives, or, for the last, the model's output in
  the original structure (tensor, tuple, dict...).

Two adjustments to the plan's node ranges keep boundaries simple; neither moves compute:
operators whose results nothing reads and that have no side effects are dropped, and an
indexing (`getitem`) of a tuple-valued result follows the producer, so that tensors, not
tuples of tensors, cross cuts.
"""

from __future__ import annotations

import copy
import keyword
import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from atomc.errors import CodegenError
from atomc.ir import Plan
from atomc.profile.ops import INPLACE_MODULE, is_inplace, writes_input
from atomc.trace import TracedModel
from atomc.trace.frontends import OUTPUT_SPEC


@dataclass
class Attr:
    """A parameter or buffer a sub-model reads directly (export graphs, or `self.w` in forward)."""

    local: str  # attribute name in the generated class
    fqn: str  # canonical FQN in the original model
    value: torch.Tensor  # the traced model's tensor (meta or real): shape, dtype, requires_grad
    is_buffer: bool
    persistent: bool  # False: a constant (non-persistent buffer, lifted tensor): no state dict


@dataclass
class Piece:
    index: int
    start: int  # node range of the plan (original graph indices)
    stop: int
    graph: fx.Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # for the last piece: the model output's leaves, flattened
    is_last: bool
    # local -> (FQN, module)
    modules: dict[str, tuple[str, nn.Module]] = field(default_factory=dict)
    attrs: dict[str, Attr] = field(default_factory=dict)  # get_attr target -> attribute
    structure: Any = None  # the last piece's output as the model returns it (traced graph's nodes)
    # local -> a whole layer called as an instance of a class written for it (codegen.blocks)
    blocks: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # traced values of nodes codegen made


def assign_nodes(traced: TracedModel, plan: Plan) -> dict[str, int]:
    """Node name -> sub-model index, from the plan's ranges (checked to cover the graph)."""
    nodes = list(traced.gm.graph.nodes)
    subs = plan.submodels
    if not subs:
        raise CodegenError("the plan has no sub-models; give a plan written by `atomc partition`")
    expected = 0
    for sub in subs:
        if sub.start != expected or sub.stop <= sub.start:
            raise CodegenError(
                f"sub-model {sub.index} covers nodes {sub.start}..{sub.stop - 1}, expected a "
                f"non-empty range starting at {expected}: a plan's sub-models are consecutive "
                f"ranges covering the graph; regenerate the plan")
        expected = sub.stop
    if expected != len(nodes):
        raise CodegenError(f"the plan's sub-models cover {expected} nodes but the traced graph has "
                           f"{len(nodes)}; the plan was made for another graph: regenerate it")
    part: dict[str, int] = {}
    for i, sub in enumerate(subs):
        for node in nodes[sub.start:sub.stop]:
            part[node.name] = i
    for node in nodes:
        if node.op == "placeholder" and part[node.name] != 0:
            raise CodegenError(f"input {node.name} is in sub-model {part[node.name]}; the model's "
                               f"inputs must be in sub-model 0: cut after the last input node")
    return part


def _is_container(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor)


def _canonical_names(model: nn.Module) -> tuple[dict[int, str], dict[int, str]]:
    params: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), fqn)
    buffers: dict[int, str] = {}
    for fqn, b in model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), fqn)
    return params, buffers


def _fetch(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _is_persistent(gm: nn.Module, path: str) -> bool:
    owner_path, _, name = path.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    return name not in getattr(owner, "_non_persistent_buffers_set", set())


def output_structure(gm: fx.GraphModule, output: fx.Node) -> Any:
    """The model's output as the original forward returns it, with fx Nodes as leaves.

    torch.export graphs return a flat list and rebuild the structure with a pytree spec;
    symbolic traces return the structure itself, its dicts made plain: the tracer recorded
    the classes (an OrderedDict, a dict class of the model's) in the module's meta.
    """
    value = output.args[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        leaves = list(value) if isinstance(value, (tuple, list)) else [value]
        return tree_unflatten(leaves, info.out_spec)
    spec = gm.meta.get(OUTPUT_SPEC)
    if spec is not None:
        leaves = tree_flatten(value)[0]
        if spec.num_leaves == len(leaves):
            return tree_unflatten(leaves, spec)
    return value


def _leaves(structure: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(structure, lambda n: found.append(n) or n)
    return list(dict.fromkeys(found))


def split_plan(traced: TracedModel, plan: Plan) -> list[Piece]:
    part = assign_nodes(traced, plan)
    num = len(plan.submodels)
    gm, graph = _working_graph(traced, part)

    output_node = next(n for n in graph.nodes if n.op == "output")
    structure = output_structure(traced.gm, output_node)
    if any(leaf.op == "get_attr" for leaf in _leaves(structure)):
        # split_module cannot return a parameter no partition reads; the last piece does
        output_node.args = (fx.node.map_arg(output_node.args[0],
                                            lambda n: None if n.op == "get_attr" else n),)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in graph.nodes}

    _check_name_clashes(graph, part)
    qualnames: dict[str, str] = {}
    split = split_module(gm, traced.model, lambda n: part[n.name], qualname_map=qualnames,
                         keep_original_order=True, keep_original_node_name=True)
    live = _live_at_cuts(graph, part, output_node, num)
    cut = _Split(gm, traced.model, split, qualnames, by_name, *_canonical_names(traced.model))

    pieces: list[Piece] = []
    for k, sub in enumerate(plan.submodels):
        inputs = tuple(n.name for n in placeholders) if k == 0 else tuple(live[k - 1])
        is_last = k == num - 1
        new = fx.Graph()
        env: dict[str, fx.Node] = {}
        for name in inputs:
            env[name] = new.placeholder(name)
            env[name].meta = dict(cut.by_name[name].meta)
        piece = Piece(k, sub.start, sub.stop, new, inputs, (), is_last)
        if hasattr(split, f"submod_{k}"):
            _copy_submodule(cut, piece, env)
        if is_last:
            for leaf in _leaves(structure):  # a parameter returned as it is
                if leaf.op == "get_attr" and leaf.name not in env:
                    env[leaf.name] = cut.own_attr(new, piece, leaf.name, str(leaf.target))
            result = fx.node.map_arg(structure, lambda n, env=env: env[n.name])
            piece.structure = structure  # map_arg keeps tuples, lists and dicts, not their classes
            piece.outputs = tuple(n.name for n in _leaves(structure))
        else:
            piece.outputs = tuple(live[k])
            result = tuple(env[name] for name in live[k])
        new.output(result)
        new.lint()
        pieces.append(piece)
    return pieces


def _working_graph(traced: TracedModel, part: dict[str, int]) -> tuple[fx.GraphModule, fx.Graph]:
    """A copy of the traced graph to cut (the traced graph stays as the profile saw it), with
    getitems moved to their producers' sub-models in `part` and dead operators dropped."""
    with warnings.catch_warnings():  # torch's own pytree spec copy warns about its own API
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(traced.gm.graph)
    gm = fx.GraphModule(traced.gm, graph, traced.gm.__class__.__name__)
    values = traced.values

    for node in graph.nodes:  # getitem on a tuple-valued result follows its producer
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], fx.Node)
                and _is_container(values.get(node.args[0].name))
                and node.args[0].op != "placeholder"):
            part[node.name] = part[node.args[0].name]
    _drop_dead(graph)
    graph.lint()
    return gm, graph


def _live_at_cuts(graph: fx.Graph, part: dict[str, int], output_node: fx.Node,
                  num: int) -> list[list[str]]:
    """The chain: the values that cross each cut, in graph order. A value is live at cut k
    (between k and k+1) when produced at or before k and read after k. Placeholders count as
    produced by sub-model 0."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last_use: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        uses = [part[u.name] for u in node.users if u.op != "output"]
        if output_node in node.users:
            uses.append(num - 1)
        if uses:
            last_use[node.name] = max(uses)
    live: list[list[str]] = []
    for k in range(num - 1):
        names = [name for name, last in last_use.items() if part[name] <= k < last]
        live.append(sorted(names, key=order.__getitem__))
    return live


@dataclass
class _Split:
    """What every piece is built from: `split_module`'s result, and the names and tensors of
    the model it was cut from."""

    gm: fx.GraphModule  # the working graph's module
    model: nn.Module
    split: fx.GraphModule
    qualnames: dict[str, str]  # split_module's qualname map: submod_k.target -> original FQN
    by_name: dict[str, fx.Node]  # the working graph's nodes
    canon_params: dict[int, str]
    canon_buffers: dict[int, str]

    def own_attr(self, graph: fx.Graph, piece: Piece, name: str, target: str) -> fx.Node:
        return _own_attr(graph, piece, name, target, self.gm, self.model, self.canon_params,
                         self.canon_buffers)


def _copy_submodule(cut: _Split, piece: Piece, env: dict[str, fx.Node]) -> None:
    """Copy split_module's `submod_k` into the piece's graph: its inputs from the chain (`env`)
    or the piece's own parameters and buffers, its leaf modules under local names."""
    new = piece.graph
    submod_name = f"submod_{piece.index}"
    submod = getattr(cut.split, submod_name)
    val_map: dict[fx.Node, fx.Node] = {}
    for ph in [n for n in submod.graph.nodes if n.op == "placeholder"]:
        if ph.name in env:
            val_map[ph] = env[ph.name]
            continue
        original = cut.by_name[ph.name]
        if original.op != "get_attr":
            raise AssertionError(f"split_module gave {submod_name} an input {ph.name} "
                                 f"outside the chain")  # a bug in the live-set computation
        val_map[ph] = cut.own_attr(new, piece, ph.name, str(original.target))
    new.graph_copy(submod.graph, val_map)
    locals_of: dict[str, str] = {}
    for node in new.nodes:
        env.setdefault(node.name, node)
        if node.op == "call_module":
            target = str(node.target)
            if target not in locals_of:
                fqn = cut.qualnames.get(f"{submod_name}.{target}", target)
                locals_of[target] = identifier_for(target, piece)
                piece.modules[locals_of[target]] = (fqn, _fetch(submod, target))
            node.meta[INPLACE_MODULE] = writes_input(_fetch(submod, target))
            node.target = locals_of[target]
        elif node.op == "get_attr" and str(node.target) not in piece.attrs:
            raise CodegenError(f"node {node.name} reads {node.target}, a module attribute "
                               f"that is not a tensor; atomc cannot generate code for it")


def _drop_dead(graph: fx.Graph) -> None:
    """Remove operators whose results nothing reads, unless they act on something.

    Not fx's eliminate_dead_code: it drops in-place methods (`x.mul_(2)`) whose result is not
    read although what they changed is. Module calls are kept (they may update buffers), and
    so are random operators (they advance the generator).
    """
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or is_inplace(node):
            continue
        if node.op == "call_function" and node.is_impure():
            continue
        graph.erase_node(node)


def _own_attr(graph: fx.Graph, piece: Piece, node_name: str, path: str, gm: fx.GraphModule,
              model: nn.Module, canon_params: dict[int, str],
              canon_buffers: dict[int, str]) -> fx.Node:
    """A get_attr node in the piece for a tensor split_module made an input.

    Parameters and persistent buffers are weights the state dict carries. Non-persistent
    buffers (`position_ids`, rotary `inv_freq`) and constants the tracer lifted out of forward
    (the index tensor of `x[:, [-1]]`) are not in any state dict: they become constants of the
    package, stored with their values.
    """
    try:
        value = _fetch(gm, path)
    except AttributeError:
        raise CodegenError(
            f"node {node_name} reads {path}, which the traced module does not hold; this is a bug "
            f"in atomc's tracing: please report it with the model file") from None
    if not isinstance(value, torch.Tensor):
        raise CodegenError(f"node {node_name} reads {path}, a {type(value).__name__}; atomc "
                           f"generates code for tensors only (parameters, buffers and tensor "
                           f"constants)")
    if id(value) in canon_params:
        fqn, is_buffer, persistent = canon_params[id(value)], False, True
    elif id(value) in canon_buffers:
        fqn, is_buffer = canon_buffers[id(value)], True
        # torch.export's module registers every buffer as persistent; the model knows
        persistent = _is_persistent(gm, path) and _is_persistent(model, fqn)
    else:  # a constant the tracer lifted out of forward: named by its place in the traced module
        fqn, is_buffer, persistent = path, True, False
    attr = next((a for a in piece.attrs.values() if a.fqn == fqn), None)
    if attr is None:
        local = identifier_for(fqn, piece)
        attr = piece.attrs[local] = Attr(local, fqn, value, is_buffer, persistent)
    node = graph.create_node("get_attr", attr.local, name=node_name)
    return node


_MODULE_ATTRIBUTES = set(dir(nn.Module)) | {"INPUTS", "OUTPUTS"}


def identifier_for(path: str, piece: Piece | None) -> str:
    """`h.0.attn.c_attn` -> `h_0_attn_c_attn`: a free attribute name for the generated class
    (free among the piece's, when one is given)."""
    base = re.sub(r"\W", "_", path.replace(".", "_"))
    if not base or base[0].isdigit():
        base = f"m_{base}"
    if keyword.iskeyword(base) or base in _MODULE_ATTRIBUTES:
        base += "_"
    if piece is None:
        return base
    taken = set(piece.modules) | set(piece.attrs)
    name, n = base, 1
    while name in taken:
        name = f"{base}_{n}"
        n += 1
    return name


def _check_name_clashes(graph: fx.Graph, part: dict[str, int]) -> None:
    """split_module names a module `a.b_c` and `a_b.c` alike; refuse rather than mix them up."""
    seen: dict[tuple[int, str], str] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        key = (part[node.name], str(node.target).replace(".", "_"))
        other = seen.setdefault(key, str(node.target))
        if other != node.target:
            raise CodegenError(f"modules {other} and {node.target} would both be named {key[1]} in "
                               f"sub-model {key[0]}; rename one of them in the model")
