"""Compare: which way to train one model on these devices, predicted.

    profiles or plans + network (atomc network's JSON) -compare-> one ModeResult per mode

The same global batch trained four ways (ATOM peers, DT-FM layouts with GPipe or 1F1B, SWARM)
and, asked for by name, DiLoCo's peers (an outer step every H local steps, compressed rounds),
each timed by the simulators of the action lists its runtime executes (atomc.simulate.events
for a swapped step, atomc.simulate.network for devices joined by links); see peers.py,
diloco.py, layouts.py and swarm.py for what each mode does and costs.py for what the model
costs on a device.

Devices are the network file's: each names its hardware in `gpu` (a hardware profile of
`atomc profiles`, or `cpu` for a host CPU), optionally its device memory (`memory_bytes`, default
the hardware profile's) and its host memory (`host_memory_bytes`: a peer must hold the whole
model there; unchecked without it). Every kind of hardware a device names needs a profile of the
model for it: estimated (`atomc profile MODEL --target NAME`) or measured on a CPU, or a plan
(`GivenPlan`: one `atomc partition` wrote, with the profile it was made from), which gives that
profile and the swap plan every peer of its hardware trains with instead of one partitioned for
the device's memory (a device with less memory than the plan was made for is refused, as the
swap runtime refuses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomc.compare.costs import GivenPlan, HardwareModel, hardware_model
from atomc.compare.diloco import predict_diloco
from atomc.compare.layouts import predict_layouts
from atomc.compare.modes import (
    BASELINES,
    DEFAULT_MODES,
    MODES,
    Machine,
    ModeResult,
    Setting,
    links_of,
)
from atomc.compare.peers import predict_peers
from atomc.compare.swarm import predict_swarm
from atomc.device import names_cpu
from atomc.errors import NetworkError, UsageError
from atomc.ir import OpGraph, Profile
from atomc.jsonio import read_json
from atomc.partition import profile_hash
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
    plans: dict[str, str] = field(default_factory=dict)  # device -> the given plan its peer uses

    def feasible(self) -> list[ModeResult]:
        return [r for r in self.results.values() if r.feasible]

    def fastest(self) -> ModeResult | None:
        """The fastest mode atomc runs: a baseline it only models is never the answer."""
        ok = [r for r in self.feasible() if r.mode not in BASELINES]
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


def _model_words(g: OpGraph) -> str:
    return f"{g.model_path}{' ' + g.config if g.config else ''} batch {g.batch_size}"


def _check_plans(plans: Sequence[GivenPlan], profiles: list[Profile],
                 machines: list[Machine]) -> dict[str, GivenPlan]:
    """The given plans by hardware; UsageError for a plan of another model than the other
    inputs, two plans for one kind of device, a plan for hardware no device is, or another
    profile given for the plan's hardware."""
    by_key: dict[str, GivenPlan] = {}
    first = (profiles[0] if profiles else plans[0].profile).graph
    first_hash = first.structure_hash()
    kinds = sorted({m.hardware for m in machines})
    for gp in plans:
        if gp.plan.graph_hash != first_hash or \
                gp.plan.batch_size != first.batch_size:
            raise UsageError(
                f"{gp.source} is a plan of {_model_words(gp.profile.graph)}, but the other "
                f"inputs are of {_model_words(first)}; give plans and profiles of one model and "
                f"one micro-batch")
        key = profile_key(gp.profile)
        if key in by_key:
            raise UsageError(f"{by_key[key].source} and {gp.source} are both plans for {key}; "
                             f"give one plan per kind of device")
        if key not in kinds:
            raise UsageError(f"{gp.source} is a plan for {key}, but no device is a {key} (the "
                             f"devices are {', '.join(kinds)}); give plans made from the "
                             f"profiles of the devices' hardware")
        if any(profile_key(p) == key and profile_hash(p) != gp.plan.profile_hash
               for p in profiles):
            raise UsageError(f"two profiles for {key}: one given, and another that "
                             f"{gp.source} was made from ({gp.plan.profile_hash}); give the "
                             f"plan's profile, or leave the other out")
        by_key[key] = gp
    return by_key


def hardware_models(profiles: list[Profile], machines: list[Machine], *, slowdown: float = 1.0,
                    no_update: bool = False, plans: Sequence[GivenPlan] = ()
                    ) -> dict[str, HardwareModel]:
    """One HardwareModel per kind of device, with the given plan for its peers where there is
    one; UsageError when a kind has no profile, or the profiles and plans are of different
    models or micro-batches (see _check_plans for the plans)."""
    if not profiles and not plans:
        raise UsageError("give at least one profile of the model (atomc profile) or a plan "
                         "(atomc partition)")
    by_plan = _check_plans(plans, profiles, machines) if plans else {}
    by_key: dict[str, Profile] = {k: gp.profile for k, gp in by_plan.items()}
    first = (profiles[0] if profiles else plans[0].profile).graph
    first_hash = first.structure_hash()
    for p in profiles:
        if p.graph.structure_hash() != first_hash or \
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
                                            no_update=no_update, given=by_plan.get(m.hardware))
    return models


def check_modes(text: str | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_MODES
    modes = tuple(m.strip().lower() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"--modes {text!r}: expected a comma-separated list of "
                         f"{', '.join(MODES)}")
    return tuple(m for m in MODES if m in modes)


def compare(profiles: list[Profile], network: Network, setting: Setting, *,
            modes: tuple[str, ...] = DEFAULT_MODES, host_memory: list[int | None] | None = None,
            slowdown: float = 1.0, source: str = "network",
            models: dict[str, HardwareModel] | None = None,
            plans: Sequence[GivenPlan] = ()) -> Comparison:
    """Predict one global batch in each of `modes` (see the module docstring). `plans`: the
    peers' plans for their hardware (or attached to `models`); UsageError for a device that
    cannot hold its plan, or an --accum other than a plan's C."""
    if setting.global_batch < 1:
        raise UsageError(f"--global-batch {setting.global_batch}: expected at least 1 sample")
    machines = machines_of(network, host_memory, source)
    if models is None:
        models = hardware_models(profiles, machines, slowdown=slowdown,
                                 no_update=not setting.sync, plans=plans)
    used = _plans_used(machines, models, setting)
    b = next(iter(models.values())).micro_batch
    if setting.global_batch % b:
        raise UsageError(f"--global-batch {setting.global_batch} is not a multiple of the "
                         f"profiled micro-batch {b}; give a multiple of {b}")
    results: dict[str, ModeResult] = {}
    if "peers" in modes:
        results["peers"] = predict_peers(machines, models, links_of(network), setting)
    if "diloco" in modes:
        results["diloco"] = predict_diloco(machines, models, links_of(network), setting)
    schedules = tuple(m for m in ("gpipe", "1f1b", "pipedream") if m in modes)
    if schedules:
        results.update(predict_layouts(machines, models, network, setting, schedules))
    if "swarm" in modes:
        results["swarm"] = predict_swarm(machines, models, network, setting)
    return Comparison(network=network, machines=machines, setting=setting,
                      results={m: results[m] for m in MODES if m in results}, plans=used)


def _plans_used(machines: list[Machine], models: dict[str, HardwareModel],
                setting: Setting) -> dict[str, str]:
    """Device -> the file of the given plan its peer trains with; UsageError where a device
    cannot hold it or --accum asks for another C."""
    used = {}
    for m in machines:
        given = models[m.hardware].given
        if given is None:
            continue
        line = given.misfit(f"device {m.name}", m.memory_bytes, m.host_memory_bytes)
        if line:
            raise UsageError(line)
        if setting.accum is not None and setting.accum != given.plan.accum:
            raise UsageError(f"--accum {setting.accum}, but {given.source} trains with "
                             f"C={given.plan.accum} (a given plan keeps its C); leave --accum "
                             f"out, or partition again with --accum {setting.accum}")
        used[m.name] = given.source
    return used


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
                     "host_memory_bytes": m.host_memory_bytes,
                     "plan": c.plans.get(m.name)} for m in c.machines],
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


__all__ = ["MODES", "Comparison", "GivenPlan", "Machine", "ModeResult", "Setting", "check_modes",
           "compare",
           "hardware_models", "machines_of", "profile_key", "read_network", "resolve_hardware",
           "to_data"]
