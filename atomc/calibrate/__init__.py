"""Calibrate stage (runtime -> back to partition): Profile + Plan + measured steps -> Profile.

The partitioner decides from predicted times: the sum of each operator timed alone. A
measurement of the plan's generated package (`measure_package`: a few traced training steps
with the swap runtime) says what the plan's sub-models really take; `calibrate` scales the
profile to it:

- every node of sub-model i has its forward time multiplied by f_i = measured / profiled
  forward of the sub-model, and its backward time by b_i, chosen so that the sub-model's
  backward with its recomputation (at the scaled forward) equals the measured backward; a
  sub-model whose nodes were profiled at 0 ms gets the measured time spread over its
  operators;
- the host-to-device and device-to-host bandwidths become those the copies achieved;
- the CPU update rate becomes the runtime's own (fp32 master bytes over update time), which
  `atomc partition --cpu-adam-gbps auto` takes from a calibrated profile;
- on a CPU device, whose runtime thread also copies and drives every action in Python, the
  time that thread spends before each action besides what its events show (`host_gap_ms`)
  is fitted so that the plan's simulated step is the measured one; plans made from the
  calibrated profile carry it.

The factors, the measured times and the predicted step before and after are recorded in the
profile (`Profile.calibration`), so a plan made from it says where its numbers come from. The
calibrated profile is an ordinary profile: partition it again for the re-plan.

The runtime's own costs on a device, which a measured profile holds, are measured here too,
by running the runtime (`measure_runtime_costs`; `atomc profile` passes it to profile_model).

Modules: `measure` (a package's traced steps -> Measurement), `scale` (calibrate),
`report` (the before/after text), `runtime_costs` and `probe` (the runtime's own costs),
`host` (the runtime's CPU AdamW rate on this machine: `atomc partition --cpu-adam-gbps auto`),
`cli` (`atomc calibrate`).
"""

from atomc.calibrate.measure import (
    MeasuredSubmodel,
    Measurement,
    check_device,
    check_losses,
    device_matches,
    measure_package,
    summarise,
)
from atomc.calibrate.runtime_costs import measure_runtime_costs
from atomc.calibrate.scale import COMPUTE_OPS, MIN_SCALE, calibrate

__all__ = ["COMPUTE_OPS", "MIN_SCALE", "MeasuredSubmodel", "Measurement", "calibrate",
           "check_device", "check_losses", "device_matches", "measure_package",
           "measure_runtime_costs", "summarise"]
