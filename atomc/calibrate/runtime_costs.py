"""The swap runtime's own costs on a device: small runs of its code -> RuntimeCosts.

No operator's time holds them, and a plan of many small sub-models pays them many times:

- a sub-model's CPU update is AdamW tensor by tensor (atomc.runtime.optim), so besides its
  bytes it costs a fixed part and a part per parameter tensor; for the mini GPT's sub-models
  these were most of the update (1.2-1.6 ms against 0.03-0.23 ms at the bytes' rate);
- on a CPU device the runtime's one thread drives every action in Python (atomc.runtime.
  interpret) and copies on it too: about 0.1 ms before each action, which a step of 50
  actions pays 50 times; and inside each forward and backward it spends time of its own
  beyond the operators' (arguments, the RNG rule, the autograd call, gradients zeroed and
  summed): the mini GPT's 14 sub-models took 0.06-0.22 ms more per forward and 0.2-0.4 ms
  more per backward than their operators' times, 12-16% of the step, on every plan.

Both are measured with the runtime's code: the update with the optimizer the runtime builds
(torch AdamW with AdamWConfig's settings over views of flat buffers) where the runtime runs
it: on a worker thread beside a GPU's compute, on the runtime's own thread on a CPU device
(atomc.runtime.optim.updates_on_a_thread); the per-action and per-call times with the swap
executor itself, on a package of tiny sub-models whose compute takes microseconds
(atomc.calibrate.probe).

They are measured by running the runtime, so they are measured above it: `atomc profile`
hands `measure_runtime_costs` to profile_model, which calls it on the device it profiles.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from atomc.calibrate.probe import runtime_ms
from atomc.ir import RuntimeCosts
from atomc.runtime.optim import AdamWConfig, updates_on_a_thread

PROBE_NUMEL = 1024  # elements per tensor: small enough that the bytes cost nothing
PROBE_TENSORS = (1, 16)


def _optimizer(num_tensors: int, numel: int) -> torch.optim.Optimizer:
    """AdamW as CpuOptimizer builds it: one view per parameter of a flat master and gradient."""
    master = torch.zeros(num_tensors * numel, dtype=torch.float32)
    grad = torch.full_like(master, 1e-3)  # normal-range: subnormal moments time a slow path
    params = []
    for i in range(num_tensors):
        p = torch.nn.Parameter(master[i * numel:(i + 1) * numel])
        p.grad = grad[i * numel:(i + 1) * numel]
        params.append(p)
    return torch.optim.AdamW(params, **AdamWConfig().torch_kwargs())


def _step_ms(optimizer: torch.optim.Optimizer, repeats: int) -> float:
    for _ in range(2):  # the first step allocates the moments
        optimizer.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def update_costs_ms(device: torch.device, repeats: int = 20) -> tuple[float, float]:
    """(fixed, per tensor) ms of one sub-model's update, stepped where the runtime steps it:
    on a worker thread or the calling thread (atomc.runtime.optim.updates_on_a_thread)."""
    times = []
    for n in PROBE_TENSORS:
        optimizer = _optimizer(n, PROBE_NUMEL)
        if not updates_on_a_thread(device):
            times.append(_step_ms(optimizer, repeats))
            continue
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomc-update-probe") as pool:
            times.append(pool.submit(_step_ms, optimizer, repeats).result())
    (n1, t1), (n2, t2) = zip(PROBE_TENSORS, times)
    per_tensor = max((t2 - t1) / (n2 - n1), 0.0)
    return max(t1 - n1 * per_tensor, 0.0), per_tensor


_MEASURED: dict[tuple[str, int], RuntimeCosts] = {}


def measure_runtime_costs(device: torch.device, repeats: int = 20) -> RuntimeCosts:
    """The runtime's costs on `device`, measured once per process (and torch thread count):
    they are the machine's and the runtime's, not the model's."""
    key = (str(device), torch.get_num_threads())
    if key not in _MEASURED:
        fixed, per_tensor = update_costs_ms(device, repeats)
        if device.type == "cpu":
            action, forward, backward = runtime_ms(device)
            _MEASURED[key] = RuntimeCosts(fixed, per_tensor, action, forward, backward)
        else:
            _MEASURED[key] = RuntimeCosts(fixed, per_tensor)
    return _MEASURED[key]
