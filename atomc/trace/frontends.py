"""Frontends that turn an nn.Module into a torch.fx GraphModule.

Tried in order: torch.fx.symbolic_trace (module-level graph, readable generated code), then
torch.export (ATen-level graph) for models symbolic tracing rejects: control flow on shapes,
cache objects in outputs, unsupported builtins. When both fail, the error names each failure
and the line of the model file it happened on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from atomc.errors import TraceError


def layer_class(module: nn.Module) -> type:
    """The layer's own class: parametrize turns a module into an instance of a subclass made
    for it (`ParametrizedLinear`), which no code can name."""
    if parametrize.is_parametrized(module):
        return type(module).__mro__[1]
    return type(module)


class LeafTracer(fx.Tracer):
    """symbolic_trace's tracer with user-given module types kept whole, and torch.nn's own
    layers whole only when they have no sub-modules."""

    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        if parametrize.is_parametrized(m):
            # torch.nn's layer with a weight computed by torch (weight_norm, spectral_norm):
            # whole, as the plain layer is (codegen rebuilds it with the same calls,
            # atomc.codegen.reparam); a module of the user's is traced through as always
            alone = all(name == "parametrizations" for name, _ in m.named_children())
            return alone and layer_class(m).__module__.startswith(("torch.nn.", "torch.ao.nn."))
        # fx keeps every torch.nn module whole; a composite one (TransformerEncoder,
        # MultiheadAttention) is traced through instead: the partitioner may cut inside it, and
        # codegen rebuilds only layers whose constructor arguments it can read back
        if next(m.children(), None) is not None:
            return False
        return super().is_leaf_module(m, module_qualified_name)


def trace_fx(model: nn.Module, leaf_types: tuple[type, ...]) -> fx.GraphModule:
    tracer = LeafTracer(leaf_types)
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and partial graphs about failures we report in one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def trace_export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    with _quiet_torch_logs():
        program = torch.export.export(model, inputs, strict=False)
    gm = program.module()
    # The unlifted module carries pytree and guard plumbing; the compute graph is what we need.
    return gm


def trace(model: nn.Module, inputs: tuple, leaf_types: tuple[type, ...], model_path: Path,
          frontend: str = "auto") -> tuple[fx.GraphModule, str]:
    """(GraphModule, frontend name). `frontend` is "auto", "fx" or "export"."""
    failures: list[str] = []
    if frontend in ("auto", "fx"):
        try:
            return trace_fx(model, leaf_types), "fx"
        except Exception as e:  # noqa: BLE001 - fx raises many kinds; all mean "try the next"
            failures.append(f"torch.fx.symbolic_trace: {_describe(e, model_path)}")
    if frontend in ("auto", "export"):
        try:
            return trace_export(model, inputs), "export"
        except Exception as e:  # noqa: BLE001 - export raises many kinds; all are reported below
            failures.append(f"torch.export: {_describe(e, model_path)}")
    raise TraceError(
        f"cannot trace the model in {model_path}: " + "; ".join(failures)
        + ". Make the failing line traceable (e.g. avoid Python control flow on tensor values), "
        "or mark the module that contains it as a leaf (LEAF_MODULES in the model file)"
    )


def _describe(exc: BaseException, model_path: Path) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {first}"[:300]
    if "in output, which is not a known type" in first:
        # the usual cause: a Hugging Face model returning its key/value cache
        message += (" [the model returns an object torch.export cannot flatten: return tensors, "
                    "tuples or dicts of them (for Hugging Face models pass use_cache=False)]")
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == model_path.resolve():
            where = f" (at {model_path.name}:{frame.lineno}: {(frame.line or '').strip()})"
    return message + where
