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


def test_cuda_operator_times_add_up_to_the_model_they_come_from():
    """The cost model's time for the whole model as one range (the device's and the host's
    sides of its operators summed apart, the longer taken) against the model's own forward
    and backward. Each operator's calls are queued back to back, as a step issues them, and
    its backward copies share one engine call. H200, 2026-11-26: one call per timing summed to
    1.6x / 2.5x this model; a sum of each operator's longer side to 1.02x / 1.19x; the longer
    of the two sums to 0.75x / 0.95x (the model's forward carries host work of its own, module
    calls, that no operator holds)."""
    from atomc.partition.tables import node_sides_ms
    from atomc.profile.timing import time_ms

    traced = trace_model(EXAMPLES / "gpt.py", "gpt3-small", 1, options={"seq_len": 512},
                         device="cpu")
    p = profile_model(traced, device="cuda", repeats=3, progress=False)
    sides = [sum(side) for side in zip(*(node_sides_ms(c) for c in p.costs))]
    fwd, bwd = max(sides[0], sides[2]), max(sides[1], sides[3])
    model = traced.module.build_model("gpt3-small", seq_len=512).cuda()
    batch = tuple(t.cuda() for t in traced.inputs)

    def forward() -> torch.Tensor:
        return traced.module.loss_fn(model(*batch), batch)

    with torch.enable_grad():
        whole_fwd = time_ms(forward, torch.device("cuda"), repeats=5)
        params = [q for q in model.parameters() if q.requires_grad]

        def step() -> None:
            torch.autograd.grad(forward(), params)

        whole_bwd = time_ms(step, torch.device("cuda"), repeats=5) - whole_fwd
    print(f"gpt3-small, seq 512: operators sum to forward {fwd:.2f} ms / backward {bwd:.2f} ms "
          f"(device {sides[0]:.2f} / {sides[1]:.2f}, host {sides[2]:.2f} / {sides[3]:.2f}); "
          f"the model measures {whole_fwd:.2f} / {whole_bwd:.2f} ms")
    assert 0.67 < fwd / whole_fwd < 1.33
    assert 0.67 < bwd / whole_bwd < 1.33


def test_the_host_update_rate_is_measured_beside_copies_to_and_from_the_gpu():
    """A CUDA plan takes the host's AdamW rate measured while pinned copies run both ways,
    as the swap runtime's loads and offloads do through the backward its updates overlap."""
    from atomc.calibrate.host import measure_adam_gbps

    alone = measure_adam_gbps()
    beside = measure_adam_gbps(beside_copies=True)
    print(f"host AdamW: {alone:.1f} GB/s alone, {beside:.1f} GB/s beside pinned copies")
    assert 0 < beside < 1.15 * alone
