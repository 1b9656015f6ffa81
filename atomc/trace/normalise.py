"""Trace, step 2: make a traced GraphModule flat, free of assertions and dtype-generic.

Input: the GraphModule a frontend produced. Output: the same module, edited in place:

- Higher-order operators that only set a mode around a body (`torch.no_grad()` and
  `torch.autocast(...)` regions, which torch.export turns into `wrap_with_set_grad_enabled`
  and `wrap_with_autocast` calls on a nested GraphModule) are inlined. Every inlined node keeps
  the mode it ran under in `node.meta["atomc_modes"]`, outermost first, so that profiling
  sees ordinary operators and codegen writes the region back as a `with` block.
- torch.export's assertions (`_assert_tensor_metadata` after every `.to()`, `_assert_scalar`)
  are dropped: they pin the traced dtype and device and compute nothing.
- `mark_dtype_args` finds the dtype arguments that follow the model's dtype (`x.to(input_dtype)`)
  as opposed to those the model fixes (`x.to(torch.float32)`): torch.export writes both as
  `torch.float32`. A second trace of the model in float64 tells them apart.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

MODES = "atomc_modes"

# Operators that check what export assumed and return nothing anyone reads.
_ASSERTIONS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
               "aten._assert_async.default", "aten._assert_async.msg",
               "aten.sym_constrain_range.default", "aten.sym_constrain_range_for_size.default"}


def _hop(name: str) -> Any:
    return getattr(torch.ops.higher_order, name, None)


def _mode_of(node: fx.Node) -> tuple[tuple, fx.Node, tuple] | None:
    """(mode, body get_attr node, operands) of a mode-setting higher-order call, else None."""
    if node.op != "call_function":
        return None
    if node.target is _hop("wrap_with_set_grad_enabled"):
        enabled, body, *operands = node.args
        return ("grad", bool(enabled)), body, tuple(operands)
    if node.target is _hop("wrap_with_autocast"):
        device_type, dtype, enabled, cache_enabled, body, *operands = node.args
        mode = ("autocast", device_type, dtype, bool(enabled), bool(cache_enabled))
        return mode, body, tuple(operands)
    return None


def inline_modes(gm: fx.GraphModule) -> None:
    """Inline every no_grad/autocast region of `gm` (nested ones too), tagging its nodes."""
    graph = gm.graph
    for node in list(graph.nodes):
        found = _mode_of(node)
        if found is None:
            continue
        mode, body_node, operands = found
        body = getattr(gm, str(body_node.target))
        inline_modes(body)
        _lift_attrs(gm, body)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
        outer = tuple(node.meta.get(MODES, ()))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op in ("placeholder", "output"):
                    continue
                copy = graph.node_copy(inner, val_map.__getitem__)
                copy.meta = dict(inner.meta)
                copy.meta[MODES] = outer + (mode,) + tuple(inner.meta.get(MODES, ()))
                val_map[inner] = copy
        output = next(n for n in body.graph.nodes if n.op == "output")
        results = fx.node.map_arg(output.args[0], val_map.__getitem__)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
        if node.users:  # the tuple itself is used: rebuild it from the inlined results
            node.replace_all_uses_with(results)  # type: ignore[arg-type]
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            if not any(n.op == "get_attr" and n.target == body_node.target for n in graph.nodes):
                delattr(gm, str(body_node.target))
    graph.lint()
    gm.recompile()


def _lift_attrs(gm: fx.GraphModule, body: fx.GraphModule) -> None:
    """Give the body's own attributes (constants of a nested region) a home in `gm`."""
    for node in body.graph.nodes:
        if node.op != "get_attr":
            continue
        value = body
        for part in str(node.target).split("."):
            value = getattr(value, part)
        name, n = str(node.target).replace(".", "_"), 0
        while hasattr(gm, name) and getattr(gm, name) is not value:
            n += 1
            name = f"{str(node.target).replace('.', '_')}_{n}"
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            gm.register_buffer(name, value, persistent=False)
        else:
            setattr(gm, name, value)
        node.target = name


def register_constants(gm: fx.GraphModule) -> None:
    """Tensors torch.export lifted out of forward become non-persistent buffers of `gm`.

    export leaves them as plain attributes; as buffers they move with the module (`.to()`) and
    fx knows what its get_attr nodes read.
    """
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, name, None)
        if (isinstance(value, torch.Tensor) and name not in owner._parameters
                and name not in owner._buffers):
            delattr(owner, name)
            owner.register_buffer(name, value, persistent=False)


def drop_assertions(gm: fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and not node.users and str(node.target) in _ASSERTIONS:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


# ---------------------------------------------------------------------------------------------
# Dtype arguments that follow the model's dtype


def _dtype_slots(node: fx.Node) -> dict[tuple, torch.dtype]:
    """(where, dtype) of every floating dtype constant among a node's arguments."""
    slots: dict[tuple, torch.dtype] = {}

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, torch.dtype):
            if value.is_floating_point:
                slots[path] = value
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, (*path, i))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, (*path, k))

    walk(tuple(node.args), ("args",))
    walk(dict(node.kwargs), ("kwargs",))
    return slots


def mark_dtype_args(gm: fx.GraphModule, values: dict[str, Any], model_dtype: torch.dtype,
                    retrace: Callable[[torch.dtype], fx.GraphModule],
                    ) -> tuple[dict[str, tuple[tuple, ...]], frozenset[str]]:
    """(node name -> argument paths whose dtype is the model's own (it changes with the
    model's), the nodes whose floating value has the model's dtype in either trace).

    `retrace(dtype)` traces the model again with its weights and floating inputs in `dtype`.
    Returns nothing when no argument names `model_dtype` (nothing to tell apart). Raises
    ValueError when the second trace is a different graph: the model takes other paths in
    other dtypes.

    The second set tells a value that follows the weights (`x @ w`) from one the model casts
    itself (`residual.to(torch.float32)`, kept in float32 whatever the weights are): both are
    float32 when a float32 model is traced; torch.export's `val` of each node in the second
    trace says which one changed.

    The two graphs are compared modulo casts that were no-ops when traced: `y = x.to(float32)`
    returns `x` itself for a float32 `x`, and torch.export then records later reads of `x` as
    reads of `y` (a weight cast twice, `w.float()` here and there, reads the weight once). In
    the other dtype the cast is real and the reads are right; `gm` takes them.
    """
    candidates = {n.name: s for n in gm.graph.nodes
                  if (s := {p: d for p, d in _dtype_slots(n).items() if d == model_dtype})}
    if not candidates:
        return {}, frozenset()
    other = torch.float64 if model_dtype != torch.float64 else torch.float32
    second = retrace(other)
    # weights are compared by what they name where they are read (see _repair_aliased_reads):
    # a read through a no-op cast is one get_attr fewer
    mine = [n for n in gm.graph.nodes if n.op != "get_attr"]
    theirs = [n for n in second.graph.nodes if n.op != "get_attr"]
    if len(mine) != len(theirs) or any(
            a.op != b.op or str(a.target) != str(b.target) for a, b in zip(mine, theirs)):
        raise ValueError(f"the model traces to a different graph in {other}")
    _repair_aliased_reads(gm, values, mine, theirs)
    marks: dict[str, tuple[tuple, ...]] = {}
    for a, b in zip(mine, theirs):
        if a.name not in candidates:
            continue
        changed = tuple(p for p in candidates[a.name] if _dtype_slots(b).get(p) == other)
        if changed:
            marks[a.name] = changed
    follows = frozenset(
        a.name for a, b in zip(mine, theirs)
        if getattr(values.get(a.name), "dtype", None) == model_dtype
        and getattr(b.meta.get("val"), "dtype", None) == other)
    return marks, follows


_CASTS = {"aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other",
          "aten._to_copy.default", "aten.type_as.default"}


def _repair_aliased_reads(gm: fx.GraphModule, values: dict[str, Any], mine: list[fx.Node],
                          theirs: list[fx.Node]) -> None:
    """Where the traces disagree on what a node reads, undo reads through no-op casts.

    `mine` and `theirs` are the two graphs' nodes other than get_attr, in step; a get_attr
    read is the same read when it names the same weight."""
    twin = dict(zip(theirs, mine))
    # what each no-op cast read when traced (the repairs below change that): `x.float()` twice
    # on a float32 x records the second cast as reading the first, and a later read of x as
    # reading the second
    source = {n: n.args[0] for n in gm.graph.nodes if _is_noop_cast(n, values)}

    def same(x: fx.Node, y: fx.Node) -> bool:
        if y.op == "get_attr":
            return x.op == "get_attr" and x.target == y.target
        return x is twin.get(y)

    def through_casts(x: fx.Node, y: fx.Node) -> fx.Node | None:
        """The node `x` is a no-op cast (of a no-op cast...) of that `y` names, if any."""
        while x in source and isinstance(source[x], fx.Node):
            x = source[x]
            if same(x, y):
                return x
        return None

    changed = False
    for a, b in zip(mine, theirs):
        reads_a, reads_b = a.all_input_nodes, b.all_input_nodes
        if len(reads_a) != len(reads_b):
            raise ValueError(f"node {a.name} has other inputs in another dtype")
        swaps: dict[fx.Node, fx.Node] = {}
        for x, y in zip(reads_a, reads_b):
            if same(x, y):
                continue
            truth = through_casts(x, y)
            if truth is None:
                raise ValueError(f"node {a.name} reads {x.name} in one dtype and {y.name} in "
                                 f"another")
            swaps[x] = truth
        if swaps:
            a.args = fx.node.map_arg(a.args, lambda n, swaps=swaps: swaps.get(n, n))
            a.kwargs = fx.node.map_arg(a.kwargs, lambda n, swaps=swaps: swaps.get(n, n))
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _is_noop_cast(node: fx.Node, values: dict[str, Any]) -> bool:
    if node.op != "call_function" or str(node.target) not in _CASTS or not node.args:
        return False
    source, result = node.args[0], values.get(node.name)
    before = values.get(source.name) if isinstance(source, fx.Node) else None
    return (isinstance(before, torch.Tensor) and isinstance(result, torch.Tensor)
            and before.dtype == result.dtype)
