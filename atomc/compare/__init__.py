"""Compare: which way to train one model on these devices, predicted.

    profiles + network (atomc network's JSON) -compare-> one ModeResult per mode

The same global batch trained four ways (ATOM peers, DT-FM layouts with GPipe or 1F1B, SWARM),
each timed by the simulators of the action lists its runtime executes (atomc.simulate.events
for a swapped step, atomc.simulate.network for devices joined by links); see peers.py,
layouts.py and swarm.py for what each mode does and costs.py for what the model costs on a
device.

Devices are the network file's: each names its hardware in `gpu` (a hardware profile of
`atomc profiles`, or `cpu` for a host CPU), optionally its device memory (`memory_bytes`, default
the hardware profile's) and its host memory (`host_memory_bytes`: a peer must hold the whole
model there; unchecked without it). Every kind of hardware a device names needs a profile of the
model for it: estimated (`atomc profile MODEL --target NAME`) or measured on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atomc.compare.costs import HardwareModel, hardware_model
from atomc.compare.layouts import predict_layouts
from atomc.compare.modes import MODES, Machine, ModeResult, Setting, links_of
from atomc.compare.peers import predict_peers
from atomc.compare.swarm import predict_swarm
from atomc.device import names_cpu
from atomc.errors import NetworkError, UsageError
from atomc.ir import Profile
from atomc.jsonio import read_json
from atomc.place.network import Network, network_from_data
from atomc.profile.hardware import hardware_names, load_hardware
from atomc.units import format_bytes

CPU = "cpu"


@dataclass
class Comparison:
    network: Network
    machines: list[Machine]
    setting: Setting
    results: dict[str, ModeResult]  # by mode, in MODES order

    def feasible(self) -> list[ModeResult]:
        return [r for r in self.results.values() if r.feasible]

    def fastest(self) -> ModeResult | None:
        ok = self.feasible()
        return min(ok, key=lambda r: (r.step_ns, MODES.index(r.mode))) if ok else None


def profile_key(profile: Profile) -> str:
    """The hardware a profile is for: its hardware profile's name, `cpu` for one measured on
    a CPU, else the device it was measured on."""
    if profile.hardware is not None:
        return profile.hardware.name
    return CPU if names_cpu(profile.device) else profile.device


def resolve_hardware(gpu: str | None, device: str, source: str) -> str:
    """A network device's `gpu` -> a hardware profile name (exact, or the one name it starts
    with: DT-FM's scenarios say "V100"), or `cpu`."""
    names = hardware_names()
    if gpu is None or not gpu.strip():
        raise NetworkError(f"{source}: device {device} names no hardware; give it \"gpu\": one "
                           f"of {', '.join(names)} or {CPU} (see `atomc profiles`)")
    text = gpu.strip().lower().replace(" ", "-")
    if text == CPU or text in names:
        return text
    starts = [n for n in names if n.startswith(text)]
    if len(starts) == 1:
        return starts[0]
    raise NetworkError(f"{source}: device {device} names gpu {gpu!r}, which is no hardware "
                       f"profile{' (it could be ' + ' or '.join(starts) + ')' if starts else ''}; "
                       f"expected one of {', '.join(names)} or {CPU} (see `atomc profiles`)")


def read_network(path: str | Path) -> tuple[Network, list[int | None]]:
    """The network file and each device's host memory (`host_memory_bytes`, or None)."""
    data = read_json(path, Network.KIND)
    network = network_from_data(data, str(path))
    host: list[int | None] = []
    for i, d in enumerate(data.get("devices", [])):
        value = d.get("host_memory_bytes") if isinstance(d, dict) else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise NetworkError(f"{path}: devices[{i}].host_memory_bytes is {value!r}; expected "
                               f"a number of bytes >= 0")
        host.append(value)
    return network, host


def machines_of(network: Network, host_memory: list[int | None] | None = None,
                source: str = "network") -> list[Machine]:
    host_memory = host_memory or [None] * network.num_devices
    out = []
    for d, host in zip(network.devices, host_memory):
        hw = resolve_hardware(d.gpu, d.name, source)
        memory = d.memory_bytes
        if memory is None:
            if hw == CPU:
                raise NetworkError(f"{source}: device {d.name} is a cpu, which has no hardware "
                                   f"profile to take its memory from; give it \"memory_bytes\"")
            memory = load_hardware(hw).memory_bytes
        out.append(Machine(name=d.name, hardware=hw, memory_bytes=int(memory),
                           host_memory_bytes=host))
    return out


def hardware_models(profiles: list[Profile], machines: list[Machine], *, slowdown: float = 1.0,
                    no_update: bool = False) -> dict[str, HardwareModel]:
    """One HardwareModel per kind of device; UsageError when one has no profile, or the
    profiles are of different models or micro-batches."""
    if not profiles:
        raise UsageError("give at least one profile of the model (atomc profile)")
    by_key: dict[str, Profile] = {}
    first = profiles[0].graph
    for p in profiles:
        if p.graph.structure_hash() != first.structure_hash() or \
                p.graph.batch_size != first.batch_size:
            raise UsageError(
                f"the profiles are of different models or micro-batches ({first.model_path} "
                f"{first.config} batch {first.batch_size}, {p.graph.model_path} "
                f"{p.graph.config} batch {p.graph.batch_size}); profile one model, one "
                f"micro-batch, for every kind of device")
        by_key.setdefault(profile_key(p), p)
    models = {}
    for m in machines:
        if m.hardware in models:
            continue
        p = by_key.get(m.hardware)
        if p is None:
            given = ", ".join(sorted(by_key))
            how = ("measure one on the CPU (atomc profile MODEL --device cpu)" if m.hardware == CPU
                   else f"estimate one: atomc profile {first.model_path} "
                        f"{'--config ' + first.config + ' ' if first.config else ''}"
                        f"--batch-size {first.batch_size} --target {m.hardware}")
            raise UsageError(f"device {m.name} is a {m.hardware}, but no profile given is for "
                             f"{m.hardware} (given: {given}); {how}, and give it too")
        models[m.hardware] = hardware_model(m.hardware, p, slowdown=slowdown,
                                            no_update=no_update)
    return models


def check_modes(text: str | None) -> tuple[str, ...]:
    if text is None:
        return MODES
    modes = tuple(m.strip().lower() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"--modes {text!r}: expected a comma-separated list of "
                         f"{', '.join(MODES)}")
    return tuple(m for m in MODES if m in modes)


def compare(profiles: list[Profile], network: Network, setting: Setting, *,
            modes: tuple[str, ...] = MODES, host_memory: list[int | None] | None = None,
            slowdown: float = 1.0, source: str = "network",
            models: dict[str, HardwareModel] | None = None) -> Comparison:
    """Predict one global batch in each of `modes` (see the module docstring)."""
    if setting.global_batch < 1:
        raise UsageError(f"--global-batch {setting.global_batch}: expected at least 1 sample")
    machines = machines_of(network, host_memory, source)
    if models is None:
        models = hardware_models(profiles, machines, slowdown=slowdown,
                                 no_update=not setting.sync)
    b = next(iter(models.values())).micro_batch
    if setting.global_batch % b:
        raise UsageError(f"--global-batch {setting.global_batch} is not a multiple of the "
                         f"profiled micro-batch {b}; give a multiple of {b}")
    results: dict[str, ModeResult] = {}
    if "peers" in modes:
        results["peers"] = predict_peers(machines, models, links_of(network), setting)
    schedules = tuple(m for m in ("gpipe", "1f1b") if m in modes)
    if schedules:
        results.update(predict_layouts(machines, models, network, setting, schedules))
    if "swarm" in modes:
        results["swarm"] = predict_swarm(machines, models, network, setting)
    return Comparison(network=network, machines=machines, setting=setting,
                      results={m: results[m] for m in MODES if m in results})


def describe_machines(machines: list[Machine]) -> str:
    return ", ".join(f"{m.name} ({m.hardware}, {format_bytes(m.memory_bytes)})"
                     for m in machines)


def to_data(c: Comparison) -> dict[str, Any]:
    """The comparison as plain JSON data."""
    fastest = c.fastest()
    return {
        "kind": "atomc.comparison",
        "network": c.network.name,
        "devices": [{"name": m.name, "hardware": m.hardware, "memory_bytes": m.memory_bytes,
                     "host_memory_bytes": m.host_memory_bytes} for m in c.machines],
        "global_batch": c.setting.global_batch,
        "sync": c.setting.sync,
        "fastest": fastest.mode if fastest else None,
        "modes": {
            k: {"feasible": r.feasible, "reason": r.reason, "step_s": r.step_s,
                "config": r.config, "binding": r.binding,
                "busy": dict(r.busy),
                "links": [{"from": a, "to": b, "bytes": nb, "busy": s}
                          for a, b, nb, s in r.links],
                "detail": r.detail}
            for k, r in c.results.items()},
    }


__all__ = ["MODES", "Comparison", "Machine", "ModeResult", "Setting", "check_modes", "compare",
           "hardware_models", "machines_of", "profile_key", "read_network", "resolve_hardware",
           "to_data"]
