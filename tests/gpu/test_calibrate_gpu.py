"""Calibration on CUDA: steps timed with CUDA events on the executor's streams calibrate a
profile measured on the same GPU, and compute spans time compute only (no load waits)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from atomc.calibrate import calibrate, measure_package, measure_runtime_costs
from atomc.codegen import generate
from atomc.device import describe_device
from atomc.partition import partition, recost
from atomc.profile import profile_model
from atomc.trace import trace_model

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
GPT_PATH = REPO / "examples" / "gpt.py"


def test_cuda_steps_calibrate_a_cuda_profile(tmp_path):
    traced = trace_model(GPT_PATH, "mini", 4, device="cpu")
    profile = profile_model(traced, device="cuda", repeats=3, progress=False,
                            runtime_costs=measure_runtime_costs)
    budget = 64 * sum(s.num_bytes for s in traced.graph.params.values())
    plan = partition(profile, budget, reserve_bytes=0, accum=2, cpu_adam_gbps=4.0)
    while len(plan.submodels) < 3:  # shrink the budget until the model is cut
        budget = int(budget * 0.8)
        plan = partition(profile, budget, reserve_bytes=0, accum=2, cpu_adam_gbps=4.0)
    pkg = generate(plan, tmp_path / "pkg", traced=traced)

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 256, (plan.accum * 4, 64), generator=g)

    m, traces = measure_package(pkg, steps=4, warmup=2, device="cuda", batches=batch)
    assert m.device == describe_device(torch.device("cuda", torch.cuda.current_device()))
    assert m.device == plan.device and m.h2d_gbps > 0
    for t in traces:  # one compute stream: its spans do not overlap
        spans = sorted((e.start_ms, e.end_ms) for e in t.events if e.lane == "compute")
        assert all(a[1] <= b[0] + 1e-3 for a, b in itertools.pairwise(spans))
    cal = calibrate(profile, plan, m)
    after = recost(cal, plan, cpu_adam_gbps=cal.calibration.cpu_adam_gbps)
    for sm, ms in zip(after.submodels, m.submodels):
        assert sm.fwd_ms == pytest.approx(ms.fwd_ms, abs=1e-4)
    assert cal.calibration.device == plan.device
