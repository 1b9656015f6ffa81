"""Simulate: a swap schedule's stage times -> predicted Timeline, step time and GPU busy fraction.

`simulate_actions` times a list of actions (atomc.actions) on four lanes (compute, prefetch,
offload, CPU optimizer); `simulate_swap` times ATOM's order, the list the swap runtime runs;
`simulate_plan` does it from a Plan's recorded per-sub-model times; `render_timeline_svg`
draws a Timeline (predicted or measured) like ATOM's Fig. 12, `render_timelines_svg` several
one above the other on one time scale.
"""

from __future__ import annotations

from atomc.simulate.events import (
    KINDS,
    LANES,
    Event,
    Simulation,
    StageTimes,
    Timeline,
    binding_lane,
    gradients_in_flight,
    simulate_actions,
    simulate_swap,
)
from atomc.simulate.plan import simulate_plan, stage_times
from atomc.simulate.svg import (
    render_timeline_svg,
    render_timelines_svg,
    write_timeline_svg,
    write_timelines_svg,
)

__all__ = [
    "KINDS", "LANES", "Event", "Simulation", "StageTimes",
    "Timeline", "binding_lane", "gradients_in_flight",
    "render_timeline_svg", "render_timelines_svg",
    "simulate_actions", "simulate_plan", "simulate_swap",
    "stage_times", "write_timeline_svg", "write_timelines_svg",
]
