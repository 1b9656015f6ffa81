"""Codegen's names: what the model's own code calls each value of the traced graph.

Every traced node records the stack of the model code that made it (`node.stack_trace`:
torch.export keeps it, and atomc's symbolic tracer records it). The innermost frame of the
model's own code is the statement that computed the value; parsed with `ast`, its assignment
target is the name a reader knows (`query_states`, `variance`, `batch, seq, width = x.shape`).

A node whose value leaves its statement (read by a later statement) takes the statement's
target; a `return` passes the value to the caller's statement, one frame out. A value only
read inside its own statement is part of an expression (codegen writes it inline where it
can), and otherwise takes the name of the value it transforms (`cos.unsqueeze(1)` is still
`cos`), its statement's target, or its module's attribute name. Only values no code names get
an operator's name (`linear`, `cat`), never fx's counters.

`SourceNames(traced)` computes each node's base name once per traced model; which name a
generated local finally takes (`hidden_states`, `hidden_states_2`) is decided where it is
written (`statements.Namer`), and the values that cross sub-model boundaries get one name for
the whole package (`boundary_names`).
"""

from __future__ import annotations

import ast
import builtins
import keyword
import linecache
import operator
import re
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import fx

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

_TORCH = Path(torch.__file__).resolve().parent
_ATOMC = Path(__file__).resolve().parent.parent
# torch's own files whose frames are call plumbing or tracing, never a model's statement
_PLUMBING = tuple(str(_TORCH / p) for p in (
    "fx", "_dynamo", "export", "_export", "utils", "_ops.py", "overrides.py", "_tensor.py",
    "_higher_order_ops", "_subclasses", "_decomp", "_refs", "_prims", "autograd",
    "nn/modules/module.py", "nn/functional.py", "functional.py", "_jit_internal.py"))

# Names generated code binds itself (imports, `self`, the `device` and `dtype` it reads).
BOUND = frozenset({"self", "torch", "nn", "F", "operator", "math", "device", "dtype", "constant"})
# ... and names a value never takes: Python's own, and those that read badly (ruff's E741).
RESERVED = BOUND | {"l", "O", "I"} | set(dir(builtins)) | set(keyword.kwlist)

# Operators whose result is the value they read, seen another way: a reader names the result
# after what it transforms (`cos = cos.unsqueeze(1)`).
_SAME_VALUE = frozenset({
    "to", "_to_copy", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
    "contiguous", "clone", "detach", "alias", "view", "reshape", "_unsafe_view", "expand",
    "expand_as", "unsqueeze", "squeeze", "transpose", "permute", "t", "flatten", "unflatten",
    "slice", "select", "narrow", "repeat", "repeat_interleave", "lift_fresh_copy", "view_as",
    "reshape_as", "movedim", "swapaxes", "getitem", "neg",
})


def same_value(node: fx.Node) -> bool:
    """Whether the node's result is its first input seen another way (a cast, a view)."""
    return op_name(node) in _SAME_VALUE


def identifier(text: str) -> str:
    """`h.0.attn` -> `h_0_attn`: a valid Python identifier for any text."""
    name = re.sub(r"\W", "_", text).strip("_") or "value"
    if name[0].isdigit():
        name = f"v_{name}"
    return name


def _user_frames(stack_trace: str | None) -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of every frame of model code, outermost first (torch's and
    atomc's own frames left out)."""
    if not stack_trace:
        return ()
    frames = []
    for line in stack_trace.splitlines():
        m = _FRAME.match(line)
        if m is None:
            continue
        file = m.group("file")
        if file.startswith("<") or file.startswith(_PLUMBING) or file.startswith(str(_ATOMC)):
            continue
        frames.append((file, int(m.group("line")), m.group("func")))
    return tuple(frames)


@cache
def _tree(file: str) -> ast.Module | None:
    """A source file's syntax tree, parsed once for `_statements` and `_classes`; None if it
    does not parse."""
    try:
        return ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        return None


@cache
def _statements(file: str) -> dict[int, ast.stmt]:
    """Line -> innermost statement covering it, for a source file (empty if it does not parse)."""
    tree = _tree(file)
    if tree is None:
        return {}
    found: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):  # breadth first: inner statements come later and win
        if isinstance(node, ast.stmt):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                old = found.get(line)
                if old is None or _inside(node, old):
                    found[line] = node
    return found


def _inside(inner: ast.stmt, outer: ast.stmt) -> bool:
    return (inner.lineno, -(inner.end_lineno or 0)) >= (outer.lineno, -(outer.end_lineno or 0))


def _target_names(target: ast.expr) -> list[str | None]:
    if isinstance(target, ast.Name):
        return [None if target.id == "_" else target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t.id if isinstance(t, ast.Name) and t.id != "_" else None for t in target.elts]
    return [None]


@cache
def _classes(file: str) -> dict[int, str]:
    """Line -> name of the innermost class whose body covers it, for a source file."""
    tree = _tree(file)
    if tree is None:
        return {}
    found: dict[int, str] = {}
    for node in ast.walk(tree):  # breadth first: inner classes come later and win
        if isinstance(node, ast.ClassDef):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                found[line] = node.name
    return found


def statement_targets(file: str, line: int) -> list[str | None] | None:
    """The names a statement assigns (None where it assigns no plain name); None when the
    statement assigns nothing (a `return`, an expression, a compound statement's header)."""
    stmt = _statements(file).get(line)
    if isinstance(stmt, ast.Assign):
        return _target_names(stmt.targets[0])
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return None


def op_name(node: fx.Node) -> str:
    """The operator's own name: `linear` for aten.linear, `view` for `.view`, the module's
    attribute for a module call."""
    target = node.target
    if node.op == "call_module":
        return str(target).rpartition(".")[2]
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", None) or str(target)


class SourceNames:
    """Base names of a traced graph's values, from the model's source (see the module doc)."""

    def __init__(self, gm: fx.GraphModule):
        self.nodes = list(gm.graph.nodes)
        self.frames = {n: _user_frames(n.meta.get("stack_trace") or n.stack_trace)
                       for n in self.nodes}
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.base: dict[str, str] = {}
        self.from_source: set[str] = set()  # node names whose base the source gave
        self._runs: dict[tuple[fx.Node, int], tuple[int, int]] = {}
        self._calls: dict[tuple[fx.Node, int], str | None] = {}
        for node in self.nodes:
            if node.op == "placeholder":
                self.base[node.name] = node.name
                self.from_source.add(node.name)
            elif node.op not in ("get_attr", "output"):
                self._name(node)

    def _run(self, node: fx.Node, depth: int) -> tuple[int, int]:
        """(first, last) positions of the contiguous run of nodes made while the frame at
        `depth` (and the ones outside it) of `node` ran: one execution of that statement."""
        key = (node, depth)
        if key in self._runs:
            return self._runs[key]
        prefix = self.frames[node][:depth + 1]
        call = self._call(node, depth + 1)
        i = self.position[node]

        def inside(n: fx.Node) -> bool:
            # a statement run again by a loop over a list of layers (`x = block(x)` for h.0,
            # then h.1) is one run per layer
            return self.frames[n][:depth + 1] == prefix and not _iterations(
                call, self._call(n, depth + 1))

        lo = i
        while lo > 0 and (inside(self.nodes[lo - 1]) or not self.frames[self.nodes[lo - 1]]):
            lo -= 1
        while lo < i and not inside(self.nodes[lo]):
            lo += 1
        hi = i
        last = len(self.nodes) - 1
        while hi < last and (inside(self.nodes[hi + 1]) or not self.frames[self.nodes[hi + 1]]):
            hi += 1
        while hi > i and not inside(self.nodes[hi]):
            hi -= 1
        for n in self.nodes[lo:hi + 1]:
            if inside(n):
                self._runs[(n, depth)] = (lo, hi)
        return lo, hi

    def _call(self, node: fx.Node, depth: int) -> str | None:
        """The layer whose forward the node's frame at `depth` is in, if it is one."""
        frames = self.frames[node]
        if depth >= len(frames):
            return None
        key = (node, depth)
        if key not in self._calls:
            self._calls[key] = self._layer(node, frames[depth], path=True)
        return self._calls[key]

    def _escapes(self, node: fx.Node, run: tuple[int, int]) -> bool:
        lo, hi = run
        return any(u.op == "output" or not lo <= self.position[u] <= hi for u in node.users)

    def _escapers(self, run: tuple[int, int], depth: int, prefix: tuple) -> list[fx.Node]:
        lo, hi = run
        return [n for n in self.nodes[lo:hi + 1]
                if self.frames[n][:depth + 1] == prefix and n.op not in ("get_attr", "placeholder")
                and self._escapes(n, run)]

    def _name(self, node: fx.Node) -> None:
        frames = self.frames[node]
        returned = None  # the layer whose forward returned the value
        for depth in range(len(frames) - 1, -1, -1):
            run = self._run(node, depth)
            if not self._escapes(node, run):
                break  # a part of this statement's expression: named below
            targets = statement_targets(*frames[depth][:2])
            if targets is None:  # `return ...`: the caller's statement names it
                returned = self._layer(node, frames[depth]) or returned
                continue
            escapers = self._escapers(run, depth, frames[:depth + 1])
            name = None
            if len(escapers) == len(targets):
                name = targets[escapers.index(node)]
            elif len(escapers) == 1 and len([t for t in targets if t]) == 1:
                name = next(t for t in targets if t)
            if name:
                self.base[node.name] = name
                self.from_source.add(node.name)
                return
            break
        self.base[node.name] = self._fallback(node, frames, returned)

    def _layer(self, node: fx.Node, frame: tuple[str, int, str], path: bool = False) -> str | None:
        """The attribute name of the layer whose `forward` the frame is in (`mlp`); `path`:
        its path in the model."""
        if frame[2] != "forward":
            return None
        cls = _classes(frame[0]).get(frame[1])
        stack = node.meta.get("nn_module_stack") or {}
        for where, kind in reversed(list(stack.values())):
            name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", "")
            if cls and str(name).rpartition(".")[2] == cls and where:
                if path:
                    return str(where)
                return identifier(str(where).rpartition(".")[2]
                                  if not str(where).rpartition(".")[2].isdigit()
                                  else str(where).replace(".", "_"))
        return None

    def _fallback(self, node: fx.Node, frames: tuple, returned: str | None) -> str:
        """A value its statement does not name: after what it transforms, the layer that
        returned it, the attribute it reads, else its statement's target, else its operator."""
        first = node.args[0] if node.args else None
        if (op_name(node) in _SAME_VALUE and isinstance(first, fx.Node)
                and first.name in self.base):
            if first.name in self.from_source:
                self.from_source.add(node.name)
            return self.base[first.name]
        if returned:
            self.from_source.add(node.name)
            return returned
        if node.op == "call_module":
            self.from_source.add(node.name)
            return identifier(op_name(node))
        if (node.target is getattr and isinstance(first, fx.Node) and len(node.args) == 2
                and isinstance(node.args[1], str)):
            return identifier(f"{self.base.get(first.name, first.name)}_{node.args[1]}")
        for depth in range(len(frames) - 1, -1, -1):
            targets = statement_targets(*frames[depth][:2])
            names = [t for t in targets or () if t]
            if names:
                self.from_source.add(node.name)
                return names[0]
        return identifier(op_name(node))

    def same_statement(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether two nodes were made while one statement ran once: directly, or inside
        different calls it makes (`self.act(self.gate(x))`), never by two statements of one
        function."""
        a, b = self.by_name.get(a.name), self.by_name.get(b.name)
        if a is None or b is None:
            return False
        fa, fb = self.frames[a], self.frames[b]
        common = 0
        while common < min(len(fa), len(fb)) and fa[common] == fb[common]:
            common += 1
        if common == 0:
            return False
        if len(fa) > common and len(fb) > common and fa[common][0::2] == fb[common][0::2]:
            return False
        lo, hi = self._run(a, common - 1)
        return lo <= self.position[b] <= hi


def boundary_names(source: SourceNames, pieces: list, reserved: set[str]) -> dict[str, str]:
    """Node name -> the package-wide name of every value that crosses a sub-model boundary
    (the model's inputs keep theirs): one name per value, distinct across the package, so a
    runtime can key every boundary value by its name."""
    crossing: set[str] = set()
    for piece in pieces:
        crossing.update(piece.inputs)
        crossing.update(piece.outputs)
    taken = set(reserved)
    names: dict[str, str] = {}
    for node in source.nodes:
        if node.op == "placeholder":
            names[node.name] = node.name
            taken.add(node.name)
    for node in source.nodes:
        if node.name in crossing and node.name not in names:
            names[node.name] = fresh(source.base.get(node.name) or identifier(node.name), taken)
            taken.add(names[node.name])
    return names


def _iterations(a: str | None, b: str | None) -> bool:
    """Whether two layer paths are two items of one list of layers (`h.0`, `h.1`)."""
    if a is None or b is None or a == b:
        return False
    pa, _, ia = a.rpartition(".")
    pb, _, ib = b.rpartition(".")
    return pa == pb and ia.isdigit() and ib.isdigit()


def fresh(base: str, taken: Any) -> str:
    """`base`, or `base_2`, `base_3`...: the first not in `taken`."""
    if base not in taken:
        return base
    n = 2
    while f"{base}_{n}" in taken:
        n += 1
    return f"{base}_{n}"
