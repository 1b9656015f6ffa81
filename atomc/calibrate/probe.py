"""The swap runtime on a package of tiny sub-models: its own time per action on a CPU.

Input: a device. Output, in ms: the runtime thread's time before each action it runs beyond
what the action's own work takes (the `host_gap` the simulator charges on a CPU device), and
its time inside a sub-model's forward and inside its backward beyond the operators' (their
arguments and outputs, the RNG rule, the autograd call, the gradients zeroed and summed).

The package is built in memory: `NUM_SUBMODELS` sub-models, each a Linear on a few numbers,
chained, with a sum as the loss, so that their compute, loads and copies take microseconds.
The swap executor (atomc.runtime.executor) runs ATOM's order on it with tracing on, exactly
as it runs a generated package; the time the step does not spend inside an event is the
runtime's own: the interpreter's Python, the RNG rule, the spans, the activation stash. The
simulator fits it as calibration does (atomc.simulate.events.fit_host_gap_ms): the gap before each
action that makes the simulated step the measured one.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from torch import nn

from atomc.calibrate.measure import summarise
from atomc.runtime.executor import SwapExecutor
from atomc.runtime.optim import AdamWConfig, updates_on_a_thread
from atomc.runtime.package import PackagePlan, SwapPackage
from atomc.runtime.steprun import StepOptions
from atomc.runtime.trace import Tracer
from atomc.simulate.events import StageTimes, fit_host_gap_ms
from atomc.units import ms_to_ns

NUM_SUBMODELS = 6
WIDTH = 8
STEPS = 30
WARMUP = 5


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _package():
    k = NUM_SUBMODELS
    names = ["x", *(f"h{i}" for i in range(1, k + 1))]

    def build(device=None):
        return [_Tiny().to(device) if device is not None else _Tiny() for _ in range(k)]

    spec = {"shape": [1, WIDTH], "dtype": "float32"}
    return SwapPackage(
        path=Path("<runtime probe>"), module=None, classes=[_Tiny] * k,  # type: ignore[arg-type]
        model_inputs=("x",), inputs=[(names[i],) for i in range(k)],
        outputs=[(names[i + 1],) for i in range(k)],
        boundaries=[{"inputs": {names[i]: spec}, "outputs": {names[i + 1]: spec}}
                    for i in range(k)],
        plan=PackagePlan(accum=1), param_names=[{"lin.weight": f"s{i}.weight",
                                                 "lin.bias": f"s{i}.bias"} for i in range(k)],
        tied={}, build_submodels=build, load_original_state_dict=None,  # type: ignore[arg-type]
        export_state_dict=None)  # type: ignore[arg-type]


def _executor(device: torch.device):
    pkg = _package()
    ex = SwapExecutor.assemble(
        pkg, pkg.build_submodels(), AdamWConfig(), device=device, master_dtype=torch.float32,
        tracer=Tracer(device, enabled=True, keep_last=STEPS + WARMUP + 1),
        threaded=updates_on_a_thread(device),
        step=StepOptions(accum=1, activations="recompute", offload_activations=True,
                         autocast_dtype=None, loss_fn=lambda out, batch: out.sum(), seed=0))
    return ex, ex.opt


def runtime_ms(device: torch.device) -> tuple[float, float, float]:
    """The runtime's own time before each action, and inside a forward and a backward of one
    micro-batch, in ms (see the module docstring). The tiny sub-models' forward and backward
    calls are taken whole: their operators (a Linear on 8 numbers) take a few microseconds of
    them, which the runtime's own time is then overstated by."""
    ex, opt = _executor(device)
    try:
        x = torch.randn(1, WIDTH, device=device)
        traces = []
        for step in range(WARMUP + STEPS + 1):
            _, trace = ex.run_step([(x,)], step)
            if step >= WARMUP and trace is not None:
                traces.append(trace)
        opt.wait_all()
    finally:
        opt.close()
    m = summarise(traces, num_submodels=NUM_SUBMODELS, accum=1, activations="recompute",
                  device=str(device), plan_hash="")

    stages = [StageTimes(fwd_ns=ms_to_ns(s.fwd_ms), bwd_ns=ms_to_ns(s.bwd_ms),
                         load_ns=ms_to_ns(s.load_ms), checkpoint_ns=ms_to_ns(s.checkpoint_ms),
                         offload_ns=ms_to_ns(s.offload_ms), optimizer_ns=ms_to_ns(s.optimizer_ms))
              for s in m.submodels]
    gap = fit_host_gap_ms(stages, 1, False, statistics.median(m.step_ms))
    # the last sub-model's backward recomputes nothing (its forward kept its graph)
    recomputing = m.submodels[:-1]
    return (gap, statistics.median(s.fwd_ms for s in m.submodels),
            statistics.median(s.bwd_ms for s in recomputing))
