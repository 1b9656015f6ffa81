"""Codegen's layer classes: identical whole layers of a sub-model written once, as a class.

A model's repeated blocks (`model.layers.0`, `.1`, ...; atomc.trace.graph.find_blocks) run
the same code on weights of the same shapes. Where a sub-model holds two or more of them whole,
each is rendered alone as a class of its own (its layers and weights named from the block, its
inputs and outputs by what the code calls them); the blocks whose classes come out the same,
text for text, are one class, instantiated once per block (`self.layers_0 = DecoderLayer()`)
and called where the block ran. The parameter names keep their path through the instance
(`layers_0.q_proj.weight`), so PARAM_NAMES maps them to the original names as before.

A block is left inline when it is not one piece of straight code in the sub-model, shares a
weight or layer with code outside it, holds a constant (whose value differs per block), or
writes one of its inputs in place.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from torch import fx

from atomc.codegen.names import fresh
from atomc.codegen.split import Attr, Piece, identifier_for
from atomc.codegen.tidy import short_locals
from atomc.profile.ops import INPLACE_MODULE, written_in_place
from atomc.trace.normalise import MODES


@dataclass
class BlockUse:
    """One block called as an instance of a generated class."""

    local: str  # the sub-model's attribute (`layers_0`)
    fqn: str  # the block's FQN in the model
    cls: str  # the class's name
    param_names: dict[str, str]  # local name inside the instance -> original FQN
    param_locals: list[str]  # which of them are parameters


@dataclass
class _Candidate:
    fqn: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    piece: Piece  # the block alone
    text: str = ""
    param_names: dict[str, str] | None = None
    param_locals: list[str] | None = None
    imports: set[str] | None = None


def write_blocks(piece: Piece, traced: Any, op_nodes: dict[str, Any], render: Any,
                 imports: set[str], avoid: set[str]
                 ) -> list[tuple[str, list[str], list[str], list[list[str]]]]:
    """Replace the piece's whole, identical blocks by calls of one class each; return the
    classes as (name, doc lines, `__init__` lines, [forward parameters, forward lines]), and
    add the imports they need to `imports`. Class names avoid the names in `avoid` (the model
    file's helpers the package imports).

    `render(block_piece, block_fqn, names)` renders a block alone, its inputs named by
    `names` (None: as the block's code names them), and returns (`__init__` lines, forward
    parameters, forward lines, PARAM_NAMES, parameter locals, imports). Blocks are compared
    with their inputs named by position, so that a layer reading `embeddings` and one reading
    `hidden_states` are the same class."""
    candidates = [c for c in (_candidate(piece, traced, op_nodes, fqn)
                              for fqn in _whole_blocks(piece, traced)) if c]
    if len(candidates) < 2:
        return []
    for c in candidates:
        by_position = {x.name: f"input_{i}" for i, x in enumerate(c.inputs)}
        init, params, forward, names, locals_, needed = render(c.piece, c.fqn, by_position)
        c.param_names, c.param_locals, c.imports = names, locals_, needed
        c.text = "\n".join([*init, "|", *params, "|", *forward])
    groups: dict[str, list[_Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.text, []).append(c)
    classes = []
    taken = set(piece.modules) | set(piece.attrs)
    class_names: set[str] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        kind = type(traced.model.get_submodule(members[0].fqn)).__name__
        name = fresh(kind, class_names | avoid | {f"Submodel{piece.index}"})
        class_names.add(name)
        doc = [f"{kind} of the model, written once for {', '.join(m.fqn for m in members)}."]
        init, params, forward, *_ = render(members[0].piece, members[0].fqn, None)
        classes.append((name, doc, list(init), [list(params), list(forward)]))
        for member in members:
            local = _attribute(member.fqn, taken)
            taken.add(local)
            _replace(piece, member, local, traced.values)
            piece.blocks[local] = BlockUse(local, member.fqn, name, dict(member.param_names),
                                           list(member.param_locals))
        for member in members:
            imports.update(member.imports or ())
    return classes


def _attribute(fqn: str, taken: set[str]) -> str:
    """The shortest end of the block's path that is a free name (`layers_0`)."""
    parts = fqn.split(".")
    for k in range(1, len(parts) + 1):
        if parts[-k].isdigit() and k < len(parts):
            continue
        name = identifier_for(".".join(parts[-k:]), None)
        if name not in taken:
            return name
    return fresh(identifier_for(fqn, None), taken)


def _whole_blocks(piece: Piece, traced: Any) -> list[str]:
    """The blocks all of whose nodes the piece's node range holds."""
    where: dict[str, list[int]] = {}
    for i, op in enumerate(traced.graph.nodes):
        if op.block:
            where.setdefault(op.block, []).append(i)
    return [b for b, idx in where.items() if piece.start <= min(idx) and max(idx) < piece.stop]


def _candidate(piece: Piece, traced: Any, op_nodes: dict[str, Any],
               fqn: str) -> _Candidate | None:
    graph = piece.graph
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    mine = [n for n in ops if getattr(op_nodes.get(n.name), "block", "") == fqn]
    if not mine:
        return None
    first, last = ops.index(mine[0]), ops.index(mine[-1])
    if ops[first:last + 1] != mine:
        return None  # not one stretch of code
    inside = set(mine)
    inputs: list[fx.Node] = []
    attrs: list[fx.Node] = []
    for n in mine:
        for x in n.all_input_nodes:
            if x in inside:
                continue
            if x.op == "get_attr":
                if x not in attrs:
                    attrs.append(x)
            elif x not in inputs:
                inputs.append(x)
    outputs = [n for n in mine if any(u not in inside for u in n.users)]
    if not outputs:
        return None
    # weights and layers of the block's own, and no constants
    for a in attrs:
        if any(u not in inside for u in a.users):
            return None
        attr = piece.attrs[str(a.target)]
        if not attr.persistent:
            return None
    targets = {str(n.target) for n in mine if n.op == "call_module"}
    if any(n.op == "call_module" and str(n.target) in targets and n not in inside for n in ops):
        return None
    if any(t in piece.blocks for t in targets):
        return None
    fqns = [piece.attrs[str(a.target)].fqn for a in attrs]
    for t in targets:
        module = piece.modules[t][1]
        fqns.extend(f"{piece.modules[t][0]}.{name}" for name, _ in module.named_parameters())
    if len(set(fqns)) != len(fqns):
        return None  # a weight tied inside the block
    block = _alone(piece, fqn, mine, inputs, attrs, outputs)
    if any(written_in_place(ph) for ph in block.graph.nodes if ph.op == "placeholder"):
        return None
    return _Candidate(fqn, mine, inputs, outputs, block)


def _alone(piece: Piece, fqn: str, nodes: list[fx.Node], inputs: list[fx.Node],
           attrs: list[fx.Node], outputs: list[fx.Node]) -> Piece:
    """The block as a piece of its own: its inputs as placeholders, its outputs returned."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta = dict(x.meta)
    block = Piece(piece.index, piece.start, piece.stop, graph, tuple(x.name for x in inputs),
                  tuple(n.name for n in outputs), False)
    for a in attrs:
        attr = piece.attrs[str(a.target)]
        block.attrs[attr.local] = Attr(attr.local, attr.fqn, attr.value, attr.is_buffer,
                                       attr.persistent)
        env[a] = graph.create_node("get_attr", attr.local, name=a.name)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
        if n.op == "call_module":
            block.modules[str(n.target)] = piece.modules[str(n.target)]
    graph.output(tuple(env[o] for o in outputs))
    short_locals(block, root=fqn)
    return block


def _replace(piece: Piece, c: _Candidate, local: str, values: dict[str, Any]) -> None:
    """The block's nodes in the piece become one call of `local`; its output nodes, keeping
    their names, become that call (or the items of its result)."""
    graph = piece.graph
    outputs = set(c.outputs)
    if len(c.outputs) == 1:
        call = c.outputs[0]
    else:
        with graph.inserting_before(c.outputs[0]):
            call = graph.call_module(local, ())
        piece.values[call.name] = tuple(values.get(o.name) for o in c.outputs)
        for k, out in enumerate(c.outputs):
            out.op, out.target, out.args, out.kwargs = "call_function", operator.getitem, \
                (call, k), {}
            out.meta = {**out.meta, MODES: ()}
    call.op, call.target, call.args, call.kwargs = "call_module", local, tuple(c.inputs), {}
    call.meta = {**call.meta, INPLACE_MODULE: False, MODES: ()}
    for n in reversed(c.nodes):
        if n not in outputs:
            graph.erase_node(n)
