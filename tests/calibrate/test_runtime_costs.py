"""The runtime's own costs in the profile (RuntimeCosts), and the cost model and simulator
charging them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from atomc.calibrate.probe import runtime_ms
from atomc.calibrate.runtime_costs import update_costs_ms
from atomc.ir import Profile, RuntimeCosts
from atomc.partition import partition, profile_hash, recost
from atomc.partition.check import check_plan

from synthetic import block_profile


def _on_cpu(profile: Profile, **runtime) -> Profile:
    rt = RuntimeCosts(**runtime) if runtime else None
    return dataclasses.replace(profile, device="cpu (x86_64, 2 threads)", runtime=rt)


def test_runtime_costs_round_trip_and_older_profiles_read_and_hash_as_before():
    plain = block_profile()
    data = plain.to_json()
    assert "runtime" not in data  # not written when not measured: old files hash the same
    assert Profile.from_json(data).runtime is None
    with_costs = dataclasses.replace(plain, runtime=RuntimeCosts(0.2, 0.05, 0.1))
    back = Profile.from_json(with_costs.to_json())
    assert back.runtime == RuntimeCosts(0.2, 0.05, 0.1)
    assert profile_hash(back) == back.content_hash() != plain.content_hash()
    # the per-call times came later: costs without them are written (and hash) as before
    assert "forward_ms" not in json.dumps(with_costs.to_json())
    calls = dataclasses.replace(with_costs, runtime=RuntimeCosts(0.2, 0.05, 0.1, 0.07, 0.2))
    back = Profile.from_json(calls.to_json())
    assert back.runtime == RuntimeCosts(0.2, 0.05, 0.1, 0.07, 0.2)
    assert profile_hash(back) == back.content_hash() != with_costs.content_hash()


def test_update_charges_fixed_and_per_tensor_costs_besides_bytes():
    base = block_profile()
    rate = 4.0
    # 56 MiB: a plan that meets every constraint, so the checker has nothing to report
    plan = partition(base, 56 * 2**20, reserve_bytes=0, accum=2, cpu_adam_gbps=rate)
    costly = dataclasses.replace(base, runtime=RuntimeCosts(update_ms=0.3, update_tensor_ms=0.1))
    again = recost(costly, plan)
    first_use: dict[str, int] = {}
    for i, n in enumerate(base.graph.nodes):
        for f in n.param_fqns:
            first_use.setdefault(f, i)
    for before, after in zip(plan.submodels, again.submodels):
        # a tied weight read in two sub-models is updated by its first holder only (one
        # master): compare the extra time with the parameter tensors this range updates
        own = {f for f, i in first_use.items() if before.start <= i < before.stop}
        extra = after.optimizer_ms - before.optimizer_ms
        if own:
            assert extra == pytest.approx(0.3 + 0.1 * len(own), abs=1e-6), before.index
        else:
            assert extra == 0.0
    assert again.predicted_step_ms > plan.predicted_step_ms
    assert check_plan(costly, again) == []  # the independent checker charges the same


def test_no_update_modelled_charges_no_fixed_costs():
    base = dataclasses.replace(block_profile(), runtime=RuntimeCosts(0.3, 0.1))
    plan = partition(base, 40 * 2**20, reserve_bytes=0, accum=2, cpu_adam_gbps=0.0)
    assert all(s.optimizer_ms == 0.0 for s in plan.submodels)


def test_cpu_plan_charges_the_measured_time_per_action_and_calibration_overrides_it():
    base = block_profile()
    without = partition(_on_cpu(base), 40 * 2**20, reserve_bytes=0, accum=1)
    measured = _on_cpu(base, update_ms=0.0, update_tensor_ms=0.0, action_ms=0.25)
    plan = recost(measured, without)
    assert plan.host_gap_ms == 0.25
    assert plan.predicted_step_ms > without.predicted_step_ms
    # on a GPU the device runs the actions on its streams: the Python between them is hidden
    gpu = dataclasses.replace(measured, device="cuda:0 (NVIDIA H100)")
    assert recost(gpu, without).host_gap_ms is None
    from atomc.partition import host_gap_ms
    cal = dataclasses.replace(measured, calibration=_calibration(host_gap_ms=0.5))
    assert host_gap_ms(cal) == 0.5


def _calibration(host_gap_ms: float):
    from atomc.ir import Calibration

    return Calibration(plan_hash="", source_profile_hash="", device="cpu", num_steps=1,
                       warmup_steps=0, accum=1, submodels=(), h2d_scale=1.0, d2h_scale=1.0,
                       cpu_adam_gbps=0.0, measured_step_ms=1.0, predicted_step_ms=1.0,
                       calibrated_step_ms=1.0, host_gap_ms=host_gap_ms)


def test_cpu_plan_charges_the_runtimes_time_in_every_forward_and_backward():
    """Each sub-model's forward and backward of a micro-batch cost the runtime's own time
    once (the recomputed forward's included in the backward's), at every C; the checker
    charges the same; calibration fits the nodes to what is left, so the calibrated profile
    reproduces the measured sub-models and charges the same time on other cuts."""
    from atomc.calibrate import MeasuredSubmodel, Measurement, calibrate

    base = _on_cpu(block_profile(), update_ms=0.0, update_tensor_ms=0.0)
    plan = partition(base, 56 * 2**20, reserve_bytes=0, accum=2, cpu_adam_gbps=4.0)
    own = _on_cpu(block_profile(), update_ms=0.0, update_tensor_ms=0.0, forward_ms=0.07,
                  backward_ms=0.2)
    again = recost(own, plan)
    for before, after in zip(plan.submodels, again.submodels):
        assert after.fwd_ms == pytest.approx(before.fwd_ms + 0.07, abs=1e-6)
        assert after.bwd_ms == pytest.approx(before.bwd_ms + 0.2, abs=1e-6)
    assert again.predicted_step_ms > plan.predicted_step_ms
    assert check_plan(own, again) == []
    # measured: each sub-model 1.5x its operators, plus the runtime's own time
    subs = tuple(MeasuredSubmodel(
        index=s.index, fwd_ms=1.5 * (s.fwd_ms - 0.07) + 0.07,
        bwd_ms=1.5 * (s.bwd_ms - 0.2) + 0.2, load_ms=s.load_ms, load_bytes=s.param_bytes,
        checkpoint_ms=0.0, offload_ms=0.0, offload_bytes=0, optimizer_ms=0.0)
        for s in again.submodels)
    m = Measurement(package="", plan_hash=again.content_hash(), device=again.device,
                    accum=again.accum, activations=again.activations, warmup_steps=0,
                    step_ms=(again.predicted_step_ms,), lane_busy_ms={}, losses=(1.0,),
                    submodels=subs, h2d_gbps=own.h2d_gbps, d2h_gbps=own.d2h_gbps)
    cal = calibrate(own, again, m)
    assert len(cal.calibration.submodels) == len(subs)
    for rec in cal.calibration.submodels:
        assert rec.fwd_scale == pytest.approx(1.5, rel=1e-6)
        assert rec.bwd_scale == pytest.approx(1.5, rel=1e-6)
    fitted = recost(cal, again)
    for s, meas in zip(fitted.submodels, subs):
        assert s.fwd_ms == pytest.approx(meas.fwd_ms, abs=1e-5)
        assert s.bwd_ms == pytest.approx(meas.bwd_ms, abs=1e-5)


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_plans_are_not_chosen_for_the_runtimes_own_time(accum):
    """The runtime's time per call keeps the compute lane busy and trains nothing. Counted as
    compute, it made plans of many small sub-models score best (14 here, 10-25% slower than
    the 8 planned without it); knowing it must not make the plan slower."""
    base = _on_cpu(block_profile(), update_ms=0.0, update_tensor_ms=0.0)
    own = _on_cpu(block_profile(), update_ms=0.0, update_tensor_ms=0.0, forward_ms=0.5,
                  backward_ms=1.5)
    # the cuts' search alone: activations="auto" stores outputs on top of the cuts it chose
    knowing = partition(own, 80 * 2**20, reserve_bytes=0, accum=accum, cpu_adam_gbps=4.0,
                        activations="recompute")
    blind = partition(base, 80 * 2**20, reserve_bytes=0, accum=accum, cpu_adam_gbps=4.0,
                      activations="recompute")
    assert knowing.predicted_step_ms <= recost(own, blind).predicted_step_ms
    assert len(knowing.submodels) <= len(blind.submodels)


def test_update_costs_and_time_per_action_are_measured_with_the_runtime():
    fixed, per_tensor = update_costs_ms(torch.device("cpu"), repeats=5)
    assert math.isfinite(fixed) and fixed >= 0 and per_tensor >= 0
    gap, forward, backward = runtime_ms(torch.device("cpu"))
    assert math.isfinite(gap) and 0 <= gap < 50
    # a Linear on 8 numbers takes microseconds: the calls' time is mostly the runtime's own,
    # and a backward (recomputation, autograd, gradients) costs more than a forward
    assert 0 < forward < backward < 50
