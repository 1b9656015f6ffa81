"""Calibrate, scaling: a profile's node times, bandwidths, update rate and (on a CPU device)
host gap set to what a measurement of the plan's package shows (see the package docstring).
"""

from __future__ import annotations

import dataclasses

from atomc.calibrate.measure import Measurement, check_device, check_losses
from atomc.errors import CalibrationError
from atomc.ir import Calibration, NodeCost, Plan, Profile, SubmodelCalibration
from atomc.simulate.events import copies_on_host, fit_host_gap_ms

COMPUTE_OPS = ("call_module", "call_function", "call_method")
MIN_SCALE = 1e-3  # a backward measured below its recomputation alone is noise: floor it


def calibrate(profile: Profile, plan: Plan, measurement: Measurement) -> Profile:
    """`profile` with each sub-model's node times scaled to `measurement` of `plan`'s package.

    Refused (CalibrationError): a plan not made from this profile, a measurement of another
    plan's package, of another device than the plan's, with another C or activation rule, or
    with a failed step.
    """
    from atomc.partition import recost

    seen, plan_hash = _check_measurement(profile, plan, measurement)
    costs, scales = _fitted_costs(profile, plan, measurement)

    h2d = measurement.h2d_gbps or profile.h2d_gbps
    d2h = measurement.d2h_gbps or profile.d2h_gbps
    scaled = dataclasses.replace(profile, costs=tuple(costs), h2d_gbps=h2d, d2h_gbps=d2h,
                                 calibration=None)
    rate = _update_rate(scaled, plan, measurement)
    gap_ms = 0.0
    if copies_on_host(plan.device):
        gap_ms = _host_gap_ms(recost(scaled, plan, cpu_adam_gbps=rate or plan.cpu_adam_gbps),
                              measurement.median_step_ms)
    record = Calibration(
        plan_hash=plan_hash, source_profile_hash=seen, device=measurement.device,
        num_steps=measurement.num_steps, warmup_steps=measurement.warmup_steps, accum=plan.accum,
        submodels=tuple(scales), h2d_scale=h2d / profile.h2d_gbps if profile.h2d_gbps else 1.0,
        d2h_scale=d2h / profile.d2h_gbps if profile.d2h_gbps else 1.0, cpu_adam_gbps=rate,
        measured_step_ms=measurement.median_step_ms, predicted_step_ms=plan.predicted_step_ms,
        calibrated_step_ms=0.0, host_gap_ms=gap_ms)
    after = recost(dataclasses.replace(scaled, calibration=record), plan,
                   cpu_adam_gbps=rate or plan.cpu_adam_gbps)
    record = dataclasses.replace(record, calibrated_step_ms=after.predicted_step_ms)
    note = (f"calibrated to {measurement.num_steps} measured steps of plan {plan_hash} on "
            f"{measurement.device}: step measured {measurement.median_step_ms:.2f} ms, predicted "
            f"{plan.predicted_step_ms:.2f} ms before, {after.predicted_step_ms:.2f} ms after")
    return dataclasses.replace(scaled, notes=(*profile.notes, note), calibration=record)


def _check_measurement(profile: Profile, plan: Plan, measurement: Measurement) -> tuple[str, str]:
    """Refuse a measurement `calibrate` cannot fit `profile` to; the profile's and the plan's
    hashes."""
    from atomc.partition import profile_hash

    seen = profile_hash(profile)
    if seen != plan.profile_hash:
        raise CalibrationError(
            f"the plan was made from profile {plan.profile_hash}, but this profile is {seen}; "
            f"give the profile the plan was partitioned from")
    plan_hash = plan.content_hash()
    if measurement.plan_hash != plan_hash:
        raise CalibrationError(
            f"the steps measured {measurement.package or 'a package'} generated from plan "
            f"{measurement.plan_hash or '(none recorded)'}, not from this plan ({plan_hash}); "
            f"measure the package generated from this plan (atomc codegen), or give its plan")
    check_device(plan.device, measurement.device, "the measured steps")
    k = len(plan.submodels)
    if len(measurement.submodels) != k:
        raise CalibrationError(f"the measurement has {len(measurement.submodels)} sub-models, "
                               f"the plan {k}; measure this plan's package")
    if measurement.accum != plan.accum or measurement.activations != plan.activations:
        raise CalibrationError(
            f"the steps ran with C={measurement.accum} and activations "
            f"{measurement.activations}, the plan has C={plan.accum} and {plan.activations}; "
            f"measure the package with the plan's settings (no --accum or --activations)")
    if measurement.num_steps < 1:
        raise CalibrationError("the measurement holds no steps; measure 1 or more")
    check_losses(measurement.losses)
    return seen, plan_hash


def _fitted_costs(profile: Profile, plan: Plan, measurement: Measurement,
                  ) -> tuple[list[NodeCost], list[SubmodelCalibration]]:
    """The profile's node costs with each sub-model's times fitted to the measured ones, and
    the fit for each sub-model."""
    k = len(plan.submodels)
    costs = list(profile.costs)
    recompute = plan.activations != "keep"
    # the runtime's own time per call stays the profile's (the cost model adds it to every
    # sub-model's forward and backward): the nodes are fitted to the rest, so that other cuts
    # of the calibrated profile pay it once per sub-model too
    rt = profile.runtime
    own_fwd = (rt.forward_ms or 0.0) if rt is not None else 0.0
    own_bwd = (rt.backward_ms or 0.0) if rt is not None else 0.0
    scales = []
    index = {n.name: j for j, n in enumerate(profile.graph.nodes)}
    for sm, m in zip(plan.submodels, measurement.submodels):
        nodes = range(sm.start, sm.stop)
        last = sm.index == k - 1
        fwd = sum(costs[j].fwd_ms for j in nodes)
        bwd = sum(costs[j].bwd_ms for j in nodes)
        ops = {j for j in nodes if profile.graph.nodes[j].op in COMPUTE_OPS} or set(nodes)
        f_scale, fwd_add = _fit(m.fwd_ms - own_fwd, fwd, len(ops))
        new_fwd = f_scale * fwd + fwd_add * len(ops)
        # what the recomputation ran: all but the operators the plan keeps or sends
        stored = [index[n] for n in (*sm.kept, *sm.sent)]
        skipped = f_scale * sum(costs[j].fwd_ms for j in stored) + fwd_add * len(
            ops.intersection(stored))
        redo = new_fwd - skipped if recompute and not last else 0.0
        b_scale, bwd_add = _fit(m.bwd_ms - own_bwd - redo, bwd, len(ops))
        for j in nodes:
            extra = j in ops
            c = costs[j]
            costs[j] = dataclasses.replace(
                c, fwd_ms=c.fwd_ms * f_scale + (fwd_add if extra else 0.0),
                bwd_ms=c.bwd_ms * b_scale + (bwd_add if extra else 0.0),
                issue=None)  # fitted to whole sub-models: the two sides are one figure now
        scales.append(SubmodelCalibration(
            index=sm.index, start=sm.start, stop=sm.stop, fwd_scale=f_scale, bwd_scale=b_scale,
            measured_fwd_ms=m.fwd_ms, measured_bwd_ms=m.bwd_ms, measured_load_ms=m.load_ms,
            measured_checkpoint_ms=m.checkpoint_ms, measured_offload_ms=m.offload_ms,
            measured_optimizer_ms=m.optimizer_ms))
    return costs, scales


def _host_gap_ms(plan: Plan, measured_step_ms: float) -> float:
    """On a CPU device: the runtime thread's time before each action that makes the plan's
    simulated step the measured one (atomc.simulate.events.fit_host_gap_ms)."""
    from atomc.simulate import stage_times

    return fit_host_gap_ms(stage_times(plan), plan.accum, plan.early_prefetch, measured_step_ms)


def _fit(measured_ms: float, profiled_ms: float, num_ops: int) -> tuple[float, float]:
    """(factor, ms added to each of `num_ops` operators) taking `profiled_ms` to `measured_ms`.

    Operators profiled at 0 ms in total cannot be scaled: the measured time is spread over
    them instead."""
    measured_ms = max(measured_ms, 0.0)
    if profiled_ms > 0:
        return max(measured_ms / profiled_ms, MIN_SCALE), 0.0
    return 1.0, measured_ms / num_ops if num_ops else 0.0


def _update_rate(profile: Profile, plan: Plan, m: Measurement) -> float:
    """GB/s of fp32 masters the runtime's CPU updates achieved (0: none measured): the cost
    model's master bytes of each sub-model (its times at 1 GB/s are its bytes in ns) over the
    measured update times, less the fixed and per-tensor costs the profile measured (the
    cost model charges those besides the bytes). A remainder below a tenth of the measured
    time is taken as that tenth: the bytes always cost something."""
    from atomc.partition import recost

    bare = dataclasses.replace(profile, runtime=None)
    per_gb = recost(bare, plan, cpu_adam_gbps=1.0)
    fixed_ms = 0.0
    if profile.runtime is not None:
        with_fixed = recost(profile, plan, cpu_adam_gbps=1.0)
        fixed_ms = sum(a.optimizer_ms - b.optimizer_ms
                       for a, b in zip(with_fixed.submodels, per_gb.submodels))
    master_bytes = sum(s.optimizer_ms * 1e6 for s in per_gb.submodels)
    update_ms = sum(s.optimizer_ms for s in m.submodels)
    if master_bytes <= 0 or update_ms <= 0:
        return 0.0
    return master_bytes / (max(update_ms - fixed_ms, 0.1 * update_ms) * 1e6)
