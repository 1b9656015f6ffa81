"""examples/gpt.py with a layer-count option, for bench/modes_bench.py.

ATOM's Table III trims two of its models: GPT-3 13B to 18 layers and GPT-3 175B to 2
transformer blocks (so the pipelines' stages fit the GPUs). `n_layer` does that; every other
field is gpt.py's configuration, and the model, inputs and loss are gpt.py's own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "atomc_example_gpt", Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault(_SPEC.name, gpt)  # dataclasses look their module up while defining
_SPEC.loader.exec_module(gpt)

loss_fn = gpt.loss_fn


def build_model(config: str | None = None, seq_len: int | None = None,
                n_layer: int | None = None):
    name = config or "tiny"
    if name not in gpt.CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose one of {', '.join(gpt.CONFIGS)}")
    cfg = gpt.CONFIGS[name]
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    if n_layer is not None:
        cfg = dataclasses.replace(cfg, n_layer=n_layer)
    return gpt.GPT(cfg)


def example_inputs(model, batch_size: int, seq_len: int | None = None,
                   n_layer: int | None = None):
    return gpt.example_inputs(model, batch_size, seq_len=seq_len)
