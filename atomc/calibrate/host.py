"""The host's CPU AdamW rate for the cost model: `--cpu-adam-gbps auto`.

Input: the `--cpu-adam-gbps` value, the profile being partitioned and the dtype of AdamW's
moments (`--optimizer-states`). Output: a rate in GB/s of fp32 master bytes (optimizer time =
4 bytes x parameters / rate) and a sentence saying where it comes from, for the plan's notes.

- A measured profile is partitioned for this machine, so "auto" measures this machine: a short
  benchmark of the runtime's own CPU AdamW (atomc.runtime.optim), cached per machine in
  `$ATOMC_CACHE_DIR/host.json` (default `~/.cache/atomc`).
- An estimated profile is for a target GPU that is not here, so "auto" takes the host figure
  of its hardware profile (`host_adam_gbps`, with its source in `sources`). That figure is
  torch's fused float32 update; for bfloat16 moments the sentence says so (the chunked update
  was not measured on that host).
- A calibrated profile (`atomc calibrate`) carries the rate of the runtime's own updates,
  measured in training steps; "auto" takes it.
- A number is taken as given.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atomc.errors import UsageError
from atomc.ir import HardwareProfile, Profile
from atomc.jsonio import write_atomic

CACHE_ENV = "ATOMC_CACHE_DIR"
CACHE_FILE = "host.json"
CACHE_VERSION = 2  # 2: identities say whether copies ran beside the updates
# the sentence in a hardware profile's `sources` that says where host_adam_gbps comes from
HOST_SOURCE_PREFIX = "Host CPU AdamW"
# 32M fp32 parameters: weights, gradients and two moments are 512 MB, past the last-level cache
# of all but AMD's stacked-cache parts, so the update streams from DRAM as a real model's does
BENCH_PARAMS = 32 << 20
BENCH_TENSORS = 4
BENCH_STEPS = 5


def _bench_update(size: int, states: str, transfer: str) -> Callable[[], None]:
    """One sub-model's update exactly as the runtime runs it: BENCH_TENSORS weights of `size`
    in a host store of `transfer` images (float32: the image is the master; bfloat16: its
    high half, beside the residual), moments kept in `states`, the gradients in the store's
    buffer. Returns a function that runs one update."""
    import torch

    from atomc.runtime.cpuoptimizer import CpuOptimizer
    from atomc.runtime.layouts import ParamEntry, SubLayout
    from atomc.runtime.optim import AdamWConfig
    from atomc.runtime.store import HostStore, moment_dtype
    from atomc.runtime.trace import Tracer

    n = size * BENCH_TENSORS
    entries = tuple(ParamEntry(f"w{k}", f"w{k}", (size,), size, k * size, 0, k * size, True,
                               True, size, False, True, k * size) for k in range(BENCH_TENSORS))
    layout = SubLayout(0, entries, n, n, n, n, n)
    config = AdamWConfig(states=states)
    store = HostStore([layout], torch.float32, getattr(torch, transfer), pin=False,
                      moment_dtype=moment_dtype(states, torch.float32))
    # a normal-range gradient: subnormal moments would time the CPU's slow path
    store.grad(0).fill_(1e-3)
    optimizer = CpuOptimizer(store, config, None, Tracer(torch.device("cpu"), enabled=False),
                             threaded=False)
    return lambda: optimizer.update_now(0, 0)


def measure_adam_gbps(num_params: int = BENCH_PARAMS, num_steps: int = BENCH_STEPS,
                      beside_copies: bool = False, states: str = "float32",
                      transfer: str = "float32") -> float:
    """GB/s of fp32 master bytes that the runtime's CPU AdamW updates on this machine.

    The runtime's path exactly (`_bench_update`): its host store and optimizer, with the
    runtime's default settings (AdamWConfig: the fused CPU kernel), over float32 masters kept
    as a float32 or a bfloat16 (`transfer`) store keeps them, moments in `states`. Two steps
    first, then the median of `num_steps` timed steps.

    `beside_copies` (CUDA): while pinned copies run to and from the GPU, as the swap runtime's
    loads and gradient offloads do through the backward its updates overlap. Both read and
    write host memory: on an H200's host the updates ran at 8.7-12.7 GB/s in training steps
    against 14.5-19.6 measured alone, and plans from the lone figure came out 13% fast.
    """
    size = max(1, num_params // BENCH_TENSORS)
    update = _bench_update(size, states, transfer)

    def timed_steps() -> list[float]:
        for _ in range(2):
            update()
        times = []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            update()
            times.append(time.perf_counter() - t0)
        return times

    if not beside_copies:  # on the calling thread, as the runtime updates for a CPU device
        return 4 * size * BENCH_TENSORS / statistics.median(timed_steps()) / 1e9
    # on a worker thread, as the runtime updates for a CUDA device (atomc-cpu-adamw)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="atomc-adam-bench") as pool:
        stop = threading.Event()
        traffic = pool.submit(_copy_traffic, stop)
        try:
            times = pool.submit(timed_steps).result()
        finally:
            stop.set()
        traffic.result()
    return 4 * size * BENCH_TENSORS / statistics.median(times) / 1e9


COPY_BYTES = 256 << 20


def _copy_traffic(stop: threading.Event) -> None:
    """Pinned copies host to device and back, on two streams, until `stop` is set."""
    import torch

    host_in = torch.ones(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(COPY_BYTES, dtype=torch.uint8, device="cuda")
    load, offload = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(load):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(offload):
            host_out.copy_(dev_out, non_blocking=True)
        load.synchronize()  # waits release the GIL for the update's thread
        offload.synchronize()


def _cpu_model() -> str:
    # platform.processor() is empty or just "x86_64" on Linux; the model name is in cpuinfo
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_identity(beside_copies: bool = False, states: str = "float32",
                     transfer: str = "float32") -> dict[str, Any]:
    """What the rate depends on: a cached rate is reused only for the same values."""
    import torch

    from atomc.runtime.optim import AdamWConfig

    return {"hostname": socket.gethostname(), "machine": platform.machine(),
            "processor": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "adamw_impl": AdamWConfig().impl, "beside_copies": beside_copies,
            "states": states, "transfer": transfer}


def _identity_key(identity: dict[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True)


def _describe(identity: dict[str, Any]) -> str:
    states = identity.get("states", "float32")
    return (f"{identity['hostname']}: {identity['processor'] or identity['machine']}, "
            f"{identity['torch_threads']} torch threads, torch {identity['torch']}"
            + (f", {states} moments" if states != "float32" else "")
            + (f", {identity['transfer']} images" if identity.get("transfer", "float32")
               != "float32" else "")
            + (", beside copies to and from the GPU" if identity.get("beside_copies") else ""))


def cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "atomc"
    return Path(base) / CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries by identity key; a missing, unreadable or broken file is empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    hosts = data.get("hosts")
    return hosts if isinstance(hosts, dict) else {}


def _valid_rate(entry: Any) -> float | None:
    rate = entry.get("adam_gbps") if isinstance(entry, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        return None
    return float(rate) if math.isfinite(rate) and rate > 0 else None


def host_adam_gbps(for_cuda: bool = False, states: str = "float32",
                   transfer: str = "float32") -> tuple[float, str]:
    """This machine's CPU AdamW rate (GB/s of fp32 masters) and where it comes from, for
    moments kept in `states` and masters kept beside `transfer` images.

    `for_cuda`: the plan swaps to a GPU, so the updates are timed beside copies to and from
    it where CUDA is here (see measure_adam_gbps). Measured once per machine identity and
    kept in the cache file; machines that share a home directory keep separate entries. A
    cache that cannot be written still gives the rate.
    """
    import torch

    beside = for_cuda and torch.cuda.is_available()
    path = cache_path()
    identity = machine_identity(beside, states, transfer)
    key = _identity_key(identity)
    hosts = _read_cache(path)
    where = f"measured on this host ({_describe(identity)}), cached in {path}"
    rate = _valid_rate(hosts.get(key))
    if rate is not None:
        return rate, where
    rate = measure_adam_gbps(beside_copies=beside, states=states, transfer=transfer)
    hosts = {k: v for k, v in hosts.items() if _valid_rate(v) is not None}
    hosts[key] = {"adam_gbps": rate, "identity": identity,
                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        write_atomic(path, json.dumps({"version": CACHE_VERSION, "hosts": hosts}, indent=1))
    except OSError as e:
        return rate, (f"measured on this host ({_describe(identity)}); not cached: cannot "
                      f"write {path} ({e.strerror or e}); set ${CACHE_ENV} to a writable folder")
    return rate, where


def _host_source(hardware: HardwareProfile) -> str:
    for sentence in hardware.sources:
        if sentence.startswith(HOST_SOURCE_PREFIX):
            return sentence
    return ""


def resolve_cpu_adam(value: str | float, profile: Profile, states: str = "float32",
                     transfer: str = "float32") -> tuple[float, str]:
    """`--cpu-adam-gbps` -> (rate in GB/s of fp32 masters, where it comes from), for AdamW's
    moments kept in `states` (`--optimizer-states`) and masters kept beside `transfer`
    images (bfloat16: split, see atomc.runtime.store)."""
    expected = ('give "auto" (measure this host, or take an estimated profile\'s host figure) '
                'or a rate in GB/s of fp32 master weights (0 leaves the optimizer out of the '
                'model)')
    if isinstance(value, str) and value.strip().lower() == "auto":
        cal = profile.calibration
        if cal is not None and cal.cpu_adam_gbps > 0:
            return cal.cpu_adam_gbps, (f"calibrated: the runtime's own updates in "
                                       f"{cal.num_steps} steps of plan {cal.plan_hash} on "
                                       f"{cal.device}")
        if profile.mode != "estimated":
            return host_adam_gbps(for_cuda=profile.device.startswith("cuda"), states=states,
                                  transfer="bfloat16" if transfer == "bfloat16" else "float32")
        hw = profile.hardware
        if hw is None:
            raise UsageError(f"--cpu-adam-gbps auto: the profile is estimated for "
                             f"{profile.device!r} but carries no hardware profile, so there is "
                             f"no host figure to take; give a rate in GB/s, e.g. "
                             f"--cpu-adam-gbps 8")
        if not hw.host_adam_gbps > 0:
            raise UsageError(f"--cpu-adam-gbps auto: hardware profile {hw.name} gives no host "
                             f"CPU AdamW rate (host_adam_gbps is {hw.host_adam_gbps:g}); give a "
                             f"rate in GB/s for the host it will run on, e.g. "
                             f"--cpu-adam-gbps 8, or 0 to leave the optimizer out of the model")
        source = f"host figure of hardware profile {hw.name}"
        sentence = _host_source(hw)
        rate = float(hw.host_adam_gbps)
        if states != "float32" or transfer == "bfloat16":
            # that host's chunked update was not measured, and this host's ratio says little
            # of it: the fused update is memory-bound there, while the chunked one moves
            # fewer DRAM bytes (its float32 scratch stays in cache) in more passes
            source += (", for float32 moments and masters (the chunked update of "
                       f"{states} moments and {transfer} images was not measured on that "
                       "host; `atomc calibrate` measures the run's own)")
        return rate, f"{source}: {sentence}" if sentence else source
    if isinstance(value, bool):
        raise UsageError(f"--cpu-adam-gbps {value!r} is not a rate; {expected}")
    try:
        rate = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise UsageError(f"--cpu-adam-gbps {value!r} is not a rate; {expected}") from None
    if math.isnan(rate):
        raise UsageError(f"--cpu-adam-gbps {value!r} is not a number; {expected}")
    if rate < 0:
        raise UsageError(f"--cpu-adam-gbps {value!r} is negative; {expected}")
    return rate, "given"
