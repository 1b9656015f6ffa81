"""Measured CUDA profile: events, allocator peaks, pinned copies. Runs where CUDA exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atomc.profile import profile_model
from atomc.trace import trace_model

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_cuda_profile_measures_allocator_peaks_and_pinned_loads():
    p = profile_model(trace_model(EXAMPLES / "gpt.py", "mini", 4), device="cuda", repeats=3)
    assert p.mode == "measured" and p.device.startswith("cuda:0")
    by_name = dict(zip((n.name for n in p.graph.nodes), p.costs))
    fc = by_name["h_0_mlp_c_fc"]
    assert fc.fwd_ms > 0 and fc.bwd_ms > 0 and fc.load_ms > 0
    assert fc.peak_fwd_bytes >= fc.output_bytes  # from torch.cuda.max_memory_allocated
    assert 1 < p.h2d_gbps < 200  # a real PCIe/NVLink-C2C pinned copy
    # every operator was freed again (cuBLAS keeps a workspace per stream in the allocator:
    # 32 MiB each on Hopper, several streams after a profile; released here, as it is not ours)
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated() < 16 * 2**20
