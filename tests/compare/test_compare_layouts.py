"""Compare's layouts: PipeDream (asynchronous 1F1B, weight stashing) as a modelled baseline,
its order's invariants, its known answers by hand, and its memory refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from atomc.actions import Action, max_in_flight, one_f_one_b, pipeline_order
from atomc.actions.orders import PIPELINE_ORDERS, pipedream
from atomc.cli import main
from atomc.compare import Setting, check_modes, compare, hardware_models, machines_of
from atomc.compare.layouts import (
    PIPEDREAM_WINDOW,
    SwappedStep,
    pipedream_steps,
    swapped_step,
)
from atomc.compare.report import LABELS, render
from atomc.errors import UsageError
from atomc.place.network import Device, Network
from atomc.profile import profile_model
from atomc.simulate.network import Links, StageCosts, pipeline_jobs, simulate_programs
from atomc.trace import runs_on_for, trace_model
from atomc.units import format_bytes, ms_to_ns

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
HW = "gtx-1080"
LAYOUTS = ("gpipe", "1f1b", "pipedream")


@pytest.fixture(scope="module")
def profile():
    traced = trace_model(GPT, "tiny", 2, runs_on=runs_on_for(HW))
    return profile_model(traced, target=HW)


def network(n: int, gbps: float, memory_bytes: int | None = None) -> Network:
    devices = tuple(Device(f"g{i}", "host", HW, memory_bytes) for i in range(n))
    return Network(devices=devices,
                   delay_ms=tuple(tuple(0.0 for _ in range(n)) for _ in range(n)),
                   bandwidth_gbps=tuple(tuple(gbps for _ in range(n)) for _ in range(n)),
                   name=f"{n}x{gbps:g}").check()


# ---------------------------------------------------------------------------------------------
# the order


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_pipedream_order_runs_1f1b_across_steps_without_a_flush(stages, micro):
    steps = 3
    total = micro * steps
    for j in range(stages):
        order = pipedream(micro, j, stages, steps)
        fb = [a for a in order if a.kind in "FB"]
        # every micro-batch of every step: one forward, then one backward
        assert sorted((a.kind, a.micro) for a in fb) == sorted(
            (k, m) for m in range(total) for k in "FB")
        for m in range(total):
            assert fb.index(Action("F", j, m)) < fb.index(Action("B", j, m))
        # an update after each backward, once its gradients have gone back
        assert sum(a.kind == "U" for a in order) == total
        for i, a in enumerate(order):
            if a.kind == "B":
                rest = order[i + 1:i + 3]
                assert Action("U", j) in rest
                if j > 0:
                    assert rest[0] == Action("S", j, a.micro) and rest[1] == Action("U", j)
        # D_PP - j micro-batches in flight, the same as 1F1B's over all the steps
        assert max_in_flight(order) == min(stages - j, total)
        assert [a for a in order if a.kind != "U"] == one_f_one_b(total, j, stages)
        # no flush: a stage that warms up starts the next step before it ends this one;
        # 1F1B-with-flush, step after step, does not
        flushed = [Action(a.kind, a.index, a.micro + s * micro) for s in range(steps)
                   for a in one_f_one_b(micro, j, stages)]
        for s in range(1, steps):
            first_f, last_b = Action("F", j, s * micro), Action("B", j, s * micro - 1)
            assert flushed.index(first_f) > flushed.index(last_b)
            if stages - j - 1 >= 1:
                assert order.index(first_f) < order.index(last_b)


def test_the_runner_still_runs_only_gpipe_and_1f1b():
    assert PIPELINE_ORDERS == ("gpipe", "1f1b")
    with pytest.raises(UsageError, match="pipedream"):
        pipeline_order("pipedream", 4, 0, 2)
    with pytest.raises(ValueError, match="at least one step"):
        pipedream(4, 0, 2, 0)


def _simulate(orders, costs, links, micro: int):
    """Each stage's PipeDream order on its own device, with a mark after each step's last
    backward; the mean of the steady window."""
    n = len(orders)
    first = pipedream_steps(n, micro)[1]

    def update(m):
        return [("mark", m // micro)] if (m + 1) % micro == 0 else []

    progs = [pipeline_jobs(orders[j], costs[j], step=0, replica=0,
                           prev_device=j - 1 if j else None,
                           next_device=j + 1 if j < n - 1 else None, update=update)
             for j in range(n)]
    sim = simulate_programs(progs, links)
    last = first + PIPEDREAM_WINDOW - 1
    return (sim.step_end(last) - sim.step_end(first - 1)) // PIPEDREAM_WINDOW


def test_pipedream_on_an_infinitely_fast_link_has_no_bubble():
    """D_PP stages computing f + b on an infinitely fast link: the steady step is M (f + b),
    where GPipe and 1F1B-with-flush pay (D_PP - 1)(f + b) more to fill and drain."""
    f, b, m, n = 10, 25, 6, 4
    links = Links.uniform(n, math.inf)
    costs = [StageCosts(f, b, 1, 1, 1, 1)] * n
    steps = pipedream_steps(n, m)[0]
    assert _simulate([pipedream(m, j, n, steps) for j in range(n)], costs, links, m) \
        == m * (f + b)
    for sched in ("gpipe", "1f1b"):
        progs = [pipeline_jobs(pipeline_order(sched, m, j, n), costs[j], step=0, replica=0,
                               prev_device=j - 1 if j else None,
                               next_device=j + 1 if j < n - 1 else None) + [("mark", 0)]
                 for j in range(n)]
        assert simulate_programs(progs, links).step_end(0) == (m + n - 1) * (f + b)
    # stages of different speeds: the slowest sets the pace, with no bubble either
    costs = [StageCosts(f + 3 * j, b - j, 1, 1, 1, 1) for j in range(n)]
    assert _simulate([pipedream(m, j, n, steps) for j in range(n)], costs, links, m) \
        == m * max(c.fwd_ns + c.bwd_ns for c in costs)


def test_pipedream_predicted_with_no_bubble_and_the_pipelines_with_theirs(profile):
    """compare, 2 devices on a link too fast to matter: PipeDream's global batch is M times
    the slower stage's forward and backward; GPipe's is longer by the faster stage's forward
    and backward of one micro-batch (its fill and drain), 1F1B's by its waits."""
    net = network(2, 1e9)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, sync=False, stages=(2,))
    models = hardware_models([profile], machines_of(net), no_update=True)
    c = compare([profile], net, setting, modes=LAYOUTS, models=models)
    hm = models[HW]
    p = c.results["pipedream"]
    m = p.detail["micro_batches"]
    (f0, b0), (f1, b1) = (hm.stage_compute_ns(*r) for r in p.detail["ranges"])
    slow = max(f0 + b0, f1 + b1)
    assert m * slow <= p.step_ns <= m * slow + 4 * m  # a nanosecond a message at most
    assert p.detail["weight_versions"] == [2, 1]
    assert f0 >= f1 and b0 >= b1  # stage 0 the slower both ways, as GPipe's answer needs
    gpipe = m * (f0 + b0) + f1 + b1
    assert gpipe <= c.results["gpipe"].step_ns <= gpipe + 4 * m
    assert c.results["1f1b"].step_ns > p.step_ns + 4 * m
    assert max(s for _, s in p.busy) == pytest.approx(1.0, abs=1e-6)


def test_a_slow_link_binds_pipedream_both_ways_at_once(profile):
    """At 10 kbit/s the link binds: PipeDream sends one micro-batch's values while the
    gradients of an earlier one come back, on the two one-way lanes at once, so its step is
    the busier lane's bytes over the bandwidth; 1F1B-with-flush waits for the last
    gradients besides, and GPipe sends the values, then the gradients."""
    gbps = 1e-5
    net = network(2, gbps)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, sync=False, stages=(2,))
    models = hardware_models([profile], machines_of(net), no_update=True)
    c = compare([profile], net, setting, modes=LAYOUTS, models=models)
    hm = models[HW]
    p, one, g = (c.results[k] for k in ("pipedream", "1f1b", "gpipe"))
    m = p.detail["micro_batches"]
    values, grads = hm.boundary_bytes(p.detail["ranges"][1][0])
    t_values = (values + hm.rng_state_bytes) * 8 / (gbps * 1e9) * 1e9
    t_grads = grads * 8 / (gbps * 1e9) * 1e9
    assert p.step_ns == pytest.approx(m * max(t_values, t_grads), rel=0.001)
    assert one.step_ns == pytest.approx(m * t_values + t_grads, rel=0.01)
    assert g.step_ns == pytest.approx(m * (t_values + t_grads), rel=0.01)
    assert "link" in p.binding
    assert max(s for *_, s in p.links) == pytest.approx(1.0, abs=0.001)


def test_pipedream_stashes_weight_versions_and_is_refused_where_they_do_not_fit(profile):
    """Stage 0 of two holds two weight versions besides its gradient: with a device just
    large enough for 1F1B's stage 0 recomputing its blocks, PipeDream does not fit even
    recomputing them, and says which device and how many bytes."""
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, sync=False, stages=(2,))
    big = network(2, 10.0)
    models = hardware_models([profile], machines_of(big), no_update=True)
    r = compare([profile], big, setting, modes=LAYOUTS, models=models).results["pipedream"]
    hm = models[HW]
    (a, z), _ = r.detail["ranges"]
    weights = hm.param_bytes(set().union(*(u.params for u in hm.units[a:z])))
    one_f_one_b_need = hm.stage_memory_bytes(a, z, 2, recompute=True)
    need = one_f_one_b_need + weights  # 2 versions
    assert hm.stage_memory_bytes(a, z, 2) + weights > need  # keeping graphs needs more
    net = network(2, 10.0, memory_bytes=one_f_one_b_need)
    c = compare([profile], net, setting, modes=LAYOUTS, models=models).results
    assert c["1f1b"].feasible
    assert not c["pipedream"].feasible
    device = r.detail["devices"][0][0]
    reason = c["pipedream"].reason
    assert f"({need} bytes) on device {device}" in reason
    assert "2 weight versions stashed" in reason and f"({one_f_one_b_need} bytes)" in reason
    # with updates, stage 0 also holds AdamW's two moments (of its weights and buffers)
    synced = hardware_models([profile], machines_of(big), no_update=False)
    held = sum(s.param_bytes for s in hm.block_plan.submodels[a:z])
    assert synced[HW].stage_memory_bytes(a, z, 2) - hm.stage_memory_bytes(a, z, 2) == 2 * held


# ---------------------------------------------------------------------------------------------
# a mode asked for by name, never by default, never the fastest


def test_pipedream_is_asked_for_by_name_and_never_the_fastest(profile, tmp_path, capsys):
    assert "pipedream" not in check_modes(None)
    assert check_modes("pipedream,gpipe") == ("gpipe", "pipedream")
    net = network(2, 1e9)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, sync=False, stages=(2,))
    models = hardware_models([profile], machines_of(net), no_update=True)
    assert "pipedream" not in compare([profile], net, setting, models=models).results
    c = compare([profile], net, setting, modes=LAYOUTS, models=models)
    p = c.results["pipedream"]
    assert p.step_ns < min(c.results[k].step_ns for k in ("gpipe", "1f1b"))
    assert c.fastest().mode != "pipedream"
    text = render(c)
    assert "fastest: PipeDream" not in text and LABELS["pipedream"] in text
    assert "does not run" in LABELS["pipedream"]
    # the CLI
    path = tmp_path / "net.json"
    path.write_text(json.dumps(net.to_json()))
    prof = profile.save(tmp_path / "tiny.profile.json")
    assert main(["compare", str(prof), "--network", str(path), "--global-batch", str(8 * b),
                 "--modes", "1f1b,pipedream", "--stages", "2", "--no-sync"]) == 0
    out = capsys.readouterr().out
    assert LABELS["pipedream"] in out and "fastest: layout, 1F1B" in out


def test_pipedream_updates_after_every_micro_batch(profile):
    """With averaging on, PipeDream's replicas of a stage average each micro-batch's gradients
    and step AdamW before the next (PipeDream's mini-batch): one stage x 2 replicas at
    10 Mbit/s pays M exchanges and M optimizer steps where the layout runner's GPipe pays one
    of each per global batch."""
    gbps = 0.01
    net = network(2, gbps)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, sync=True, stages=(1,))
    models = hardware_models([profile], machines_of(net), no_update=False)
    c = compare([profile], net, setting, modes=("gpipe", "pipedream"), models=models).results
    hm = models[HW]
    p, g = c["pipedream"], c["gpipe"]
    m = p.detail["micro_batches"]
    fwd, bwd = hm.stage_compute_ns(0, len(hm.units))
    every = set().union(*(u.params for u in hm.units))
    share = math.ceil(hm.param_bytes(every) / 2)
    exchange = 2 * math.ceil(share * 8 * 1e9 / (gbps * 1e9))
    opt = hm.optimizer_ns(every)
    assert opt > 0 and p.detail["weight_versions"] == [1]
    assert p.step_ns == m * (fwd + bwd + exchange + opt)
    assert g.step_ns == m * (fwd + bwd) + exchange + opt


# ---------------------------------------------------------------------------------------------
# swapped stages


@pytest.fixture(scope="module")
def heavy():
    """A model whose weights outweigh its activations (gpt.py's mini on 4-token sequences):
    its stages fit a small device swapped, and in no resident way."""
    traced = trace_model(GPT, "mini", 1, {"seq_len": 4}, runs_on=runs_on_for(HW))
    return profile_model(traced, target=HW)


def test_a_stage_that_does_not_fit_resident_runs_swapped(heavy):
    """One device that holds the model only swapped (the runner's `_decide_swap` with the
    device's memory as the budget): GPipe's step is the swapped stage's list timed by the
    events simulator; 1F1B (which the runner would run as GPipe) and PipeDream are refused;
    with a byte less, or too little host memory, GPipe is refused too, in one line."""
    m = 4
    setting = Setting(global_batch=m * heavy.graph.batch_size, sync=False, stages=(1,))
    models = hardware_models([heavy], machines_of(network(1, 1e9)), no_update=True)
    hm = models[HW]
    units = hm.units
    n = len(units)
    need = (4 * max(u.param_bytes for u in units)  # two weight and two gradient slots
            + m * sum(hm.boundary_bytes(i)[0] for i in range(1, n))
            + max(s.peak_bytes - s.param_bytes for s in hm.block_plan.submodels))
    assert hm.swapped_stage_memory_bytes(0, n, m) == need
    assert min(hm.stage_memory_bytes(0, n, m), hm.stage_memory_bytes(0, n, 1, True)) > need
    c = compare([heavy], network(1, 1e9, memory_bytes=need), setting, modes=LAYOUTS,
                models=models).results
    g = c["gpipe"]
    assert g.feasible and g.detail["swapped"] == [0] and "swapped" in g.config
    step = swapped_step(hm, 0, n, m, 0, True)
    assert g.step_ns == step.forward_ns and step.backward_ns == 0
    # every micro-batch through every block, the backward recomputing all but the last
    assert step.compute_ns == m * (sum(u.fwd_ns + u.bwd_ns for u in units)
                                   + sum(u.fwd_ns for u in units[:-1]))
    loads = [ms_to_ns(s.load_ms) for s in hm.block_plan.submodels]
    assert step.forward_ns >= step.compute_ns + loads[0] and step.copies_ns >= sum(loads)
    assert g.mean_busy() == pytest.approx(step.compute_ns / g.step_ns)
    # one block holding the output: its list loads it first (the previous step's update
    # changed it), F and B alternate, and its gradients leave after its last backward
    last = units[-1]
    alone = m * (last.fwd_ns + last.bwd_ns)
    load = loads[-1]
    offload = ms_to_ns(hm.block_plan.submodels[-1].offload_ms)
    assert swapped_step(hm, n - 1, n, m, 0, True) == SwappedStep(load + alone + offload, 0,
                                                                 alone, load)
    assert not c["1f1b"].feasible and "whole layout as GPipe" in c["1f1b"].reason
    assert not c["pipedream"].feasible
    tight = compare([heavy], network(1, 1e9, memory_bytes=need - 1), setting, modes=("gpipe",),
                    models=models).results["gpipe"]
    assert not tight.feasible
    assert f"needs {format_bytes(need)} ({need} bytes) of memory on device g0" in tight.reason
    host = hm.swapped_stage_host_bytes(0, n, m)
    assert host >= 3 * hm.param_bytes(set(heavy.graph.params))  # masters and two moments
    poor = compare([heavy], network(1, 1e9, memory_bytes=need), setting, modes=("gpipe",),
                   models=models, host_memory=[host - 1]).results["gpipe"]
    assert not poor.feasible and f"({host} bytes) of host memory on device g0" in poor.reason


def test_swapped_stages_in_a_gpipe_pipeline(heavy):
    """Two swapped stages on an infinitely fast link: stage 1 waits for every micro-batch's
    values, so the step is stage 0's forward part, stage 1's whole step and stage 0's
    backward part one after the other (the links add a nanosecond a message)."""
    m = 4
    setting = Setting(global_batch=m * heavy.graph.batch_size, sync=False, stages=(2,))
    models = hardware_models([heavy], machines_of(network(2, 1e9)), no_update=True)
    hm = models[HW]
    free = compare([heavy], network(2, 1e9), setting, modes=("gpipe",), models=models)
    (a, z), (_, e) = free.results["gpipe"].detail["ranges"]
    need = max(hm.swapped_stage_memory_bytes(a, z, m), hm.swapped_stage_memory_bytes(z, e, m))
    g = compare([heavy], network(2, 1e9, memory_bytes=need), setting, modes=("gpipe",),
                models=models).results["gpipe"]
    assert g.detail["swapped"] == [0, 1] and g.detail["ranges"] == [[a, z], [z, e]]
    first, second = swapped_step(hm, a, z, m, 0, False), swapped_step(hm, z, e, m, 1, True)
    assert first.backward_ns > 0 and second.backward_ns == 0
    by_hand = first.forward_ns + second.forward_ns + first.backward_ns
    assert by_hand <= g.step_ns <= by_hand + 4 * m


# ---------------------------------------------------------------------------------------------
# compare's layouts and the layout runner decide every stage alike


def _agree_with_the_runner(models, network_of, setting, sizes) -> int:
    """For each device memory in `sizes`, the layouts compare predicts (GPipe and 1F1B) against
    the layout runner's swap decision (runner.decide_swaps over its budgets, runner.
    resident_need over the plan of compare's blocks: the package the layout's stages cut):
    compare's step as the runner runs it (one flush, graphs kept, a stage swapped where it
    does not fit) swaps the stages the runner swaps, and 1F1B keeps every stage resident
    exactly where the runner keeps 1F1B. Returns how many stages were decided."""
    from atomc.compare.layouts import _stage_costs
    from atomc.distributed.swapping import decide_swaps, device_budget, resident_need

    decided = 0
    for memory in sizes:
        net = network_of(memory)
        machines = machines_of(net)
        ref = models[machines[0].hardware]
        c = compare([m.profile for m in models.values()], net, setting, modes=("gpipe", "1f1b"),
                    models=models).results
        for sched, result in c.items():
            if not result.feasible:
                continue
            ranges = [tuple(r) for r in result.detail["ranges"]]
            index = {m.name: i for i, m in enumerate(machines)}
            matrix = [[index[d] for d in row] for row in result.detail["devices"]]
            micro = result.detail["micro_batches"]
            budgets = [[device_budget(machines[d].name, None, machines[d].memory_bytes,
                                      "memory_bytes in the network", ref.block_plan.reserve_bytes)
                        for d in row] for row in matrix]

            def need(j, schedule, plan=ref.block_plan, ranges=ranges, micro=micro):
                return resident_need(plan, ranges, micro, j, schedule)

            runner = decide_swaps(sched, budgets, (), need)
            got, _ = _stage_costs(sched, machines, models, ref, ranges, matrix, micro, micro,
                                  False, swap_ok=sched == "gpipe")
            if sched == "1f1b":  # the runner keeps 1F1B exactly where every stage fits
                assert (got is not None) == (not runner.swapped), (memory, runner.lines(sched))
            elif got is not None:
                assert got[2] == set(runner.swapped), (memory, runner.lines(sched))
                assert runner.schedule == "gpipe"
            decided += len(ranges)
    return decided


def test_compare_and_the_runner_swap_the_same_stages_of_the_mini_gpt(heavy):
    """The mini GPT on two and four devices, from memory where every stage swaps to memory
    where none does."""
    models = hardware_models([heavy], machines_of(network(4, 1e9)), no_update=False)
    hm = models[HW]
    n = len(hm.units)
    low = hm.swapped_stage_memory_bytes(0, n, 4)
    high = hm.stage_memory_bytes(0, n, 4)
    sizes = [low + (high - low) * k // 8 for k in range(9)]
    for stages in (2, 4):
        setting = Setting(global_batch=4 * heavy.graph.batch_size, stages=(stages,))
        assert _agree_with_the_runner(models, lambda mem, s=stages: network(s, 1.0, mem),
                                      setting, sizes) > 0


@pytest.mark.slow
def test_compare_and_the_runner_swap_the_same_stages_of_llama_on_a_mixed_network():
    """Llama-1.3B (examples/hf.py) on two V100s and two 1080 Tis at two sites
    (examples/networks/two-sites.json), at each device's own memory and at less."""
    from atomc.place.network import load_network

    hf = Path(__file__).resolve().parents[2] / "examples" / "hf.py"
    net = Path(__file__).resolve().parents[2] / "examples" / "networks" / "two-sites.json"
    traced = trace_model(hf, "llama-1.3b", 1, {"seq_len": 512}, runs_on="cuda")
    profiles = [profile_model(traced, target=t) for t in ("v100-32gb", "gtx-1080-ti")]
    base = load_network(net)
    models = hardware_models(profiles, machines_of(base), no_update=False)
    setting = Setting(global_batch=8, stages=(2, 4))

    def network_of(scale):
        if scale is None:
            return base
        devices = tuple(dataclasses.replace(d, memory_bytes=int(m.memory_bytes * scale))
                        for d, m in zip(base.devices, machines_of(base)))
        return dataclasses.replace(base, devices=devices).check()

    assert _agree_with_the_runner(models, network_of, setting, [None, 0.5, 0.25]) > 0
