"""A Plan's recorded per-sub-model times -> the swap schedule's simulated steps."""

from __future__ import annotations

from atomc.ir import Plan
from atomc.simulate.events import Simulation, StageTimes, copies_on_host, simulate_swap
from atomc.units import ms_to_ns


def stage_times(plan: Plan) -> list[StageTimes]:
    """Per-sub-model durations recorded in a plan (per micro-batch times scaled by C).

    With activations="keep" the runtime keeps each sub-model's saved activations on the
    device from its forward to its backward, so nothing streams in for the backward, whatever
    checkpoint time the plan records.
    """
    c = plan.accum
    keep = plan.activations == "keep"
    return [
        StageTimes(
            fwd_ns=c * ms_to_ns(s.fwd_ms), bwd_ns=c * ms_to_ns(s.bwd_ms),
            load_ns=ms_to_ns(s.load_ms),
            checkpoint_ns=0 if keep else ms_to_ns(s.checkpoint_ms),
            offload_ns=ms_to_ns(s.offload_ms),
            optimizer_ns=ms_to_ns(s.optimizer_ms),
            send_ns=ms_to_ns(s.send_ms),
            record_read_ns=ms_to_ns(s.disk_read_ms), record_write_ns=ms_to_ns(s.disk_write_ms),
            image_read_ns=ms_to_ns(s.image_read_ms),
        )
        for s in plan.submodels
    ]


def simulate_plan(plan: Plan, num_steps: int = 1) -> Simulation:
    """The plan's steps as its device runs them (on a CPU, copies on the computing thread)."""
    label = f"{plan.config or plan.model_path}: {len(plan.submodels)} sub-models, C={plan.accum}"
    return simulate_swap(stage_times(plan), plan.accum, num_steps=num_steps, label=label,
                         early_prefetch=plan.early_prefetch,
                         host_copies=copies_on_host(plan.device),
                         host_gap_ns=ms_to_ns(plan.host_gap_ms or 0.0))


__all__ = ["simulate_plan", "stage_times"]
