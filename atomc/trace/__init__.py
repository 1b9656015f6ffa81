"""Stage 1, trace: a model file -> torch.fx GraphModule and its OpGraph IR.

Public: `trace_model(path, config=None, batch_size=1, options=None, ...) -> TracedModel`.
Big models are built on the meta device and every node's output is computed on meta
tensors, so a 175B-parameter model traces in seconds without allocating its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn

from atomc.errors import ModelFileError, TraceError
from atomc.ir import OpGraph
from atomc.trace.frontends import trace
from atomc.trace.graph import ValueRecorder, build_opgraph, normalise_get_attrs, tensors_in
from atomc.trace.load import call_with_options, load_model_file

__all__ = ["TracedModel", "trace_model", "load_model_file", "build_and_inputs"]


@dataclass
class TracedModel:
    """What tracing produced; torch objects live here, never in the IR."""

    graph: OpGraph
    gm: fx.GraphModule
    model: nn.Module
    inputs: tuple
    values: dict[str, Any]  # node name -> value computed on `device` (meta by default)
    module: ModuleType  # the imported model file
    device: torch.device


def build_and_inputs(path: str | Path, config: str | None, batch_size: int, options: dict[str, int],
                     device: str | torch.device = "meta") -> tuple[ModuleType, nn.Module, tuple]:
    """Import the model file, build the model and its example inputs on `device`."""
    p = Path(path)
    module = load_model_file(p)
    if batch_size < 1:
        raise ModelFileError(f"batch size {batch_size} is not positive; give --batch-size 1 or more")
    with torch.device(device):
        model = call_with_options(module.build_model, (config,), options, p)
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"{p}: build_model() returned {type(model).__name__}, expected an nn.Module")
        inputs = call_with_options(module.example_inputs, (model, batch_size), options, p)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple) or not tensors_in(inputs):
        raise ModelFileError(f"{p}: example_inputs() returned {type(inputs).__name__}, expected a tuple "
                             f"of tensors (the model's positional inputs)")
    return module, model, inputs


def trace_model(path: str | Path, config: str | None = None, batch_size: int = 1,
                options: dict[str, int] | None = None, *, device: str | torch.device = "meta",
                frontend: str = "auto", leaf_modules: tuple[type, ...] = (),
                train: bool = True) -> TracedModel:
    """Trace the model of a model file; `train` traces in training mode (dropout on)."""
    p = Path(path)
    options = dict(options or {})
    module, model, inputs = build_and_inputs(p, config, batch_size, options, device)
    model.train(train)
    leaf_types = tuple(leaf_modules) + tuple(getattr(module, "LEAF_MODULES", ()))
    gm, used = trace(model, inputs, leaf_types, p, frontend)
    normalise_get_attrs(gm)
    recorder = ValueRecorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*inputs)
    except Exception as e:
        raise TraceError(f"the traced graph of {p} did not run on {device} tensors "
                         f"({type(e).__name__}: {e}); mark the failing module as a leaf") from e
    graph = build_opgraph(gm, model, recorder.values, model_path=str(p), config=config,
                          batch_size=batch_size, options=options, frontend=used)
    return TracedModel(graph, gm, model, inputs, recorder.values, module, torch.device(device))
