"""Stage 2, profile: TracedModel -> Profile (per-operator memory and time).

Public: `profile_model(traced, device=..., target=..., ...)`.

- measured (`device="cpu"` or `"cuda[:N]"`): each operator runs alone on the device with
  inputs of its recorded shapes, timed (warm-up, repeats, median; CUDA events on GPU) and
  freed again; load time is a real host-to-device copy (pinned on CUDA). The model file's
  `loss_fn`, which the last sub-model runs every step but the graph does not hold, is timed
  and its working memory measured on outputs of the traced shapes, both charged to the
  output node.
  In a process's first profile every operator first runs once untimed (a cold process timed
  them up to 30% slow). The runtime's own costs (update per tensor, Python per action) are
  measured with its code by the function the caller passes as `runtime_costs`
  (atomc.calibrate.measure_runtime_costs, which `atomc profile` passes).
- estimated (`target=NAME` of profiles/): FLOPs from torch.utils.flop_counter and bytes on
  meta tensors, time from a roofline of the hardware profile.

Operators with equal signatures (target, hyperparameters, shapes, dtypes) are measured once:
96 identical transformer blocks cost one.

Modules: `model` (profile_model), `ops` (per-operator analysis on meta tensors), `measure`
and `timing` (timed runs), `estimate` and `hardware` (the roofline), `report` (the summary).
`atomc profile` is atomc.cli.profile.
"""

from atomc.profile.estimate import estimate_ms, load_ms
from atomc.profile.hardware import hardware_names, load_hardware
from atomc.profile.measure import Measured, measure, size_peaks
from atomc.profile.model import COMPUTE_OPS, profile_model
from atomc.profile.ops import MetaStats, analyse, materialise
from atomc.profile.timing import CopyTimer, time_ms

__all__ = ["COMPUTE_OPS", "CopyTimer", "Measured", "MetaStats", "analyse", "estimate_ms",
           "hardware_names", "load_hardware", "load_ms", "materialise", "measure",
           "profile_model", "size_peaks", "time_ms"]
