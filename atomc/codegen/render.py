"""Codegen, step 2: render each split piece as a readable `nn.Module` with Jinja2 templates.

Input: the pieces of `split.split_plan` and the TracedModel. Output: Python source text per
sub-model, the package `__init__.py`, and the list of the model file's helpers (functions and
classes the graph calls) that `check.copy_helpers` brings into the package.

The jobs live in their own modules: `tidy` rewrites each piece's graph as a person would write
it (layers, no no-ops), `blocks` turns identical whole layers into one class, `names` names
values after the model's code, `lower` writes ATen calls as Python, `resolve` names functions
and classes, `literals` writes constants, `constructors` rebuilds leaf modules, `statements`
writes each sub-model's `__init__` body and `forward`; this module fills the templates with
them.
"""

from __future__ import annotations

import importlib.resources
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import jinja2
import torch
from torch import nn

from atomc import __version__
from atomc.codegen.blocks import write_blocks
from atomc.codegen.literals import boundary_spec, py_literal
from atomc.codegen.names import RESERVED, SourceNames, fresh, identifier, same_value
from atomc.codegen.resolve import Resolver
from atomc.codegen.split import Piece
from atomc.codegen.statements import PieceRenderer
from atomc.codegen.tidy import tidy
from atomc.ir import OpGraph, Plan
from atomc.trace import TracedModel, dtype_args, grad_values, requires_grad_at


@dataclass
class SubmodelSource:
    index: int
    class_name: str
    module_name: str  # submodel_0
    text: str
    param_names: dict[str, str]  # local -> canonical FQN (parameters and persistent buffers)
    param_locals: list[str]  # which of param_names are parameters
    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]
    constants: dict[str, torch.Tensor]  # FQN -> traced value of the constants it holds


def _environment() -> jinja2.Environment:
    root = importlib.resources.files("atomc.templates")
    loader = jinja2.FunctionLoader(lambda name: (root / name).read_text(encoding="utf-8"))
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, autoescape=False,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def _block_inputs(block: Piece, module: nn.Module, source: SourceNames,
                  taken: set[str]) -> dict[str, str]:
    """A layer class's parameters, named as the layer's code names them: the first as its
    forward's first parameter (`hidden_states`, `x`), the others as the model's code calls
    them, or after their first reader when that reads them as another form of the same value
    (`cos.unsqueeze(1)` is `cos`)."""
    try:
        first = next(iter(inspect.signature(module.forward).parameters), None)
    except (TypeError, ValueError):
        first = None
    names: dict[str, str] = {}
    for i, node in enumerate(n for n in block.graph.nodes if n.op == "placeholder"):
        reader = next(iter(node.users), None)
        base = source.base.get(node.name) or identifier(node.name)
        if i == 0 and first and first.isidentifier() and first not in taken:
            base = first
        elif reader is not None and reader.args and reader.args[0] is node \
                and same_value(reader) and reader.name in source.base:
            base = source.base[reader.name]
        names[node.name] = fresh(base, taken)
        taken = taken | {names[node.name]}
    return names


def _class_source(name: str, doc: list[str], init: list[str], forward: list[list[str]]) -> str:
    """A layer's class (codegen.blocks), ahead of the sub-model's."""
    params, body = forward
    text = textwrap.fill(" ".join(doc), width=90, break_long_words=False,
                         break_on_hyphens=False).replace("\n", "\n    ")
    lines = [f"class {name}(nn.Module):", f'    """{text}"""', "",
             "    def __init__(self) -> None:", "        super().__init__()",
             *[f"        {line}" for line in init], "",
             f"    def forward(self{''.join(', ' + p for p in params)}):",
             *[f"        {line}" if line else "" for line in body]]
    return "\n".join(lines) + "\n\n\n"


def paragraphs(*texts: str, width: int = 100) -> str:
    """Docstring paragraphs within `width` columns (a line break in a text is kept); the
    first line leaves room for the docstring's opening quotes."""
    out = "\n\n".join("\n".join(textwrap.fill(line, width=width, break_long_words=False,
                                               break_on_hyphens=False)
                                 for line in text.split("\n")) for text in texts)
    first, _, rest = out.partition("\n")
    if len(first) + 3 > width:
        first = textwrap.fill(first, width=width, initial_indent='"""', break_long_words=False,
                              break_on_hyphens=False).removeprefix('"""')
    return first + ("\n" + rest if rest else "")


def _summary(piece: Piece, graph: OpGraph) -> str:
    """What a sub-model computes: its blocks and top-level modules, partial ones marked."""
    nodes = graph.nodes
    totals: dict[str, int] = {}
    for op in nodes:
        key = op.block or op.module_fqn.split(".")[0]
        if key and op.op not in ("placeholder", "output", "get_attr"):
            totals[key] = totals.get(key, 0) + 1
    mine: dict[str, int] = {}
    for op in nodes[piece.start:piece.stop]:
        key = op.block or op.module_fqn.split(".")[0]
        if key and op.op not in ("placeholder", "output", "get_attr"):
            mine[key] = mine.get(key, 0) + 1
    parts = [k if mine[k] == totals[k] else f"{k} (part)" for k in mine]
    return ", ".join(parts) if parts else "no modules"


def render_submodel(piece: Piece, traced: TracedModel, plan: Plan, plan_hash: str,
                    resolver: Resolver, helper_names: set[str], env: jinja2.Environment,
                    source: SourceNames, boundary: dict[str, str]) -> SubmodelSource:
    tidy(piece, traced, resolver, dtype_args(traced))
    op_nodes = {op.name: op for op in traced.graph.nodes}

    def render_block(block: Piece, fqn: str, names: dict[str, str] | None) -> tuple:
        if names is None:
            names = _block_inputs(block, traced.model.get_submodule(fqn), source,
                                  set(RESERVED) | helper_names)
        r = PieceRenderer(block, traced, plan, resolver, helper_names, dtype_args(traced),
                          source, names, block=fqn)
        init, param_names, param_locals = r.constructor()
        params, forward = r.forward(op_nodes)
        return init, params, forward, param_names, param_locals, r.imports

    block_imports: set[str] = set()
    classes = write_blocks(piece, traced, op_nodes, render_block, block_imports,
                           set(helper_names) | set(resolver.helpers))
    renderer = PieceRenderer(piece, traced, plan, resolver, helper_names, dtype_args(traced),
                             source, boundary)
    renderer.imports |= block_imports
    init_lines, param_names, param_locals = renderer.constructor()
    params, forward_lines = renderer.forward(op_nodes)
    helpers = sorted(resolver.helpers)
    if helpers:
        renderer.imports.add(f"from ._helpers import {', '.join(helpers)}")
    num = len(plan.submodels)
    values = traced.values
    grads = grad_values(traced)
    # a value filled in place across the piece (`out[:, t] = h`) may take a gradient at its
    # end and none at its start: each side says what holds at its own cut
    inputs = {boundary[name]: boundary_spec(values.get(name),
                                            requires_grad_at(grads, name, piece.start))
              for name in piece.inputs}
    outputs = {boundary[name]: boundary_spec(values.get(name),
                                             requires_grad_at(grads, name, piece.stop))
               for name in piece.outputs}
    config = f"config {plan.config}, " if plan.config is not None else ""
    options = "".join(f", {k} {v}" for k, v in plan.options.items())
    header = paragraphs(
        f"Sub-model {piece.index} of {num} of {plan.model_path} ({config}batch size "
        f"{plan.batch_size}{options}).",
        f"Nodes {piece.start}..{piece.stop - 1} of the traced graph; computes "
        f"{_summary(piece, traced.graph)}.\nGenerated by atomc {__version__} from plan "
        f"{plan_hash} (graph {plan.graph_hash}, {traced.graph.frontend} frontend).")
    text = env.get_template("submodel.py.jinja").render(
        header=header,
        classes="".join(_class_source(*c) for c in classes),
        class_name=f"Submodel{piece.index}",
        is_last=piece.is_last,
        imports="\n".join(sorted(renderer.imports)),
        inputs_literal=py_literal(tuple(boundary[n] for n in piece.inputs), indent=4),
        outputs_literal=py_literal(tuple(boundary[n] for n in piece.outputs), indent=4),
        init_lines=init_lines,
        params=params,
        forward_lines=forward_lines,
    )
    return SubmodelSource(piece.index, f"Submodel{piece.index}", f"submodel_{piece.index}", text,
                          param_names, param_locals, inputs, outputs, renderer.constants)


def render_package_init(subs: list[SubmodelSource], traced: TracedModel, plan: Plan, plan_hash: str,
                        env: jinja2.Environment) -> str:
    graph = traced.graph
    holders: dict[str, list[tuple[int, str]]] = {}
    for sub in subs:
        for local in sub.param_locals:
            holders.setdefault(sub.param_names[local], []).append((sub.index, local))
    tied = {fqn: h for fqn, h in holders.items() if len({i for i, _ in h}) > 1}
    covered = {fqn for sub in subs for fqn in sub.param_names.values()}
    original_names = [name for name, _ in _state_dict_names(traced.model)
                      if graph.aliases.get(name, name) in covered]
    aliases = {a: c for a, c in graph.aliases.items() if c in covered}
    plan_info = {
        "plan_hash": plan_hash,
        "graph_hash": plan.graph_hash,
        "profile_hash": plan.profile_hash,
        "model_path": plan.model_path,
        "config": plan.config,
        "batch_size": plan.batch_size,
        "options": dict(plan.options),
        "frontend": graph.frontend,
        "accum": plan.accum,
        "activations": plan.activations,
        "device": plan.device,
        "capacity_bytes": plan.capacity_bytes,
        "node_ranges": [[s.start, s.stop] for s in plan.submodels],
        "atomc_version": __version__,
        "transfer_dtype": plan.transfer_dtype,
        "autocast": plan.autocast,
    }
    if any(s.kept_bytes or s.sent_bytes for s in plan.submodels):
        # activations="auto": bytes of heavy operators' outputs each sub-model keeps and sends
        plan_info["activation_quotas"] = [[s.kept_bytes, s.sent_bytes] for s in plan.submodels]
    tensors = [{"inputs": s.inputs, "outputs": s.outputs} for s in subs]
    params = {fqn for sub in subs for local, fqn in sub.param_names.items()
              if local in sub.param_locals}
    full_precision = sorted(params & set(graph.full_precision))
    config = f"config {plan.config}, " if plan.config is not None else ""
    header = paragraphs(f"{len(subs)} sub-models of {plan.model_path} ({config}batch size "
                        f"{plan.batch_size}), generated by atomc {__version__}.")
    return env.get_template("package_init.py.jinja").render(
        header=header,
        batch_size=plan.batch_size,
        plan_hash=plan_hash,
        accum=plan.accum,
        activations=plan.activations,
        frontend=graph.frontend,
        submodels=[(s.module_name, s.class_name) for s in subs],
        model_inputs=py_literal(tuple(n.name for n in graph.nodes if n.op == "placeholder")),
        boundaries=py_literal(tensors),
        plan=py_literal(plan_info),
        param_names=py_literal([s.param_names for s in subs]),
        tied=py_literal(tied),
        aliases=py_literal(aliases),
        original_names=py_literal(tuple(original_names)),
        full_precision=py_literal(tuple(full_precision)),
        state_dict_versions=py_literal(_state_dict_versions(traced.model)),
    )


def _state_dict_versions(model: nn.Module) -> dict[str, int]:
    """The modules whose state-dict format is not version 1 (torchvision's MNASNet refuses a
    state dict without its version), as torch's state_dict() records them."""
    metadata = getattr(model.state_dict(keep_vars=True), "_metadata", {})
    return {prefix: m["version"] for prefix, m in metadata.items()
            if m.get("version", 1) != 1}


def _state_dict_names(model: nn.Module) -> list[tuple[str, Any]]:
    """The original model's state-dict names in its own order (aliases of tied weights included)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()]
