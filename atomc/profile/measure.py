"""Measured costs of one operator on a real device (CPU or CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from atomc.profile.ops import MetaStats, backward_fn, build_call, differentiable_outputs
from atomc.profile.timing import time_ms


@dataclass
class Measured:
    fwd_ms: float
    bwd_ms: float
    peak_fwd_bytes: int
    peak_bwd_bytes: int


def measure(gm: fx.GraphModule, node: fx.Node, values: dict[str, Any], stats: MetaStats,
            device: torch.device, repeats: int) -> Measured:
    """Materialise the operator alone on `device`, time forward and backward, free it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
    call = build_call(gm, node, values, device)
    with torch.enable_grad():
        fwd_ms = time_ms(call.fn, device, repeats=repeats)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        out = call.fn()
        if cuda:
            torch.cuda.synchronize(device)
            peak_fwd = torch.cuda.max_memory_allocated(device) - base
        bwd = backward_fn(call, differentiable_outputs(out))
        bwd_ms = 0.0
        if bwd is not None:
            bwd_ms = time_ms(bwd, device, repeats=repeats)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            if bwd is not None:
                bwd()
            torch.cuda.synchronize(device)
            peak_bwd = torch.cuda.max_memory_allocated(device) - base
    if not cuda:
        peak_fwd, peak_bwd = size_peaks(stats)
    del call, out, bwd
    if cuda:
        torch.cuda.empty_cache()
    return Measured(fwd_ms, bwd_ms, int(peak_fwd), int(peak_bwd))


def size_peaks(stats: MetaStats) -> tuple[int, int]:
    """Working memory from tensor sizes, where no allocator reports it.

    Forward: inputs, parameters, outputs and what autograd saves. Backward: saved tensors,
    output gradients, input gradients, parameters and their gradients.
    """
    fwd = stats.input_bytes + stats.param_bytes + stats.output_bytes + stats.saved_bytes
    if not stats.has_backward:
        return fwd, 0
    bwd = stats.saved_bytes + stats.output_bytes + stats.input_bytes + 2 * stats.param_bytes
    return fwd, bwd
