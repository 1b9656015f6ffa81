"""Simulate: the swap schedule by hand, steady-state steps, Timeline JSON, the timeline SVG."""

from __future__ import annotations

import dataclasses
import importlib.resources
import itertools
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from atomc.partition import partition
from atomc.simulate import (
    LANES,
    StageTimes,
    Timeline,
    render_timeline_svg,
    simulate_plan,
    simulate_swap,
    stage_times,
    write_timeline_svg,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthetic import MB, block_profile

SVG = "{http://www.w3.org/2000/svg}"
MS = 1_000_000


def stage(fwd, bwd, load, ckpt=0, off=0, opt=0) -> StageTimes:
    return StageTimes(fwd * MS, bwd * MS, load * MS, ckpt * MS, off * MS, opt * MS)


def spans(sim, lane, kind=None):
    return [(e.submodel, e.start_ms, e.end_ms) for e in sim.timeline.lane_events(lane)
            if kind is None or e.kind == kind]


def test_three_submodels_by_hand():
    # P1's load (5) outlasts P0's forward (2): the compute lane waits; everything else hides
    stages = [stage(2, 6, 1, 0, 1, 1), stage(3, 9, 5, 1, 2, 2), stage(4, 12, 3, 1, 1, 1)]
    sim = simulate_swap(stages, accum=1)
    assert spans(sim, "compute") == [
        (0, 0, 2), (1, 5, 8), (2, 8, 12),  # forward; P1 waits for its load until 5
        (2, 12, 24), (1, 24, 33), (0, 33, 39),  # backward; P1 is still in its slot after P2's
    ]
    # P1 is not loaded again for its backward; its checkpoint streams in first, then P0 loads
    assert spans(sim, "prefetch") == [(1, 0, 5), (2, 5, 8), (2, 12, 13), (1, 24, 25),
                                      (0, 25, 26), (0, 41, 42)]
    assert spans(sim, "offload") == [(2, 24, 25), (1, 33, 35), (0, 39, 40)]
    assert spans(sim, "optimizer") == [(2, 25, 26), (1, 35, 37), (0, 40, 41)]
    # step: the backward of P0 ends at 39, its gradients leave (1), the CPU updates it (1), and
    # its parameters come back (1)
    assert sim.step_ns == 42 * MS
    assert sim.compute_ns == (2 + 3 + 4 + 6 + 9 + 12) * MS
    assert sim.utilisation == pytest.approx(36 / 42)


def test_gradients_leave_before_the_next_load_lands():
    # P2's gradients take 10 to leave; P0's load streams in behind them into the same buffer
    stages = [stage(1, 20, 1), stage(1, 20, 1, off=10), stage(1, 5, 1, off=10)]
    sim = simulate_swap(stages, accum=1)
    load_p0 = next(s for s in spans(sim, "prefetch", "load") if s[0] == 0)
    offload_p2 = next(s for s in spans(sim, "offload") if s[0] == 2)
    assert load_p0[2] == offload_p2[2]


def test_single_submodel_stays_resident():
    # C is already in the stage times: each micro-batch takes a third, forward then backward
    sim = simulate_swap([stage(3, 6, 3, off=1, opt=2)], accum=3)
    assert spans(sim, "compute") == [(0, 0, 1), (0, 1, 3), (0, 3, 4), (0, 4, 6), (0, 6, 7),
                                     (0, 7, 9)]
    assert spans(sim, "prefetch") == [(0, 12, 15)]  # only the refresh after the update
    assert sim.step_ns == 15 * MS


def test_early_prefetch_loads_the_second_submodel_during_the_tail():
    stages = [stage(1, 3, 2, off=4, opt=4), stage(2, 6, 5, off=1, opt=1)]
    late = simulate_swap(stages, accum=1)
    early = simulate_swap(stages, accum=1, early_prefetch=True)
    assert early.step_ns < late.step_ns
    loads = [e for e in early.timeline.events if e.kind == "load" and e.submodel == 1]
    assert len(loads) == 1 and loads[0].start_ms >= 9  # after P0's backward, in the tail


def test_steps_are_identical_and_bounded():
    stages = [stage(2, 6, 1, 0, 1, 1), stage(3, 9, 5, 1, 2, 2), stage(4, 12, 3, 1, 1, 1)]
    for early in (False, True):
        one = simulate_swap(stages, accum=1, early_prefetch=early)
        three = simulate_swap(stages, accum=1, num_steps=3, early_prefetch=early)
        tl = three.timeline
        assert tl.num_steps == 3
        assert [tl.step_ms(i) for i in range(3)] == [one.step_ns / MS] * 3
        for e in tl.events:
            assert (tl.step_starts_ms[e.step] <= e.start_ms <= e.end_ms
                    <= tl.step_starts_ms[e.step + 1])
        assert tl.utilisation() == pytest.approx(one.utilisation)


def test_timeline_json_round_trip(tmp_path):
    sim = simulate_swap([stage(1, 2, 1), stage(1, 2, 1)], accum=2, num_steps=2, label="x")
    path = sim.timeline.save(tmp_path / "t.json")
    assert Timeline.load(path) == sim.timeline


def test_template_ships_with_the_package():
    res = importlib.resources.files("atomc.templates").joinpath("timeline.svg.jinja")
    assert res.is_file() and "<svg" in res.read_text()


@pytest.fixture(scope="module")
def plan():
    return partition(block_profile(num_blocks=6), 40 * MB, reserve_bytes=0)


def test_plan_replays_to_its_prediction(plan):
    sim = simulate_plan(plan)
    assert sim.step_ns / MS == pytest.approx(plan.predicted_step_ms, abs=1e-9)
    assert sim.utilisation == pytest.approx(plan.predicted_utilisation)


def test_kept_activations_do_not_stream_in(plan):
    # recomputing, a sub-model's inputs come back from the host for its backward; keeping,
    # the runtime holds the saved activations on the device, whatever the plan costs
    assert any(s.checkpoint_ns for s in stage_times(plan))
    keep = dataclasses.replace(plan, activations="keep")
    assert not any(s.checkpoint_ns for s in stage_times(keep))
    assert "checkpoint" not in {e.kind for e in simulate_plan(keep).timeline.events}


def test_timeline_svg_is_well_formed_and_shows_every_submodel(plan, tmp_path):
    sim = simulate_plan(plan, num_steps=2)
    path = write_timeline_svg(sim.timeline, tmp_path / "t.svg")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    lanes = {g.get("data-lane") for g in root.iter(f"{SVG}g") if g.get("class") == "lane"}
    assert lanes == set(LANES) - {"disk"}  # drawn where the plan has states on disk
    events = [g for g in root.iter(f"{SVG}g") if g.get("class") == "event"]
    shown = {int(g.get("data-submodel")) for g in events}
    assert shown == set(range(len(plan.submodels)))
    for g in events:  # every bar says what it is, even when too narrow for a label
        assert g.find(f"{SVG}title").text.startswith(f"sub-model {g.get('data-submodel')} ")
    labels = {t.text for g in events for t in g.iter(f"{SVG}text")}
    assert labels & {str(i) for i in range(len(plan.submodels))}
    boundaries = [g for g in root.iter(f"{SVG}g") if g.get("class") == "step-boundary"]
    assert len(boundaries) == 3  # start of step 1, start of step 2, end


def test_svg_escapes_text():
    sim = simulate_swap([stage(1, 2, 1)], accum=1, label="a <b> & c")
    root = ET.fromstring(render_timeline_svg(sim.timeline))
    assert root.find(f"{SVG}title").text == "a <b> & c"


def test_on_a_cpu_device_one_thread_runs_every_job_updates_included():
    """A CPU plan's runtime computes, copies and updates on one thread (no copy engines, and
    no optimizer thread: atomc.runtime.config), so no two jobs overlap and a step is the sum
    of its jobs and the thread's own time before each action."""
    from atomc.actions import atom_order
    from atomc.simulate.events import StageTimes, simulate_swap

    stages = [StageTimes(fwd_ns=3000 + 100 * i, bwd_ns=7000, load_ns=500, checkpoint_ns=200,
                         offload_ns=400, optimizer_ns=900 + 50 * i) for i in range(4)]
    accum, gap = 2, 30
    sim = simulate_swap(stages, accum, num_steps=2, host_copies=True, host_gap_ns=gap)
    events = sorted(sim.timeline.events, key=lambda e: e.start_ms)
    for a, b in itertools.pairwise(events):
        assert b.start_ms >= a.end_ms - 1e-9, (a, b)
    one_step = [e for e in events if e.step == 1]
    actions = atom_order(len(stages), accum)
    work_ms = sum(e.duration_ms for e in one_step)
    assert sim.step_ns == round(work_ms * 1e6) + gap * len(actions)
    assert any(e.lane == "optimizer" for e in one_step)
