"""Codegen's statements: one sub-model's `__init__` body (its leaf modules, parameters, buffers,
constants and ties) and its `forward`, straight-line code with one statement per graph node and
the traced shape as a comment.
"""

from __future__ import annotations

import builtins
import inspect
import operator
from collections import ChainMap
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from atomc.codegen.constructors import module_constructor
from atomc.codegen.inline import StatementPlan, nested_items
from atomc.codegen.literals import Expr, container_source, describe_value, render_constant
from atomc.codegen.lower import (
    ATOM,
    OPERATOR_SYMBOLS,
    UNARY_SYMBOLS,
    Attribute,
    Code,
    Form,
    binary,
    constant_code,
    lower_aten,
    unary,
)
from atomc.codegen.names import RESERVED, SourceNames
from atomc.codegen.resolve import Resolver
from atomc.codegen.split import Piece
from atomc.codegen.unreached import params_without_gradient
from atomc.dtypes import dtype_name
from atomc.ir import Plan
from atomc.profile.ops import is_inplace, written_in_place
from atomc.trace import TracedModel, dtype_values, model_dtype
from atomc.trace.normalise import MODES

_DROPOUT_OPS = {"aten.dropout.default", "aten.native_dropout.default",
                "aten.feature_dropout.default", "aten.alpha_dropout.default",
                "aten.feature_alpha_dropout.default"}

_VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default"}



_F_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
               F.feature_alpha_dropout}
_SDPA = {"aten.scaled_dot_product_attention.default"}
_BATCH_NORMS = {"aten.batch_norm.default", "aten.native_batch_norm.default",
                "aten._native_batch_norm_legit.default"}


def _follow_training_mode(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Dropout as traced in training mode, made to follow `self.training` again.

    Tracing resolves `self.training` to a constant: `F.dropout(x, p, training=True)`, export's
    `aten.dropout(x, p, True)`, attention's `dropout_p=0.1` (from `p if self.training else
    0.0`). Dropout is a training-time operation; the generated code applies it in training
    mode only, as nn.Dropout does.
    """
    if fn in _F_DROPOUTS or str(fn) in _DROPOUT_OPS:
        return _replace_arg(args, kwargs, 2, "training" if fn in _F_DROPOUTS else "train",
                            lambda v: Expr("self.training") if v is True else v)
    if fn is F.batch_norm or str(fn) in _BATCH_NORMS:
        # with running statistics, batch statistics in training and the running ones in
        # evaluation, as nn.BatchNorm decides; without them (track_running_stats=False), always
        # batch statistics
        running_mean = (args[1] if fn is F.batch_norm else args[3]) if len(args) > 3 else None
        if running_mean is None:
            return args, kwargs
        return _replace_arg(args, kwargs, 5, "training",
                            lambda v: Expr("self.training") if v is True else v)
    if fn is F.scaled_dot_product_attention or str(fn) in _SDPA:
        return _replace_arg(args, kwargs, 4, "dropout_p",
                            lambda v: Expr(f"{v!r} if self.training else 0.0")
                            if isinstance(v, float) and v > 0 else v)
    return args, kwargs


def _replace_arg(args: tuple, kwargs: dict, index: int, name: str, change) -> tuple[tuple, dict]:
    if len(args) > index:
        return (*args[:index], change(args[index]), *args[index + 1:]), kwargs
    if name in kwargs:
        return args, {**kwargs, name: change(kwargs[name])}
    return args, kwargs

_UNREACHED = "  # reaches no output: no gradient, as in the model"


class PieceRenderer:
    def __init__(self, piece: Piece, traced: TracedModel, plan: Plan, resolver: Resolver,
                 helper_names: set[str], dtype_args: dict[str, tuple[tuple, ...]],
                 source: SourceNames, boundary: dict[str, str], block: str | None = None):
        self.piece = piece
        self.traced = traced
        self.plan = plan
        self.resolver = resolver
        self.imports: set[str] = {"import torch", "from torch import nn"}
        self.values = ChainMap(piece.values, traced.values)
        self.device_type = traced.device.type
        self.block = block  # rendering one layer's class: its FQN (notes relative to it)
        self.source = source  # the names the model's code gives its values
        self.boundary = boundary  # node name -> package-wide name of each boundary value
        self.reserved = set(RESERVED) | set(helper_names)
        self.names: dict[str, str] = {}  # node name -> local name
        self.inlined: dict[fx.Node, fx.Node] = {}  # node -> the reader it is written inside
        self.repeated: set[fx.Node] = set()  # shape reads written where they are used
        self.unpacked: dict[fx.Node, list[fx.Node | None]] = {}  # tuple -> its items' nodes
        self.canon_params: dict[int, str] = {}
        self.canon_buffers: dict[int, str] = {}
        for fqn, p in traced.model.named_parameters(remove_duplicate=False):
            self.canon_params.setdefault(id(p), fqn)
        for fqn, b in traced.model.named_buffers(remove_duplicate=False):
            self.canon_buffers.setdefault(id(b), fqn)
        self.uses_device = False
        self.uses_dtype = False
        self.dtype_args = dtype_args  # node name -> argument paths that follow the model's dtype
        self.unreached = params_without_gradient(traced)
        self.constants: dict[str, torch.Tensor] = {}  # FQN -> traced value of each constant held
        self.why = f"sub-model {piece.index}"
        self.attr_expr: dict[str, str] = {}  # get_attr target -> `self.…`

    # -- constructor --------------------------------------------------------------------------

    def constructor(self) -> tuple[list[str], dict[str, str], list[str]]:
        lines: list[str] = []
        owner: dict[str, str] = {}  # canonical FQN -> local path holding it
        order: list[tuple[str, str, bool]] = []  # (local path, FQN, is parameter) for PARAM_NAMES
        module_nodes = [n for n in self.piece.graph.nodes if n.op == "call_module"]
        local_modules = list(dict.fromkeys(str(n.target) for n in module_nodes))
        standalone = [self.piece.attrs[str(n.target)] for n in self.piece.graph.nodes
                      if n.op == "get_attr"]
        standalone = list({a.local: a for a in standalone}.values())

        module_lines: list[str] = []
        tie_lines: list[str] = []
        frozen: list[str] = []
        module_params: list[tuple[str, str, bool]] = []
        for local in local_modules:
            if local in self.piece.blocks:
                use = self.piece.blocks[local]
                module_lines.append(f"self.{local} = {use.cls}()  # {use.fqn}")
                for inner, fqn in use.param_names.items():
                    self._hold(owner, f"{local}.{inner}", fqn, inner in use.param_locals,
                               tie_lines, module_params)
                continue
            fqn, module = self.piece.modules[local]
            ctor = module_constructor(module, fqn, self.resolver, self.imports)
            shown = self._relative(fqn)
            note = f"  # {shown}" if shown.replace(".", "_") != local or "." in shown else ""
            module_lines.append(f"self.{local} = {ctor}{note}")
            non_persistent = {f"{prefix}.{name}".lstrip(".")
                              for prefix, m in module.named_modules()
                              for name in getattr(m, "_non_persistent_buffers_set", ())}
            for name, p in module.named_parameters(remove_duplicate=False):
                self._hold(owner, f"{local}.{name}", self.canon_params[id(p)], True, tie_lines,
                           module_params)
                if not p.requires_grad:
                    frozen.append(f"self.{local}.{name}.requires_grad_(False)")
                elif self.canon_params[id(p)] in self.unreached:
                    frozen.append(f"self.{local}.{name}.requires_grad_(False){_UNREACHED}")
            for name, b in module.named_buffers(remove_duplicate=False):
                if name in non_persistent or id(b) not in self.canon_buffers:
                    continue
                self._hold(owner, f"{local}.{name}", self.canon_buffers[id(b)], False, tie_lines,
                           module_params)

        attr_lines: list[str] = []
        own_params: list[tuple[str, str, bool]] = []
        for attr in standalone:
            if attr.fqn in owner:
                self.attr_expr[attr.local] = f"self.{owner[attr.fqn]}"
                continue
            self.attr_expr[attr.local] = f"self.{attr.local}"
            owner[attr.fqn] = attr.local
            note = f"  # {self._relative(attr.fqn)}" if attr.fqn != attr.local else ""
            if not attr.persistent:  # a constant: its value ships with the package
                self.constants[attr.fqn] = attr.value
                self.imports.add("from ._constants import constant")
                attr_lines.append(f"self.register_buffer({attr.local!r}, constant({attr.fqn!r}), "
                                  f"persistent=False)")
                continue
            shape = ", ".join(str(int(d)) for d in attr.value.shape) or "()"
            dtype = attr.value.dtype
            dtype_arg = ("" if dtype == torch.get_default_dtype()
                         else f", dtype=torch.{dtype_name(dtype)}")
            empty = f"torch.empty({shape}{dtype_arg})"
            if attr.is_buffer:
                attr_lines.append(f"self.register_buffer({attr.local!r}, {empty}){note}")
            else:
                unreached = attr.fqn in self.unreached and attr.value.requires_grad
                grad = "" if attr.value.requires_grad and not unreached else ", requires_grad=False"
                note = _UNREACHED if unreached else note
                attr_lines.append(f"self.{attr.local} = nn.Parameter({empty}{grad}){note}")
            own_params.append((attr.local, attr.fqn, not attr.is_buffer))
        # nn.Module lists its own attributes before its children's
        order = own_params + module_params
        lines = attr_lines + module_lines + tie_lines + frozen
        param_names = {local: fqn for local, fqn, _ in order}
        param_locals = [local for local, _, is_param in order if is_param]
        return lines, param_names, param_locals

    @staticmethod
    def _hold(owner: dict[str, str], path: str, fqn: str, is_param: bool, ties: list[str],
              order: list[tuple[str, str, bool]]) -> None:
        if fqn in owner:
            if owner[fqn].split(".")[0] != path.split(".")[0]:  # the module ties its own
                ties.append(f"self.{path} = self.{owner[fqn]}  # tied: one {fqn}")
            return
        owner[fqn] = path
        order.append((path, fqn, is_param))

    # -- forward ------------------------------------------------------------------------------

    def value(self, value: Any) -> Code:
        """A graph value as source: its local name, `self.…`, the expression it is written as
        (inlined), or a constant."""
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                return Code(self.attr_expr[str(value.target)])
            if value in self.inlined or value in self.repeated:
                return self.expression(value)
            return Code(self.names[value.name])
        if isinstance(value, Attribute):
            return Code(f"{self.value(value.value).at(ATOM)}.{value.name}")
        reads = (fx.Node, Attribute) if isinstance(value, (tuple, list)) else fx.Node
        if isinstance(value, (tuple, list, dict, slice)) and any(
                isinstance(v, reads) for v in nested_items(value)):  # a namedtuple as a tuple
            return Code(container_source(tuple(value) if isinstance(value, tuple) else value,
                                         self.arg))
        text = render_constant(value, self.resolver, self.imports, self.why,
                               device_type=self.device_type)
        if text == "device":
            self.uses_device = True
        return constant_code(text)

    def arg(self, value: Any) -> str:
        return self.value(value).text

    def subscript(self, value: Any, *, items: bool = False) -> str:
        """An index as written between brackets (`..., 4:`); `items`: a tuple of the index's
        items (ATen's), not one tuple-valued index."""
        if isinstance(value, slice):
            parts = ["" if v is None else self.arg(v)
                     for v in (value.start, value.stop, value.step)]
            text = f"{parts[0]}:{parts[1]}"
            return text + (f":{parts[2]}" if parts[2] else "")
        if isinstance(value, tuple) and value:
            parts = [self.subscript(v) for v in value]
            return ", ".join(parts) + ("," if len(parts) == 1 and not items else "")
        if value is None:
            return "None"
        if value is Ellipsis:
            return "..."
        return self.arg(value)

    def call_args(self, args: tuple, kwargs: dict) -> str:
        parts = [self.arg(a) for a in args] + [f"{k}={self.arg(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def expression(self, node: fx.Node) -> Code:
        self.why = f"node {node.name} of sub-model {self.piece.index}"
        if node.op == "call_module":
            return Code(f"self.{node.target}({self.call_args(node.args, node.kwargs)})")
        if node.op == "call_method":
            args, kwargs = self._dtype_limits(tuple(node.args), dict(node.kwargs))
            return self._method(args[0], str(node.target), args[1:], kwargs)
        if node.op != "call_function":
            raise AssertionError(node.op)
        fn = node.target
        args, kwargs = self._dtype_limits(*self._generic_dtypes(node))
        if fn is operator.getitem and not kwargs:
            return Code(f"{self.value(args[0]).at(ATOM)}[{self.subscript(args[1])}]")
        if fn is builtins.getattr and len(args) == 2 and isinstance(args[1], str) \
                and args[1].isidentifier() and not kwargs:
            return Code(f"{self.value(args[0]).at(ATOM)}.{args[1]}")
        if fn in OPERATOR_SYMBOLS and len(args) == 2 and not kwargs:
            return binary(OPERATOR_SYMBOLS[fn], self.value(args[0]), self.value(args[1]))
        if fn in UNARY_SYMBOLS and len(args) == 1 and not kwargs:
            return unary(UNARY_SYMBOLS[fn], self.value(args[0]))
        if str(fn) in _VIEW_OPS:
            # export records a view wherever the tracing device's strides allowed one (it drops
            # `.contiguous()` when it was a no-op there); reshape is that view where the running
            # device's strides allow it too, and a copy where they do not
            fn = torch.ops.aten.reshape.default
        args, kwargs = _follow_training_mode(fn, args, kwargs)
        if isinstance(fn, torch._ops.OpOverload) and not self._index_by_scalar(fn, args):
            first = self._traced(args[0]) if args else None
            ndim = first.dim() if isinstance(first, torch.Tensor) else None
            form = lower_aten(fn, args, kwargs, ndim)
            if form is not None:
                return self._form(form)
        callee = self.resolver.function(fn, self.imports, self.why)
        return Code(f"{callee}({self.call_args(args, kwargs)})")

    def _index_by_scalar(self, fn: Any, args: tuple) -> bool:
        """`aten.index` by a 0-dimensional integer tensor: `x[i]` would be a view (Python
        indexes by it as by an int), where the operator makes a copy."""
        if fn is not torch.ops.aten.index.Tensor or len(args) < 2:
            return False
        return any(isinstance(v, torch.Tensor) and v.dim() == 0
                   for v in map(self._traced, args[1] or ()))

    def _form(self, form: Form) -> Code:
        self.imports.update(form.imports)
        if form.kind == "same":
            return self.value(form.args[0])
        if form.kind == "binary":
            return binary(form.name, self.value(form.args[0]), self.value(form.args[1]))
        if form.kind == "unary":
            return unary(form.name, self.value(form.args[0]))
        if form.kind == "index":
            items = self.subscript(form.index, items=True)
            return Code(f"{self.value(form.args[0]).at(ATOM)}[{items}]")
        if form.kind == "method":
            rest = tuple(form.args[1]) if form.unpack else form.args[1:]
            return self._method(form.args[0], form.name, rest, form.kwargs,
                                sizes=form.args[1:] if form.unpack else None)
        return Code(f"{form.name}({self.call_args(form.args, form.kwargs)})")

    def _method(self, obj: Any, name: str, args: tuple, kwargs: dict,
                sizes: tuple | None = None) -> Code:
        """`x.name(...)`; `torch.name(a + b, ...)` where the receiver is an operator
        expression that torch also takes as a function's first argument."""
        receiver = self.value(obj)
        if receiver.precedence < ATOM and inspect.isbuiltin(getattr(torch, name, None)):
            self.imports.add("import torch")
            given = sizes if sizes is not None else args
            return Code(f"torch.{name}({self.call_args((obj, *given), kwargs)})")
        return Code(f"{receiver.at(ATOM)}.{name}({self.call_args(args, kwargs)})")

    def _traced(self, value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                attr = self.piece.attrs.get(str(value.target))
                return attr.value if attr is not None else None
            return self.values.get(value.name)
        return None

    def _dtype_limits(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Scalars that are the traced dtype's extremes, as that dtype's extremes at run time.

        Attention masks fill with `torch.finfo(scores.dtype).min`; the trace recorded float32's
        (-3.4e38), which overflows bfloat16 when the sub-model runs under autocast. A scalar
        equal to the largest or most negative value of the first tensor argument's traced dtype
        (or of a dtype argument that follows the model's) becomes `torch.finfo(x.dtype).min`.
        """
        first = next((a for a in args if isinstance(a, fx.Node)
                      and isinstance(self.values.get(a.name), torch.Tensor)), None)
        if first is not None:
            dtype, source = self.values[first.name].dtype, f"{self.value(first).at(ATOM)}.dtype"
        elif isinstance(kwargs.get("dtype"), Expr):
            dtype, source = model_dtype(self.traced.model), str(kwargs["dtype"])
        else:
            return args, kwargs
        if not dtype.is_floating_point:
            return args, kwargs
        info = torch.finfo(dtype)
        names = {info.min: "min", info.max: "max"}

        def limit(a: Any) -> Any:
            if type(a) is float and a in names:
                return Expr(f"torch.finfo({source}).{names[a]}")
            return a

        return tuple(limit(a) for a in args), {k: limit(v) for k, v in kwargs.items()}

    def _generic_dtypes(self, node: fx.Node) -> tuple[tuple, dict]:
        """The node's arguments, with the dtypes that follow the model's dtype as `dtype`."""
        args, kwargs = tuple(node.args), dict(node.kwargs)
        paths = self.dtype_args.get(node.name, ())
        if not paths:
            return args, kwargs
        self.uses_dtype = True

        def put(value: Any, rest: tuple) -> Any:
            if not rest:
                return Expr("dtype")
            head, *tail = rest
            if isinstance(value, dict):
                return {**value, head: put(value[head], tuple(tail))}
            items = list(value)
            items[head] = put(items[head], tuple(tail))
            return type(value)(items) if isinstance(value, tuple) else items

        for where, *rest in paths:
            if where == "args":
                args = put(args, tuple(rest))
            else:
                kwargs = put(kwargs, tuple(rest))
        return args, kwargs

    def statement(self, node: fx.Node) -> str:
        if node.op == "call_function" and node.target is operator.setitem and not node.users:
            target, idx, value = node.args
            return f"{self.value(target).at(ATOM)}[{self.subscript(idx)}] = {self.arg(value)}"
        expr = self.expression(node).text
        comment = describe_value(self.values.get(node.name))
        if node in self.unpacked:
            names = [self.names[i.name] if i is not None else "_" for i in self.unpacked[node]]
            return f"{', '.join(names)} = {expr}  # {comment}"
        if not node.users:
            return f"{expr}  # {comment}"
        return f"{self.names[node.name]} = {expr}  # {comment}"

    def forward(self, op_nodes: dict[str, Any]) -> tuple[list[str], list[str]]:
        graph = self.piece.graph
        layout = StatementPlan(self.piece, self.values, self.source)
        self.inlined, self.repeated, self.unpacked = (layout.inlined, layout.repeated,
                                                      layout.unpacked)
        statements = layout.statements
        self.names = layout.names(self.boundary, self.reserved)
        params = [self.names[n.name] for n in graph.nodes if n.op == "placeholder"]
        body: list[str] = []
        for name in self.piece.inputs:
            body.append(f"# {self.boundary[name]}: {describe_value(self.values.get(name))}")
        for node in graph.nodes:
            if node.op == "placeholder" and written_in_place(node):
                # the caller's tensor may be a leaf that takes gradients (the swap runtime's
                # inputs are), or be needed again (recomputation): write a copy
                name = self.names[node.name]
                body.append(f"{name} = {name}.clone()  # written in place below")
        block = None
        code: list[str] = []
        open_modes: tuple = ()  # the `with` blocks the current statement is inside
        output = next(n for n in graph.nodes if n.op == "output")
        for node in [*statements, output]:
            modes = tuple(node.meta.get(MODES, ())) if node.op != "output" else ()
            keep = 0
            while keep < min(len(modes), len(open_modes)) and modes[keep] == open_modes[keep]:
                keep += 1
            open_modes = open_modes[:keep]
            if node.op == "output":
                code.append(self._return(node))
                continue
            op = op_nodes.get(node.name)
            node_block = op.block if op is not None else ""
            if node_block != block and node_block and self.block is None:
                code.append("")
                code.append(f"{'    ' * len(open_modes)}# {node_block}")
            block = node_block
            for mode in modes[keep:]:
                code.append(f"{'    ' * len(open_modes)}with {self._mode(mode)}:")
                open_modes += (mode,)
            indent = "    " * len(open_modes)
            if self._training_only(node):
                code.append(f"{indent}if self.training:")
                indent += "    "
            code.append(f"{indent}{self.statement(node)}")
        if self.uses_device:
            body.append(f"device = {self._device_source()}  # where this sub-model runs")
        if self.uses_dtype:
            body.append(f"dtype = {self._dtype_source()}  # {self._dtype_note()}")
        return params, body + code

    def _training_only(self, node: fx.Node) -> bool:
        """An in-place update of a BatchNorm's buffer (`num_batches_tracked += 1`): BatchNorm
        makes it in training only, and tracing in training mode left out its `if`."""
        if not (is_inplace(node) and node.args and isinstance(node.args[0], fx.Node)):
            return False
        target = node.args[0]
        attr = self.piece.attrs.get(str(target.target)) if target.op == "get_attr" else None
        if attr is None or not attr.is_buffer:
            return False
        owner = attr.fqn.rpartition(".")[0]
        try:
            module = self.traced.model.get_submodule(owner)
        except AttributeError:
            return False
        return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats

    def _mode(self, mode: tuple) -> str:
        """`torch.no_grad()` or `torch.autocast(device.type, ...)`: a traced region's mode."""
        if mode[0] == "grad":
            return "torch.enable_grad()" if mode[1] else "torch.no_grad()"
        _, _, dtype, enabled, cache_enabled = mode
        # the traced device type (often meta, where autocast does not exist) is not where the
        # sub-model runs: a region's mode applies to whatever device it runs on
        self.uses_device = True
        parts = ["device.type"]
        if enabled and dtype is not None:
            parts.append(f"dtype=torch.{dtype_name(dtype)}")
        if not enabled:
            parts.append("enabled=False")
        if not cache_enabled:
            parts.append("cache_enabled=False")
        return f"torch.autocast({', '.join(parts)})"

    def _dtype_source(self) -> str:
        """The dtype of the sub-model's largest floating weight: the model's own dtype."""
        best, size = None, -1
        for attr in self.piece.attrs.values():
            v = attr.value
            if attr.persistent and v.is_floating_point() and v.numel() > size:
                best, size = self.attr_expr.get(attr.local, f"self.{attr.local}"), v.numel()
        # modules still called here: a layer folded into a block class (codegen.blocks) is an
        # attribute of that class's instance, not of the sub-model
        called = {n.target for n in self.piece.graph.nodes if n.op == "call_module"}
        for local, (_, module) in self.piece.modules.items():
            if local not in called:
                continue
            for name, p in module.named_parameters():
                if p.is_floating_point() and p.numel() > size:
                    best, size = f"self.{local}.{name}", p.numel()
        if best is not None:
            return f"{best}.dtype"
        # no weights: an input whose dtype follows the weights', before one the model casts
        # itself (Mamba's residual, kept in float32)
        floating = [n for n in self.piece.inputs
                    if isinstance(v := self.values.get(n), torch.Tensor) and v.is_floating_point()]
        follows = dtype_values(self.traced)
        name = min(floating, key=lambda n: n not in follows, default=None)
        return f"{self.names[name]}.dtype" if name else "torch.get_default_dtype()"

    def _dtype_note(self) -> str:
        traced = dtype_name(model_dtype(self.traced.model))
        return f"the weights' dtype, traced as {traced}"

    def _relative(self, fqn: str) -> str:
        """An FQN as a note shows it: inside a layer's class, from that layer."""
        if self.block and fqn.startswith(self.block + "."):
            return fqn[len(self.block) + 1:]
        return fqn

    def _return(self, node: fx.Node) -> str:
        self.why = f"the output of sub-model {self.piece.index}"
        value = node.args[0]
        if self.block is not None and len(value) == 1:
            return f"return {self.arg(value[0])}"
        if self.piece.is_last:
            if self.piece.structure is not None:
                by_name = {n.name: n for n in self.piece.graph.nodes}
                return f"return {self._structure(self.piece.structure, by_name)}"
            return f"return {self.arg(value)}"
        items = [self.arg(v) for v in value]
        if len(items) == 1:
            return f"return ({items[0]},)"
        return "return (" + ", ".join(items) + ")"

    def _structure(self, value: Any, by_name: dict[str, fx.Node]) -> str:
        """The model's output container as code, its class kept: a ModelOutput, a namedtuple."""
        if isinstance(value, fx.Node):
            return self.arg(by_name[value.name])

        def r(v: Any) -> str:
            return self._structure(v, by_name)

        kind = type(value)
        if kind in _PLAIN:
            return container_source(value, r)
        if not isinstance(value, (tuple, list, dict)):
            return self.arg(value)
        ctor = self.resolver.cls(kind, self.imports, self.why)
        if isinstance(value, dict):  # ModelOutput and other dict classes: keyword arguments
            if all(isinstance(k, str) and k.isidentifier() for k in value):
                return f"{ctor}(" + ", ".join(f"{k}={r(v)}" for k, v in value.items()) + ")"
            return f"{ctor}({{" + ", ".join(f"{k!r}: {r(v)}" for k, v in value.items()) + "})"
        if hasattr(kind, "_fields"):  # a namedtuple
            return f"{ctor}(" + ", ".join(r(v) for v in value) + ")"
        return f"{ctor}([" + ", ".join(r(v) for v in value) + "])"

    def _device_source(self) -> str:
        for name in self.piece.inputs:
            if isinstance(self.values.get(name), torch.Tensor):
                return f"{self.names[name]}.device"
        if self.attr_expr:
            return f"{next(iter(self.attr_expr.values()))}.device"
        for local in self.piece.modules:
            return f"next(self.{local}.parameters()).device"
        return "torch.get_default_device()"


# Containers written as literals; fx keeps a graph's own tuples and dicts as its immutable kinds.
_PLAIN = (tuple, list, dict, immutable_dict, immutable_list)
