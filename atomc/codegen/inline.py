"""Codegen's statement plan for one sub-model's forward: which operators are written inside
the expression that reads them (as the model's code has them), which shape reads are written
where they are used, which tuples are unpacked, and the local name of each value a statement
binds. atomc.codegen.statements writes the statements from it.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from atomc.codegen.lower import OPERATOR_SYMBOLS, UNARY_SYMBOLS
from atomc.codegen.names import BOUND, RESERVED, SourceNames, fresh, identifier
from atomc.codegen.split import Piece
from atomc.profile.ops import is_inplace
from atomc.trace.normalise import MODES

# torch.nn layers whose forward computes from its input and weights alone, changing nothing
_PURE_MODULES = (nn.Linear, nn.Bilinear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                 nn.modules.conv._ConvNd, nn.Identity, nn.Flatten, nn.Unflatten, nn.GELU, nn.SiLU,
                 nn.ReLU, nn.ReLU6, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LogSoftmax, nn.LeakyReLU,
                 nn.ELU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.GLU,
                 nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                 nn.modules.pooling._AdaptiveAvgPoolNd, nn.Upsample, nn.PixelShuffle)
_RANDOM_METHODS = {"bernoulli", "multinomial", "normal", "random", "uniform", "exponential",
                   "geometric", "cauchy", "log_normal"}
_RANDOM_FUNCTIONS = {"rand", "randn", "randint", "randperm", "bernoulli", "multinomial",
                     "normal", "poisson", "rand_like", "randn_like", "randint_like", "dropout",
                     "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                     "feature_alpha_dropout", "rrelu", "gumbel_softmax"}


class StatementPlan:
    """How each operator of `piece` is written (see `_plan`); `names` then names the values."""

    def __init__(self, piece: Piece, values: Mapping[str, Any], source: SourceNames):
        self.piece = piece
        self.values = values  # node name -> traced value
        self.source = source  # the names the model's code gives its values
        self.inlined: dict[fx.Node, fx.Node] = {}  # node -> the reader it is written inside
        self.repeated: set[fx.Node] = set()  # shape reads written where they are used
        self.unpacked: dict[fx.Node, list[fx.Node | None]] = {}  # tuple -> its items' nodes
        self.statements = self._plan()  # the nodes written as statements, in order

    def _plan(self) -> list[fx.Node]:
        """Decide how each operator is written; return the nodes that are statements.

        A value read once, by the next part of the same source statement, is written inside
        its reader's expression (`hidden_states.pow(2).mean(-1, keepdim=True)`), as the model's
        code has it, unless writing it later would read something changed in place in between,
        or it draws random numbers. A shape or dtype read (`x.shape`) is written where it is
        used. A tuple whose items are all taken out is unpacked (`q, k, v = ...split(...)`).
        """
        nodes = list(self.piece.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        ops = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
        for node in ops:
            items = self._unpack_items(node)
            if items is not None:
                self.unpacked[node] = items
        taken = {item for items in self.unpacked.values() for item in items if item is not None}
        for node in ops:
            if node in self.unpacked or node in taken:
                continue
            if self._repeatable(node):
                self.repeated.add(node)
                continue
            user = self._inline_user(node, nodes, order)
            if user is not None:
                self.inlined[node] = user
        return [n for n in ops if n not in self.inlined and n not in self.repeated
                and n not in taken]

    def _unpack_items(self, node: fx.Node) -> list[fx.Node | None] | None:
        value = self.values.get(node.name)
        if not isinstance(value, (tuple, list)) or not 1 < len(value) <= 8 or not node.users:
            return None
        items: list[fx.Node | None] = [None] * len(value)
        for user in node.users:
            if not (user.op == "call_function" and user.target is operator.getitem
                    and user.args[0] is node and isinstance(user.args[1], int)
                    and not user.kwargs and 0 <= user.args[1] < len(value)
                    and items[user.args[1]] is None and user.users):
                return None
            items[user.args[1]] = user
        if all(item is None or (len(item.users) == 1 and self.source.same_statement(
                item, next(iter(item.users))) and next(iter(item.users)).op != "output")
               for item in items):
            return None  # each item is read once, in its statement: `x.shape[1]` there
        return items

    def _repeatable(self, node: fx.Node) -> bool:
        """A shape, dtype or device read of a named value, written where it is used."""
        if not node.args or not isinstance(node.args[0], fx.Node):
            return False
        source = node.args[0]
        if source in self.inlined or source in self.repeated or any(
                u.op == "output" for u in node.users):
            return False
        if node.op == "call_function" and node.target is builtins.getattr:
            return len(node.args) == 2 and node.args[1] in ("shape", "dtype", "device", "ndim")
        if node.op == "call_method":
            return str(node.target) in ("size", "dim") and len(node.args) <= 2 and not node.kwargs
        return node.op == "call_function" and str(node.target) == "aten.sym_size.int"

    def _inline_user(self, node: fx.Node, nodes: list[fx.Node],
                     order: dict[fx.Node, int]) -> fx.Node | None:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if user.op not in ("call_function", "call_method", "call_module"):
            return None
        uses = [a for a in nested_items((user.args, user.kwargs)) if a is node]
        if len(uses) != 1 or (user.target is operator.setitem and user.args[0] is node):
            return None
        if not self.source.same_statement(node, user):
            return None
        if node.meta.get(MODES, ()) != user.meta.get(MODES, ()) or not self._pure(node):
            return None
        if self._limits_follow(user, node):
            return None  # `torch.finfo(x.dtype).min` reads x by name
        between = nodes[order[node] + 1:order[user]]
        if any(self._writes(n) for n in between):
            return None
        return user

    def _limits_follow(self, user: fx.Node, node: fx.Node) -> bool:
        """Whether `user` writes a dtype's extreme as `torch.finfo(node.dtype)` (see
        `_dtype_limits`)."""
        first = next((a for a in user.args if isinstance(a, fx.Node)
                      and isinstance(self.values.get(a.name), torch.Tensor)), None)
        value = self.values.get(node.name)
        if first is not node or not value.is_floating_point():
            return False
        info = torch.finfo(value.dtype)
        return any(type(a) is float and a in (info.min, info.max)
                   for a in nested_items((user.args, user.kwargs)))

    def _module(self, node: fx.Node) -> nn.Module | None:
        entry = self.piece.modules.get(str(node.target))
        return entry[1] if entry is not None else None

    def _pure(self, node: fx.Node) -> bool:
        """Whether the value depends only on the node's inputs, and computing it changes
        nothing else: it may be computed later, where it is read."""
        if is_inplace(node) or node.target is operator.setitem:
            return False
        if node.op == "call_module":
            module = self._module(node)
            return module is not None and isinstance(module, _PURE_MODULES)
        if node.op == "call_method":
            return str(node.target) not in _RANDOM_METHODS
        fn = node.target
        if isinstance(fn, torch._ops.OpOverload):
            return torch.Tag.nondeterministic_seeded not in fn.tags and not fn._schema.is_mutable
        if fn in OPERATOR_SYMBOLS or fn in UNARY_SYMBOLS or fn in (operator.getitem,
                                                                     builtins.getattr):
            return True
        name = getattr(fn, "__name__", "")
        return (getattr(torch, name, None) is fn or getattr(F, name, None) is fn) \
            and name not in _RANDOM_FUNCTIONS

    def _writes(self, node: fx.Node) -> bool:
        """Whether the node may change a value in place (so a value read before it may not be
        computed after it)."""
        if node.op == "call_module":
            module = self._module(node)
            return module is None or not isinstance(module, _PURE_MODULES) or is_inplace(node)
        if node.op == "call_method":
            return is_inplace(node)
        if node.target is operator.setitem or is_inplace(node):
            return True
        fn = node.target
        if isinstance(fn, torch._ops.OpOverload):
            return fn._schema.is_mutable
        # torch's own functions write nothing but what `is_inplace` names; a function of the
        # model's (or any other) may write anything
        name = getattr(fn, "__name__", "")
        return getattr(torch, name, None) is not fn and getattr(F, name, None) is not fn \
            and not self._pure(node)

    def names(self, boundary: dict[str, str], reserved: set[str]) -> dict[str, str]:
        """Local names: the source's, a name reused once its value is dead (as the model's
        code reassigns `hidden_states`), `_2`, `_3`... while the earlier value is still read;
        the values crossing sub-model boundaries keep their package-wide names."""
        graph = self.piece.graph
        names: dict[str, str] = {}  # node name -> local name
        order = {n: i for i, n in enumerate(graph.nodes)}
        end = len(order)
        hosts: dict[fx.Node, set[int]] = {}

        def where(n: fx.Node) -> set[int]:  # positions of the statements that evaluate n
            if n not in hosts:
                if n.op == "output":
                    hosts[n] = {end}
                elif n in self.inlined:
                    hosts[n] = where(self.inlined[n])
                elif n in self.repeated:
                    hosts[n] = set().union(*(where(u) for u in n.users)) or {order[n]}
                else:
                    hosts[n] = {order[n]}
            return hosts[n]

        last: dict[fx.Node, int] = {}
        for n in graph.nodes:
            for x in n.all_input_nodes:
                if n.op == "call_function" and n.target is operator.getitem and x in self.unpacked:
                    continue
                last[x] = max(last.get(x, -1), *where(n))
        outputs = set(self.piece.outputs)
        fixed = {boundary[name] for name in outputs if name in boundary}
        live: dict[str, fx.Node] = {}
        for n in graph.nodes:
            if n.op == "placeholder":  # a model input named like a name the code binds: renamed
                name = boundary[n.name]
                if name in BOUND or name in reserved - RESERVED:
                    name = fresh(name, reserved | fixed | set(live)
                                 | set(boundary.values()))
                names[n.name] = name
                live[name] = n
        for stmt in self.statements:
            position = order[stmt]
            for name in [k for k, v in live.items() if last.get(v, -1) <= position]:
                del live[name]
            targets = self.unpacked.get(stmt, [stmt])
            for target in targets:
                if target is None or (target is stmt and not stmt.users):
                    continue
                if target.name in outputs and target.name in boundary:
                    name = boundary[target.name]
                else:
                    base = self.source.base.get(target.name) or identifier(target.name)
                    name = fresh(base, reserved | fixed | set(live))
                names[target.name] = name
                live[name] = target
        return names


def nested_items(value: Any) -> list[Any]:
    """The items of nested tuples, lists, dicts and slices, in order."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in nested_items(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in nested_items(v)]
    if isinstance(value, slice):
        return [value.start, value.stop, value.step]
    return [value]


__all__ = ["StatementPlan", "nested_items"]
