"""Measured costs of one operator on a real device (CPU or CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from atomc.ir import IssueTimes
from atomc.profile.ops import MetaStats, OpCall, backward_fn, build_call, differentiable_outputs
from atomc.profile.timing import device_host_ms


@dataclass
class Measured:
    fwd_ms: float  # the longer of the device's and the host's time
    bwd_ms: float
    peak_fwd_bytes: int
    peak_bwd_bytes: int
    issue: IssueTimes | None  # on CUDA, the two apart


def measure(gm: fx.GraphModule, node: fx.Node, values: dict[str, Any], stats: MetaStats,
            device: torch.device, repeats: int) -> Measured:
    """Materialise the operator alone on `device`, time forward and backward, free it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
    call = build_call(gm, node, values, device)
    with torch.enable_grad():
        fwd = device_host_ms(call.fn, device, repeats=repeats)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        out = call.fn()
        if cuda:
            torch.cuda.synchronize(device)
            peak_fwd = torch.cuda.max_memory_allocated(device) - base
        bwd = backward_fn(call, differentiable_outputs(out))
        back = (0.0, 0.0)
        if bwd is not None:
            back = _backward_ms(gm, node, values, stats, device, repeats, bwd)
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
    issue = IssueTimes(fwd[0], back[0], fwd[1], back[1]) if cuda else None
    return Measured(max(fwd), max(back), int(peak_fwd), int(peak_bwd), issue)


# One engine call runs the backward of copies of the operator until they hold about this
# much time, at most MAX_COPIES of them and COPY_BYTES of their tensors together.
SAMPLE_MS = 2.0
MAX_COPIES = 32
COPY_BYTES = 256 * 2**20


def _backward_ms(gm: fx.GraphModule, node: fx.Node, values: dict[str, Any], stats: MetaStats,
                 device: torch.device, repeats: int,
                 bwd: Callable[[], Any]) -> tuple[float, float]:
    """Device and host time of one operator's backward, without the costs of timing it alone.

    Each `torch.autograd.grad` call pays a fixed cost (on CUDA, a hand-off to the engine's
    device thread and back) that a model's backward pays once for all its operators, and
    each root and captured input of a call costs the host more work again. Timed alone, small
    operators carried both: GPT-3 small's operators summed to 2.1x its measured backward on
    an H200. Independent copies of the operator (their own inputs and parameters, so no
    gradient is summed across them) go through one call, as a model's operators do, and on
    CUDA the host's share is taken less what a copy of an operator without kernels (a view)
    costs it.
    """
    one = device_host_ms(bwd, device, warmup=1, repeats=3)
    per_copy = stats.input_bytes + 2 * stats.param_bytes + stats.output_bytes + stats.saved_bytes
    copies = min(MAX_COPIES, int(SAMPLE_MS / max(*one, 1e-3)),
                 COPY_BYTES // max(per_copy, 1))
    if copies < 2:
        return one
    calls = [build_call(gm, node, values, device) for _ in range(copies)]
    gpu, host = device_host_ms(_grad_of_all(calls), device, warmup=1, repeats=repeats)
    if device.type == "cuda":
        host = max(host - copies * _harness_ms(device), 0.0)
    return gpu / copies, host / copies


def _grad_of_all(calls: list[OpCall]) -> Callable[[], Any]:
    """One backward through the graphs of all `calls` (run once here), repeatable: the
    operator's `backward_fn`, over every copy's outputs and inputs together."""
    outputs = [t for c in calls for t in differentiable_outputs(c.fn())]
    together = OpCall(fn=calls[0].fn, grad_inputs=[t for c in calls for t in c.grad_inputs],
                      params=[], input_bytes=0, param_bytes=0)
    return backward_fn(together, outputs)


_HARNESS_MS: dict[str, float] = {}


def _harness_ms(device: torch.device) -> float:
    """The host's time per copy for the backward of a view (no kernels), once per device."""
    key = str(device)
    if key not in _HARNESS_MS:
        copies = []
        for _ in range(MAX_COPIES):
            x = torch.zeros(16, device=device, requires_grad=True)
            copies.append(OpCall(fn=lambda x=x: x.view(4, 4), grad_inputs=[x], params=[],
                                 input_bytes=0, param_bytes=0))
        with torch.enable_grad():
            _, host = device_host_ms(_grad_of_all(copies), device, warmup=2, repeats=5)
        _HARNESS_MS[key] = host / MAX_COPIES
    return _HARNESS_MS[key]


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
