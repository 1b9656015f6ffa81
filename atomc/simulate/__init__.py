"""Simulate: a swap schedule's stage times -> predicted Timeline, step time and GPU busy fraction.

`simulate_actions` times a list of actions (atomc.actions) on four lanes (compute, prefetch,
offload, CPU optimizer); `simulate_swap` times ATOM's order, the list the swap runtime runs;
`simulate_plan` does it from a Plan's recorded per-sub-model times; `render_timeline_svg`
draws a Timeline (predicted or measured) like ATOM's Fig. 12, `render_timelines_svg` several
one above the other on one time scale.
"""

from __future__ import annotations

from atomc.ir import Plan
from atomc.simulate.events import (
    KINDS,
    LANES,
    Event,
    Simulation,
    StageTimes,
    Timeline,
    copies_on_host,
    simulate_actions,
    simulate_swap,
)
from atomc.simulate.svg import (
    render_timeline_svg,
    render_timelines_svg,
    write_timeline_svg,
    write_timelines_svg,
)
from atomc.simulate.swarm import (
    ChurnTrace,
    SwarmSimConfig,
    SwarmSimResult,
    WiringResult,
    simulate_swarm,
    simulate_wiring,
    synthetic_churn_trace,
)

__all__ = [
    "KINDS", "LANES", "ChurnTrace", "Event", "Simulation", "StageTimes", "SwarmSimConfig",
    "SwarmSimResult", "Timeline", "WiringResult", "render_timeline_svg", "render_timelines_svg",
    "simulate_actions", "simulate_plan", "simulate_swap", "simulate_swarm", "simulate_wiring",
    "stage_times", "synthetic_churn_trace", "write_timeline_svg", "write_timelines_svg",
]


def _ns(ms: float) -> int:
    return round(ms * 1_000_000)


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
            fwd_ns=c * _ns(s.fwd_ms), bwd_ns=c * _ns(s.bwd_ms), load_ns=_ns(s.load_ms),
            checkpoint_ns=0 if keep else _ns(s.checkpoint_ms), offload_ns=_ns(s.offload_ms),
            optimizer_ns=_ns(s.optimizer_ms),
        )
        for s in plan.submodels
    ]


def simulate_plan(plan: Plan, num_steps: int = 1) -> Simulation:
    """The plan's steps as its device runs them (on a CPU, copies on the computing thread)."""
    label = f"{plan.config or plan.model_path}: {len(plan.submodels)} sub-models, C={plan.accum}"
    return simulate_swap(stage_times(plan), plan.accum, num_steps=num_steps, label=label,
                         early_prefetch=plan.early_prefetch,
                         host_copies=copies_on_host(plan.device),
                         host_gap_ns=_ns(plan.host_gap_ms or 0.0))
