"""Partition: exactness against brute force, the independent checker, folding, C, the CLI."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomc.cli import main
from atomc.errors import InfeasiblePlanError, UsageError
from atomc.ir import HardwareProfile, IssueTimes, Plan, Profile
from atomc.partition import ADVICE_STEP, build_plan, graph_hash, partition, profile_hash
from atomc.partition.accum import physical_bound_accum
from atomc.partition.check import Checker, check_plan
from atomc.partition.constraints import plan_slacks
from atomc.partition.cost import (
    CostParams,
    additive_step_ns,
    plan_costs,
    range_cost,
    range_stage_times,
)
from atomc.partition.precision import Precision, device_view
from atomc.partition.search import block_period, prepare_folding, search
from atomc.partition.tables import build_tables, max_width_for, node_facts
from atomc.simulate.events import simulate_swap
from atomc.units import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.brute_force import LOAD_OVERLAPS, brute_force
from synthetic import MB, block_profile, random_profile

TIME = LOAD_OVERLAPS | {"gradient offload", "optimizer"}


def _with_issue_times(profile: Profile, rng: random.Random) -> Profile:
    """Some nodes timed as on CUDA: device and host sides apart, the node's time the longer."""
    import dataclasses

    costs = []
    for c in profile.costs:
        if rng.random() < 0.5:
            sides = [c.fwd_ms * rng.uniform(0.2, 1.5) for _ in range(2)]
            backs = [c.bwd_ms * rng.uniform(0.2, 1.5) for _ in range(2)]
            c = dataclasses.replace(c, fwd_ms=max(sides), bwd_ms=max(backs),
                                    issue=IssueTimes(sides[0], backs[0], sides[1], backs[1]))
        costs.append(c)
    return dataclasses.replace(profile, costs=tuple(costs))


def _random_case(seed: int, max_nodes: int = 11):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(3, max_nodes))
    if rng.random() < 0.5:
        profile = _with_issue_times(profile, rng)
    accum = rng.randint(1, 4)
    usable = rng.randint(60, 400) * MB
    cpu = rng.choice([8.0, 3.0, 0.0])
    return profile, accum, usable, cpu, rng.choice(["recompute", "recompute", "keep"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_search_matches_brute_force(seed):
    profile, accum, usable, cpu, activations = _random_case(seed)
    facts = node_facts(profile)
    params = CostParams(accum, usable, profile.h2d_gbps, profile.d2h_gbps, cpu, activations)
    full = build_tables(facts, facts.num_nodes)
    pruned = build_tables(facts, max_width_for(facts, usable))
    for tier in (0, 1, 2):
        expected = brute_force(profile, accum, usable, tier, cpu, activations)
        for tables in (full, pruned):
            got = search(tables, params, tier)
            assert (got.objective if got else None) == expected, (tier, tables.max_width)
        if got is not None:
            # the objective the search reports is what its plan costs
            costs = plan_costs(full, params, got.cuts)
            if tier < 2:
                sim = simulate_swap(range_stage_times(costs), accum,
                                    early_prefetch=got.early_prefetch)
                assert sim.step_ns == got.step_ns
            kinds = {v.constraint for v in Checker(profile, accum, usable, activations, cpu)
                     .violations(list(got.cuts), got.early_prefetch)
                     if "in the slots" not in v.message}  # partition adds those
            assert "memory" not in kinds
            if tier == 0:
                assert not kinds


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_tier_0_columns_by_bisection_are_the_full_grid_s(seed):
    """Tier 0 finds each row's best column by bisection where the constraints allow it (a
    column figure that grows with the width); the cuts are the ones the full grid gives, on
    graphs wide enough that rows fall back to the grid."""
    import atomc.partition.search as search_module

    profile, accum, usable, cpu, activations = _random_case(seed, 40)
    facts = node_facts(profile)
    params = CostParams(accum, usable * 4, profile.h2d_gbps, profile.d2h_gbps, cpu, activations)
    tables = build_tables(facts, facts.num_nodes)
    fast = search(tables, params, 0)

    def grid(g, d, col_v, m, rank, row, col):
        return search_module._best_columns(g, d, col_v, 0, search_module._pair_mask(g, d, 0, m),
                                           rank)

    with mock.patch.object(search_module, "_best_columns_sorted", grid):
        assert fast == search(tables, params, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9))
def test_additive_step_is_the_simulated_step(seed):
    """Where offloads and CPU updates keep pace, the search's sum is the simulator's step."""
    profile, accum, _usable, cpu, activations = _random_case(seed, 9)
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(accum, 10**12, profile.h2d_gbps, profile.d2h_gbps, cpu, activations)
    checker = Checker(profile, accum, 10**12, activations, cpu)
    rng = random.Random(seed)
    positions = [q for q in range(1, facts.num_nodes) if tables.allowed[q]]
    for _ in range(10):
        cuts = sorted(rng.sample(positions, rng.randint(0, len(positions))))
        early = bool(cuts) and rng.random() < 0.5
        kinds = {v.constraint for v in checker.violations(cuts, early)}
        if kinds & {"gradient offload", "optimizer", "memory"}:
            continue
        costs = plan_costs(tables, params, cuts)
        sim = simulate_swap(range_stage_times(costs), accum, early_prefetch=early)
        assert sim.step_ns == additive_step_ns(costs, early)


# ---------------------------------------------------------------------------------------------
# repeated blocks


def _period(profile, tables):
    g = profile.graph
    return block_period(tables, g.blocks, tuple(n.block for n in g.nodes),
                        tuple(n.signature for n in g.nodes))


@pytest.mark.parametrize("seed", range(12))
def test_folding_gives_the_same_plan(seed):
    rng = random.Random(seed)
    block = tuple((rng.choice([0, 2, 4, 8]), round(rng.uniform(0.05, 3), 2),
                   round(rng.uniform(0.1, 6), 2))
                  for _ in range(rng.randint(2, 4)))
    profile = block_profile(num_blocks=rng.randint(10, 24), block=block,
                            act_bytes=rng.randint(1, 3) * MB, embed_bytes=rng.randint(2, 20) * MB,
                            h2d_gbps=rng.choice([2.0, 5.0, 10.0]), tied=rng.random() < 0.7)
    facts = node_facts(profile)
    usable = rng.randint(40, 150) * MB
    tables = build_tables(facts, max_width_for(facts, usable))
    period = _period(profile, tables)
    assert period == len(block) + 1
    folding = prepare_folding(tables, period)
    for accum in (1, 2, 4, 8):
        params = CostParams(accum, usable, profile.h2d_gbps, profile.d2h_gbps,
                            rng.choice([8.0, 2.0]))
        for tier in (0, 1, 2):
            a, b = search(tables, params, tier, folding), search(tables, params, tier, None)
            assert (a is None) == (b is None)
            if a:
                assert ((a.objective, a.cuts, a.early_prefetch)
                        == (b.objective, b.cuts, b.early_prefetch))


@pytest.mark.parametrize("reads", [False, True], ids=["modules", "parameter-reads"])
def test_folding_engages_on_long_block_chains(reads):
    """Also where each block reads its weights itself (torch.export's graphs): the reads'
    signatures differ by name, the blocks are alike all the same."""
    profile = block_profile(num_blocks=60, reads=reads)
    plain = partition(profile, 60 * MB, reserve_bytes=0, fold_blocks=False)
    folded = partition(profile, 60 * MB, reserve_bytes=0)
    assert folded.to_json() == {**plain.to_json(), "notes": folded.to_json()["notes"]}
    assert any("folded" in n for n in folded.notes)


# ---------------------------------------------------------------------------------------------
# plans: the independent checker, tied weights, cut tensors, JSON


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**9))
def test_every_returned_plan_passes_the_checker(seed):
    profile, accum, usable, cpu, activations = _random_case(seed)
    fixed = accum if seed % 2 else None
    try:
        plan = partition(profile, usable, reserve_bytes=0, accum=fixed, max_accum=8,
                         cpu_adam_gbps=cpu, activations=activations)
    except InfeasiblePlanError:
        return
    problems = check_plan(profile, plan)
    assert not [v for v in problems
                if v.constraint in ("structure", "recorded", "memory")], problems
    if plan.feasible:
        assert not problems and plan.binding == ""
    else:
        assert problems and plan.binding.startswith("sub-model ")
        assert any(v.constraint in plan.binding for v in problems)


def test_tied_weight_counts_once_per_sub_model():
    profile = block_profile(num_blocks=2, embed_bytes=10 * MB)
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(1, 10**12, 10.0, 10.0)
    n = facts.num_nodes
    whole = range_cost(tables, params, 0, n)
    assert whole.param_bytes == sum(s.num_bytes for s in profile.graph.params.values())
    head, tail = range_cost(tables, params, 0, n - 2), range_cost(tables, params, n - 2, n)
    assert tail.param_bytes == 10 * MB  # the LM head holds the embedding's weight too
    assert head.param_bytes + tail.param_bytes == whole.param_bytes + 10 * MB
    checker = Checker(profile, 1, 10**12, "recompute", 8.0)
    for a, b in [(0, n), (0, n - 2), (n - 2, n), (3, 9)]:
        assert range_cost(tables, params, a, b).param_bytes == checker.range_facts(a, b).param_bytes


def test_a_range_measured_on_cuda_takes_the_longer_of_its_two_sums():
    """Device and host time apart (NodeCost.issue): the host issues ahead of the device, so a
    range costs max(sum of device times, sum of host times), not the sum of each node's
    longer side; nodes timed as one figure add to both sides."""
    import dataclasses

    profile = block_profile(num_blocks=2)
    costs = list(profile.costs)
    # block 0's three operators: device-bound, host-bound, device-bound (fwd; bwd mirrored)
    ops = [i for i, n in enumerate(profile.graph.nodes) if n.name.startswith("h_0_op")]
    sides = [(3.0, 1.0), (0.5, 2.0), (3.0, 1.0)]
    for i, (dev, host) in zip(ops, sides):
        costs[i] = dataclasses.replace(costs[i], fwd_ms=max(dev, host), bwd_ms=max(dev, host),
                                       issue=IssueTimes(dev, dev, host, host))
    profile = dataclasses.replace(profile, costs=tuple(costs))
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(1, 10**12, 10.0, 10.0)
    a, b = ops[0], ops[-1] + 2  # the three operators and the block's add (0.0 ms here)
    add_ms = profile.costs[ops[-1] + 1].fwd_ms
    r = range_cost(tables, params, a, b)
    assert r.fwd_ns == round((6.5 + add_ms) * 1e6)  # device 6.5 against host 4.0
    assert r.fwd_ns < round((8.0 + add_ms) * 1e6)  # each node's longer side: 3 + 2 + 3
    checker = Checker(profile, 1, 10**12, "recompute", 8.0)
    assert checker.range_facts(a, b).fwd_ns == r.fwd_ns
    # the range of the host-bound operator alone takes its host time
    assert range_cost(tables, params, ops[1], ops[1] + 1).fwd_ns == round(2.0 * 1e6)


def test_a_tied_weight_is_updated_once_by_its_first_holder():
    """The runtime keeps one master and one optimizer state per tied weight, in the first
    sub-model holding it; its other holders load the weight and offload its gradient but
    update nothing of it. A GPT's LM head was charged the embedding's update a second time
    (gpt3-medium on an H200: 14.3 ms a step, and a calibrated update rate 8% too fast)."""
    profile = block_profile(num_blocks=2, embed_bytes=10 * MB)
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(1, 10**12, 10.0, 10.0, cpu_adam_gbps=1.0)  # 1 ms per MB of masters
    n = facts.num_nodes
    cuts = [0, 3, n - 2, n]
    ranges = [range_cost(tables, params, a, b) for a, b in itertools.pairwise(cuts)]
    total = sum(s.num_bytes for s in profile.graph.params.values())
    assert sum(r.optimizer_ns for r in ranges) == pytest.approx(total, rel=1e-6)
    assert ranges[-1].optimizer_ns == 0  # the head's weight is the embedding's
    assert ranges[-1].param_bytes == 10 * MB  # ... which it loads all the same
    checker = Checker(profile, 1, 10**12, "recompute", 1.0)
    for a, b in itertools.pairwise(cuts):
        assert checker.range_facts(a, b).adam_ns == range_cost(tables, params, a, b).optimizer_ns


def test_plan_lists_the_tensors_crossing_each_cut(tmp_path):
    profile = block_profile(num_blocks=4)
    plan = partition(profile, 40 * MB, reserve_bytes=0)
    assert len(plan.submodels) > 2
    g = profile.graph
    for s, nxt in zip(plan.submodels, plan.submodels[1:]):
        crossing = {t.name for t in s.crossing}
        assert crossing == {n.name for n in g.nodes[: s.stop]
                            if any(n.name in m.inputs for m in g.nodes[s.stop:])}
        assert {t.name for t in nxt.inputs} <= crossing
        assert sum(t.num_bytes for t in s.crossing) > 0
    assert plan.submodels[0].start == 0 and plan.submodels[-1].stop == len(g.nodes)
    assert "idx" in {t.name for t in plan.submodels[0].inputs}
    assert [t.name for t in plan.submodels[-1].outputs] == ["lm_head"]
    assert plan.graph_hash == g.structure_hash() and plan.profile_hash == profile.content_hash()
    path = plan.save(tmp_path / "p.plan.json")
    assert Plan.load(path) == plan


def test_fast_hashes_equal_the_ir_hashes():
    profile = block_profile(num_blocks=3)
    assert profile_hash(profile) == profile.content_hash()
    assert graph_hash(profile.graph) == profile.graph.structure_hash()
    # a node's device and host times apart round-trip; without them nothing is written, so
    # profiles written before they existed read and hash as before
    assert all("issue" not in c for c in profile.to_json()["costs"])
    timed = _with_issue_times(profile, random.Random(1))
    assert any(c.issue is not None for c in timed.costs)
    back = Profile.from_json(json.loads(json.dumps(timed.to_json())))
    assert back == timed
    assert profile_hash(back) == back.content_hash() != profile.content_hash()


# ---------------------------------------------------------------------------------------------
# accumulation degree


def _feasible_at(profile, usable, accum):
    facts = node_facts(profile)
    tables = build_tables(facts, max_width_for(facts, usable))
    return (search(tables, CostParams(accum, usable, profile.h2d_gbps, profile.d2h_gbps), 0)
            is not None)


def test_accum_min_is_the_smallest_feasible():
    profile = block_profile(num_blocks=8, h2d_gbps=2.0)
    plan = partition(profile, 80 * MB, reserve_bytes=0, accum="min")
    assert plan.feasible and not plan.accum_fixed and plan.accum > 1 and not plan.sweep
    assert not any(_feasible_at(profile, 80 * MB, c) for c in range(1, plan.accum))
    assert not check_plan(profile, plan)


def test_searched_accum_trains_the_most_tokens_a_second_of_its_sweep():
    """From the smallest feasible C up: the chosen C's plan predicts at least the tokens a
    second of every C the sweep weighed, of the smallest feasible one's plan among them, and
    more than it where the CPU update weighs on the step."""
    profile = block_profile(num_blocks=8, h2d_gbps=2.0)
    smallest = partition(profile, 80 * MB, reserve_bytes=0, accum="min", cpu_adam_gbps=0.5)
    plan = partition(profile, 80 * MB, reserve_bytes=0, cpu_adam_gbps=0.5)
    rate = plan.tokens_per_step / (plan.predicted_step_ms / 1e3)
    assert plan.sweep and plan.sweep[0].accum == smallest.accum
    assert all(rate >= pt.tokens_per_s * (1 - 1e-9) for pt in plan.sweep)
    assert plan.accum > smallest.accum and rate > smallest.tokens_per_step / (
        smallest.predicted_step_ms / 1e3)
    assert [pt.accum for pt in plan.sweep] == sorted(pt.accum for pt in plan.sweep)
    assert plan.feasible and not check_plan(profile, plan)
    bound = partition(profile, 80 * MB, reserve_bytes=0, cpu_adam_gbps=0.5,
                      max_global_batch=str(smallest.accum * profile.graph.batch_size))
    assert bound.accum == smallest.accum


def test_sub_model_1s_update_outlasting_the_first_backward_is_priced_not_refused():
    """At the step boundary the GPU waits for sub-model 0's gradients, update and refresh
    anyway. When sub-model 1's offload and CPU update outlast sub-model 0's backward and
    offload (an embedding: little compute), sub-model 0's update waits for them: the plan meets
    every constraint, its step includes the wait exactly, and a note gives the arithmetic.
    Refusing it drove C up: GPT-3 175B at 11 GiB in half precision planned at C = 11 (a 3.7x
    larger batch) to hide 76 ms of a 134 s step."""
    profile = block_profile(num_blocks=8, embed_bytes=6 * MB, h2d_gbps=10.0)
    # the recomputation's cost model alone (activations="auto" stores outputs on top of it)
    plan = partition(profile, 40 * MB, reserve_bytes=0, cpu_adam_gbps=8.0,
                     activations="recompute")
    first, second = plan.submodels[:2]
    assert plan.feasible and plan.accum == 1 and plan.binding == ""
    behind = second.offload_ms + second.optimizer_ms - first.bwd_ms - first.offload_ms
    assert behind > 0 and first.slack_optimizer_ms == pytest.approx(-behind)
    note = next(n for n in plan.notes if n.startswith("step boundary:"))
    assert f"waits {behind:.1f} ms" in note
    assert not check_plan(profile, plan)
    # the step is the simulator's, and the search's sum equals it
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(plan.accum, 40 * MB, profile.h2d_gbps, profile.d2h_gbps, 8.0)
    costs = plan_costs(tables, params, [s.start for s in plan.submodels[1:]])
    sim = simulate_swap(range_stage_times(costs), plan.accum, early_prefetch=plan.early_prefetch)
    assert sim.step_ns == additive_step_ns(costs, plan.early_prefetch)
    assert sim.step_ns / 1e6 == pytest.approx(plan.predicted_step_ms)


def test_capped_accum_returns_the_best_plan_and_names_the_binding_constraint():
    profile = block_profile(num_blocks=8, h2d_gbps=2.0)
    plan = partition(profile, 80 * MB, reserve_bytes=0, max_accum=1)
    assert plan.accum == 1 and not plan.feasible and plan.search_tier > 0
    assert plan.binding.startswith("sub-model ") and "overlap" in plan.binding
    fixed = partition(profile, 80 * MB, reserve_bytes=0, accum=1)
    assert fixed.accum_fixed and fixed.submodels == plan.submodels


def test_physical_bound_matches_design_formula():
    profile = block_profile(num_blocks=2)
    hw = HardwareProfile(name="t", description="", memory_bytes=32 << 30,
                         peak_tflops={"float32": 100.0},
                         mem_gbps=900, h2d_gbps=12.0, d2h_gbps=12.0, compute_efficiency=0.5,
                         launch_overhead_us=5.0, sources=())
    from dataclasses import replace

    p = replace(profile, hardware=hw, h2d_gbps=12.0)
    tokens = 1  # no integer input: batch size 1 times no sequence length
    assert physical_bound_accum(p) == pytest.approx(4 * 50e12 / (2 * 12e9 * tokens))


# ---------------------------------------------------------------------------------------------
# bad input


def test_budget_below_the_largest_operator_names_it_and_a_budget_that_works():
    profile = block_profile(num_blocks=3, block=((4, 1.0, 2.0), (20, 2.0, 4.0)))
    with pytest.raises(InfeasiblePlanError) as e:
        partition(profile, 30 * MB, reserve_bytes=0)
    msg = str(e.value)
    assert "'h_0_op1'" in msg and "smallest budget that works" in msg
    budget = int(msg.split("--gpu-mem ")[1].split("MiB")[0]) * (1 << 20)
    plan = partition(profile, budget, reserve_bytes=0)  # it works, every constraint met...
    assert plan.feasible and not check_plan(profile, plan)
    # ...and a step less does not, at any C
    assert not partition(profile, budget - ADVICE_STEP, reserve_bytes=0).feasible
    # memory alone fits from where the message says, and not 2 MiB below
    memory = float(msg.split("memory alone fits from ")[1].split(" MiB")[0])
    plan = partition(profile, int(memory * (1 << 20)), reserve_bytes=0, max_accum=1)
    assert not [v for v in check_plan(profile, plan) if v.constraint == "memory"]
    with pytest.raises(InfeasiblePlanError):
        partition(profile, int(memory * (1 << 20)) - (2 << 20), reserve_bytes=0, max_accum=1)


@pytest.fixture
def profile_file(tmp_path) -> Path:
    return block_profile(num_blocks=4).save(tmp_path / "m.profile.json")


# a synthetic profile names no hardware, so no host figure: the CLI needs a number
RATE = ["--cpu-adam-gbps", "8"]


def test_cli_partition_and_show(profile_file, tmp_path, capsys):
    plan_path = tmp_path / "m.plan.json"
    svg = tmp_path / "m.svg"
    assert main(["partition", str(profile_file), "--gpu-mem", "40MB", "--reserve", "0",
                 "-o", str(plan_path), "--timeline", str(svg), *RATE]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "sub-models" in out and svg.exists()
    plan = Plan.load(plan_path)
    assert main(["show", str(plan_path)]) == 0
    shown = capsys.readouterr().out
    assert f"C={plan.accum}" in shown and "GPU busy" in shown
    assert main(["partition", str(profile_file), "--gpu-mem", "40MB", "--reserve", "0",
                 *RATE]) == 0
    assert (tmp_path / "m.plan.json").exists()  # default name next to the profile


def test_partition_and_show_run_without_importing_torch(profile_file, tmp_path):
    # torch's import is seconds of a planning command's time, which it does not need
    plan = tmp_path / "m.plan.json"
    script = (f"import sys\nfrom atomc.cli import main\n"
              f"assert main(['partition', {str(profile_file)!r}, '--gpu-mem', '40MB', "
              f"'--reserve', '0', '--cpu-adam-gbps', '8', '-o', {str(plan)!r}]) == 0\n"
              f"assert main(['show', {str(plan)!r}, '--sweep']) == 0\n"
              f"assert 'torch' not in sys.modules, 'torch was imported'\n")
    # a fresh interpreter, not one forked from the tests' server that has torch imported
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ATOMC_TEST_FORKSERVER": "0"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_each_command_comes_from_the_module_the_cli_names_for_it():
    import argparse
    import importlib

    from atomc.cli import COMMANDS

    for module, names in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert tuple(sub.choices) == names, module


@pytest.mark.parametrize("size", ["11 Gibs", "eleven", "-3GiB"])
def test_cli_rejects_bad_sizes_with_the_accepted_forms(profile_file, size, capsys):
    assert main(["partition", str(profile_file), f"--gpu-mem={size}"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-mem" in err and "11GiB" in err and "512MiB" in err


def test_cli_rejects_malformed_and_wrong_profiles(tmp_path, profile_file, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["partition", str(bad), "--gpu-mem", "11GiB"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    data = json.loads(profile_file.read_text())
    for change, expect in [({"schema_version": 99}, "schema_version 99"),
                           ({"kind": "atomc.plan"}, "expected a atomc.profile"),
                           ({"costs": data["costs"][:-1]}, "node costs for")]:
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps({**data, **change}))
        assert main(["partition", str(wrong), "--gpu-mem", "11GiB", *RATE]) == 2
        assert expect in capsys.readouterr().err
    assert main(["partition", str(tmp_path / "missing.json"), "--gpu-mem", "11GiB"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_budget_too_small(profile_file, capsys):
    assert main(["partition", str(profile_file), "--gpu-mem", "3MB", "--reserve", "0",
                 *RATE]) == 2
    err = capsys.readouterr().err
    assert "operator '" in err and "smallest budget that works" in err and "--gpu-mem" in err
    assert main(["partition", str(profile_file), "--gpu-mem", "40MB"]) == 2  # auto: no hardware
    assert "no host figure" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expect", [
    (["--disks", "2", "--disk-gbps", "fast"], "--disk-gbps 'fast' is not a positive rate"),
    (["--disks", "2", "--disk-gbps", "-7"], "--disk-gbps '-7' is not a positive rate"),
    (["--disks", "2", "--disk-gbps", "7/0"], "--disk-gbps '7/0' is not a positive rate"),
    (["--disks", "2"], "needs each drive's rate"),
    (["--disks", "0", "--disk-gbps", "7"], "give 1 or more drives"),
    (["--disk-gbps", "7"], "give them with --disks N"),
    (["--offload-dir", "{tmp}/none"], "does not exist; create it"),
    (["--offload-dir", "{tmp}", "--disks", "2", "--disk-gbps", "7"], "not both"),
    (["--max-global-batch", "0"], "is not a positive count"),
    (["--max-global-batch", "lots"], "is not a positive count"),
    (["--max-global-batch", "1tokens"], "counts tokens, but the model takes no token ids"),
])
def test_cli_refuses_bad_disk_and_batch_options_in_one_line(profile_file, tmp_path, capsys,
                                                            flags, expect):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["partition", str(profile_file), "--gpu-mem", "40MB", "--reserve", "0",
                 *RATE, *flags]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_global_batch_below_one_micro_batch_is_refused_with_what_would_do():
    from atomc.partition.throughput import parse_global_batch

    with pytest.raises(UsageError, match=r"'3' is below one micro-batch \(4 samples\); give at "
                                         r"least 4 samples"):
        parse_global_batch("3", 4, 4 * 512, True)
    with pytest.raises(UsageError, match=r"below one micro-batch \(2048 tokens\)"):
        parse_global_batch("1k-tokens", 4, 4 * 512, True)
    assert parse_global_batch("64", 4, 4 * 512, True) == 16
    assert parse_global_batch("64k tokens", 4, 4 * 512, True) == 32


# ---------------------------------------------------------------------------------------------
# a traced model


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    examples = Path(__file__).resolve().parents[2] / "examples"
    return profile_model(trace_model(examples / "gpt.py", "mini", 1), target="v100-32gb")


def test_gpt_plan_is_exact_folded_and_checked(gpt_profile):
    facts = node_facts(gpt_profile)
    for mib in (2, 3, 6):
        usable = mib << 20
        tables = build_tables(facts, max_width_for(facts, usable))
        folding = prepare_folding(tables, _period(gpt_profile, tables))
        assert folding is not None
        for accum in (1, 4, 16):
            params = CostParams(accum, usable, gpt_profile.h2d_gbps, gpt_profile.d2h_gbps)
            for tier in (0, 2):
                a, b = search(tables, params, tier, folding), search(tables, params, tier)
                assert (a and (a.objective, a.cuts)) == (b and (b.objective, b.cuts))
        plan = partition(gpt_profile, usable, reserve_bytes=0)
        problems = check_plan(gpt_profile, plan)
        assert not [v for v in problems if v.constraint in ("structure", "recorded", "memory")]
        assert plan.feasible == (not problems)
        placeholders = [i for i, n in enumerate(gpt_profile.graph.nodes) if n.op == "placeholder"]
        assert max(placeholders) < plan.submodels[0].stop


def test_keep_plans_hold_every_earlier_sub_models_activations(gpt_profile):
    """Keeping, the runtime holds each sub-model's graphs until its backward: a plan's memory
    grows along the model, a budget that fits recomputation may not fit keeping, and the
    error says why; a keep plan passes the checker's memory constraints."""
    usable = 3 << 20
    plan = partition(gpt_profile, usable, reserve_bytes=0, accum=4)
    assert len(plan.submodels) >= 3
    with pytest.raises(InfeasiblePlanError, match=r"with --activations keep, .* saved activations"):
        partition(gpt_profile, usable, reserve_bytes=0, accum=4, activations="keep")
    # the saved activations as the device holds them (this profile computes in half)
    view = device_view(gpt_profile, Precision(plan.transfer_dtype or "float32", plan.autocast))
    total = sum(c.saved_bytes for c in view.costs)
    keep = partition(gpt_profile, usable + 4 * total, reserve_bytes=0, accum=4,
                     activations="keep")
    assert not [v for v in check_plan(gpt_profile, keep) if v.constraint == "memory"]
    assert keep.submodels[-1].peak_bytes >= 4 * total
    assert all(s.checkpoint_ms == 0 for s in keep.submodels)


def test_build_plan_single_submodel(gpt_profile):
    facts = node_facts(gpt_profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(2, 10**12, gpt_profile.h2d_gbps, gpt_profile.d2h_gbps)
    plan = build_plan(gpt_profile, tables, params, [], capacity_bytes=10**12, reserve_bytes=0)
    assert len(plan.submodels) == 1 and plan.cut_bytes == 0 and plan.feasible
    assert plan.submodels[0].crossing == ()


def test_uneven_sub_models_are_capped_to_fit_the_runtimes_slots():
    """The search checks neighbours in pairs, but the runtime holds two weight and two
    gradient slots sized for the largest sub-model all step (atomc.runtime.slots): a budget
    where the pairwise-best plan overflows the slots gets a plan whose largest sub-model is
    capped, and the independent checker, which counts the slots, finds no memory violation."""
    import dataclasses

    profile = block_profile()
    usable = 40 << 20
    plan = partition(profile, usable, reserve_bytes=0, accum=2, cpu_adam_gbps=4.0)
    # the best plan of neighbours in pairs overflows the slots; the plan's largest is smaller
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    params = CostParams(2, usable, profile.h2d_gbps, profile.d2h_gbps, 4.0)
    pairwise = plan_costs(tables, params, search(tables, params, 0).cuts)
    assert min(s.slack for s in plan_slacks(pairwise, usable) if s.constraint == "memory") < 0
    largest = max(s.param_bytes for s in plan.submodels)
    assert largest < max(c.param_bytes for c in pairwise)
    assert any("slots" in n and f"({format_bytes(largest)})" in n for n in plan.notes)
    assert not [v for v in check_plan(profile, plan) if v.constraint == "memory"]
    assert all(s.slack_memory_bytes >= 0 for s in plan.submodels)  # slots counted in the slack
    # the checker counts the slots: the same cuts with 1 MiB less than the tightest sub-model's
    # slack are refused, and the slot rule is among the reasons
    short = dataclasses.replace(plan, capacity_bytes=plan.capacity_bytes - min(
        s.slack_memory_bytes for s in plan.submodels) - (1 << 20))
    assert any("in the slots" in v.message for v in check_plan(profile, short))


@pytest.mark.parametrize("x_width, v_width", [(7, 7), (7, 4), (12, 12)])
def test_the_search_s_strided_lines_read_what_gathers_read(x_width, v_width):
    """The states ending at a middle cut and V's states starting there, read as views of the
    flattened tables, are the elements index arrays would gather, for every cut."""
    from atomc.partition.search import _Lines

    n = 12
    x = np.arange(n * (x_width + 1)).reshape(n, x_width + 1)
    v = np.arange((n + 1) * (v_width + 1)).reshape(n + 1, v_width + 1)
    lines = _Lines(x_width, v_width)
    for b in range(1, n):
        wl = np.arange(1, min(v_width, b) + 1)
        wr = np.arange(1, min(v_width, n - b) + 1)
        assert np.array_equal(lines.ending_at(x, b, len(wl)), x[b - wl, wl])
        assert np.array_equal(lines.states_from(v, b, len(wr)), v[b + wr, wr])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_a_cap_that_admits_no_new_range_is_not_searched(seed):
    """The descent over slot caps skips a smaller cap under which every admitted range was
    admitted already: the plan is the one searching it gives."""
    from atomc.partition import caps
    from atomc.partition.cost import derive

    profile, accum, usable, cpu, activations = _random_case(seed, max_nodes=14)
    facts = node_facts(profile)
    params = CostParams(accum, usable, profile.h2d_gbps, profile.d2h_gbps, cpu, activations)
    tables = build_tables(facts, facts.num_nodes)
    d = derive(tables, params)
    calls = []

    def counted(*args):
        calls.append(args)
        return search(*args)

    with mock.patch.object(caps, "search", counted):
        skipping = caps.over_caps(tables, params, d, None, 0)
        skipped = len(calls)
        calls.clear()
        with mock.patch.object(caps, "_admits_more", lambda *a: True):
            searching = caps.over_caps(tables, params, d, None, 0)
    assert skipped <= len(calls)
    assert (skipping.cuts if skipping else None) == (searching.cuts if searching else None)
    assert (skipping.objective if skipping else None) == \
        (searching.objective if searching else None)
