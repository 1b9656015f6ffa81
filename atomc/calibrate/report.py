"""Calibrate stage, text form: predicted against measured, before and after calibration.

`compare(plan, calibrated_plan, measurement)` puts the three side by side: the step (median,
start to start), each lane's busy fraction of the step, and each sub-model's times; `render`
prints it as the table `atomc calibrate` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from atomc.calibrate.measure import Measurement
from atomc.ir import Plan, Profile
from atomc.simulate import LANES, simulate_plan


@dataclass(frozen=True)
class Comparison:
    measured_step_ms: float
    predicted_step_ms: float  # from the profile alone (the plan's own prediction)
    calibrated_step_ms: float  # the plan's cuts on the calibrated profile
    measured_busy: dict[str, float]  # lane -> busy fraction of the step
    predicted_busy: dict[str, float]
    calibrated_busy: dict[str, float]

    @property
    def error_before(self) -> float:
        """Relative error of the prediction from the profile alone (+: predicted too long)."""
        return self.predicted_step_ms / self.measured_step_ms - 1

    @property
    def error_after(self) -> float:
        return self.calibrated_step_ms / self.measured_step_ms - 1

    def worst_lane_points(self, after: bool = True) -> float:
        """Largest difference of a lane's busy fraction, predicted against measured, in points."""
        busy = self.calibrated_busy if after else self.predicted_busy
        return max(abs(busy[lane] - self.measured_busy[lane]) * 100 for lane in LANES)


def predicted_busy(plan: Plan) -> dict[str, float]:
    """Each lane's busy fraction of one simulated step of `plan`."""
    timeline = simulate_plan(plan).timeline
    step = timeline.step_ms(0)
    return {lane: timeline.busy_ms(lane) / step if step > 0 else 0.0 for lane in LANES}


def compare(plan: Plan, calibrated_plan: Plan, measurement: Measurement) -> Comparison:
    return Comparison(
        measured_step_ms=measurement.median_step_ms, predicted_step_ms=plan.predicted_step_ms,
        calibrated_step_ms=calibrated_plan.predicted_step_ms,
        measured_busy={lane: measurement.busy_fraction(lane) for lane in LANES},
        predicted_busy=predicted_busy(plan), calibrated_busy=predicted_busy(calibrated_plan))


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def render(plan: Plan, calibrated_plan: Plan, measurement: Measurement,
           calibrated: Profile) -> str:
    """The table `atomc calibrate` prints: step, lanes, sub-models, factors."""
    cmp = compare(plan, calibrated_plan, measurement)
    m = measurement
    steps = sorted(m.step_ms)
    lines = [
        (f"{m.num_steps} measured steps (after {m.warmup_steps} warm-up) of plan "
         f"{m.plan_hash}: {len(plan.submodels)} sub-models, C={plan.accum}, on {m.device}"),
        (f"{'':22s}{'measured':>10s}{'predicted':>12s}{'error':>9s}{'calibrated':>13s}"
         f"{'error':>9s}"),
        (f"{'step (median)':22s}{cmp.measured_step_ms:8.2f}ms{cmp.predicted_step_ms:10.2f}ms"
         f"{_pct(cmp.error_before):>9s}{cmp.calibrated_step_ms:11.2f}ms"
         f"{_pct(cmp.error_after):>9s}"),
        f"{'  steps min..max':22s}{steps[0]:8.2f}ms .. {steps[-1]:.2f} ms",
    ]
    for lane in LANES:
        meas, pred, cal = (cmp.measured_busy[lane], cmp.predicted_busy[lane],
                           cmp.calibrated_busy[lane])
        lines.append(f"{'  busy ' + lane:22s}{meas:10.1%}{pred:12.1%}"
                     f"{(pred - meas) * 100:+8.1f}pt{cal:13.1%}{(cal - meas) * 100:+8.1f}pt")
    lines.append("per sub-model, measured / predicted / calibrated (ms; forward and backward "
                 "per micro-batch, the rest per step):")
    lines.append(f"  {'':4s}{'forward':>26s}{'backward':>26s}{'load':>20s}{'offload':>20s}"
                 f"{'update':>20s}")
    cal = {s.index: s for s in calibrated_plan.submodels}
    for sm, ms in zip(plan.submodels, m.submodels):
        c = cal[sm.index]

        def three(a: float, b: float, x: float, width: int) -> str:
            return f"{a:.2f}/{b:.2f}/{x:.2f}".rjust(width)

        lines.append(f"  P{sm.index:<3d}{three(ms.fwd_ms, sm.fwd_ms, c.fwd_ms, 26)}"
                     f"{three(ms.bwd_ms, sm.bwd_ms, c.bwd_ms, 26)}"
                     f"{three(ms.load_ms, sm.load_ms, c.load_ms, 20)}"
                     f"{three(ms.offload_ms, sm.offload_ms, c.offload_ms, 20)}"
                     f"{three(ms.optimizer_ms, sm.optimizer_ms, c.optimizer_ms, 20)}")
    record = calibrated.calibration
    if record is not None:
        factors = ", ".join(f"P{s.index} x{s.fwd_scale:.2f}/x{s.bwd_scale:.2f}"
                            for s in record.submodels)
        lines.append(f"scale factors (forward/backward): {factors}")
        lines.append(f"bandwidths: host to device {calibrated.h2d_gbps:.2f} GB/s "
                     f"(x{record.h2d_scale:.2f} of the profile's), device to host "
                     f"{calibrated.d2h_gbps:.2f} GB/s (x{record.d2h_scale:.2f}); CPU update "
                     f"{record.cpu_adam_gbps:.2f} GB/s of fp32 masters (the plan assumed "
                     f"{plan.cpu_adam_gbps:.2f})")
        if record.host_gap_ms:
            lines.append(f"host thread: {record.host_gap_ms * 1e3:.0f} us of its own before "
                         f"each action (the CPU runtime drives and copies on one thread)")
    return "\n".join(lines)
