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
`host` (the runtime's CPU AdamW rate on this machine: `atomc partition --cpu-adam-gbps auto`).
`atomc calibrate` is atomc.cli.calibrate.
"""

import importlib
from typing import Any

# each public name and the module it lives in, imported when first used: `atomc partition`
# reads the host and disk rates (host, disk) and needs none of the runtime (torch) that
# measuring a package imports
_WHERE = {
    "MeasuredSubmodel": "measure", "Measurement": "measure", "check_device": "measure",
    "check_losses": "measure", "device_matches": "measure", "measure_package": "measure",
    "summarise": "measure", "measure_runtime_costs": "runtime_costs",
    "COMPUTE_OPS": "scale", "MIN_SCALE": "scale", "calibrate": "scale",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'atomc.calibrate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"atomc.calibrate.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
