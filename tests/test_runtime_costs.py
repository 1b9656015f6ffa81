"""The runtime's own costs in the profile (RuntimeCosts), and the cost model and simulator
charging them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from atomc.ir import Profile, RuntimeCosts
from atomc.partition import partition, profile_hash, recost
from atomc.partition.check import check_plan
from atomc.profile.probe import action_ms
from atomc.profile.runtime_costs import update_costs_ms

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


def test_update_costs_and_time_per_action_are_measured_with_the_runtime():
    fixed, per_tensor = update_costs_ms(torch.device("cpu"), repeats=5)
    assert math.isfinite(fixed) and fixed >= 0 and per_tensor >= 0
    gap = action_ms(torch.device("cpu"))
    assert math.isfinite(gap) and 0 <= gap < 50
