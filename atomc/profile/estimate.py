"""Estimated costs of one operator on a hardware profile: a roofline.

time = max(FLOPs / (peak FLOP/s x efficiency), bytes moved / memory bandwidth) + launch
overhead. Operators that move no data and do no arithmetic (views, shape queries) cost
nothing. Load time is parameter bytes over the profile's host-to-device bandwidth.
"""

from __future__ import annotations

from atomc.ir import HardwareProfile
from atomc.profile.ops import MetaStats


def estimate_ms(stats: MetaStats, hw: HardwareProfile, compute_dtype: str) -> tuple[float, float]:
    """(forward ms, backward ms) of one operator."""
    flops_per_s = hw.peak_tflops[compute_dtype] * 1e12 * hw.compute_efficiency
    bytes_per_s = hw.mem_gbps * 1e9
    launch_ms = hw.launch_overhead_us * 1e-3
    fwd_bytes = stats.input_bytes + stats.param_bytes + stats.output_bytes
    if stats.fwd_flops == 0 and stats.output_bytes == 0:
        fwd_ms = 0.0  # a view or a shape query
    else:
        fwd_ms = max(stats.fwd_flops / flops_per_s, fwd_bytes / bytes_per_s) * 1e3 + launch_ms
    bwd_ms = 0.0
    if stats.has_backward and (stats.bwd_flops or stats.output_bytes):
        # read output grads and saved tensors; write input grads; read params, write their grads
        bwd_bytes = (stats.output_bytes + stats.saved_bytes + stats.input_bytes
                     + 2 * stats.param_bytes)
        bwd_ms = max(stats.bwd_flops / flops_per_s, bwd_bytes / bytes_per_s) * 1e3 + 2 * launch_ms
    return fwd_ms, bwd_ms


def load_ms(num_bytes: int, h2d_gbps: float, launch_overhead_us: float) -> float:
    if num_bytes <= 0:
        return 0.0
    return num_bytes / (h2d_gbps * 1e9) * 1e3 + launch_overhead_us * 1e-3
