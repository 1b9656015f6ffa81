"""What each mode needs to know about the model on one kind of device.

input:  a profile (measured, or estimated for a hardware profile) and, for the peers, the
        device's memory
output: `HardwareModel`: the model cut at its repeated blocks into `Unit`s (the pieces pipeline
        stages and SWARM stages are made of: per micro-batch forward and backward, parameters,
        activations, the values that cross each cut) and the swap plan a peer trains with
        (atomc.partition, cached by memory and C; or a `GivenPlan`, one `atomc partition`
        wrote, which every peer of that hardware trains with as it is)

A resident stage (the layout runner's, a SWARM server's) keeps each micro-batch's autograd
graph from its forward to its backward, so its backward is the operators' backward without the
recomputation a swapped sub-model pays. `slowdown` multiplies every forward and backward: an
emulated device that computes that many times slower than the profile says (as
`atomc swarm serve --slowdown` does); copies and the optimizer keep the profile's times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch

from atomc.calibrate.host import resolve_cpu_adam
from atomc.codegen.manual import plan_from_cuts
from atomc.distributed.outer import describe_host_bytes
from atomc.errors import InfeasiblePlanError, UsageError
from atomc.ir import Plan, Profile
from atomc.partition import DEFAULT_RESERVE_BYTES, partition, plan_step, recost
from atomc.partition.cost import CostParams, optimizer_ns, runtime_params
from atomc.partition.hostmem import plan_host_memory
from atomc.partition.stagemem import (
    RESIDENT_COPIES,
    RESIDENT_COPIES_NO_UPDATE,
    boundary_bytes,
    resident_stage_bytes,
    swapped_stage_bytes,
)
from atomc.simulate.events import StageTimes
from atomc.units import DTYPE_BYTES, format_bytes, ms_to_ns

# AdamW on the device moves 28 bytes per fp32 parameter (reads the weight, its gradient and
# both moments, writes the weight and both moments): memory-bound
ADAM_BYTES_PER_MASTER_BYTE = 7
# a CUDA generator's state (atomc.runtime.rng.generators): Philox's seed and offset, two int64
CUDA_RNG_STATE_BYTES = 16


@dataclass(frozen=True)
class Unit:
    """One piece of the model (a repeated block, or what comes before or after them)."""

    start: int  # node range [start, stop) of the profile's graph
    stop: int
    fwd_ns: int  # one micro-batch
    bwd_ns: int  # one micro-batch, without recomputation
    param_bytes: int  # weights (and buffers) it reads
    params: frozenset[str]  # canonical FQNs of the weights it reads


@dataclass(frozen=True)
class GivenPlan:
    """A plan `atomc partition` wrote, given to compare, and the profile it was made from: the
    swap plan every peer of the profile's hardware trains with, its C included."""

    plan: Plan
    profile: Profile
    source: str  # the file it was read from

    def host_bytes(self) -> int:
        """Host bytes its run allocates: as the plan states them (its optimizer states'
        dtype), else by the plan's formula."""
        if self.plan.host is not None:
            return self.plan.host.total()
        return plan_host_memory(self.plan, self.profile.graph).total()

    def misfit(self, device: str, memory_bytes: int, host_memory_bytes: int | None) -> str:
        """Why `device` ("device g0") of this memory (and host memory, None: unchecked) cannot
        train with the plan, in one line; "" when it can. The swap runtime refuses a device
        with less memory than the plan was made for (atomc.runtime.trainer.
        check_device_memory), so that is the test; a device with more runs the plan as it is."""
        plan = self.plan
        if plan.capacity_bytes > memory_bytes:
            return (f"{self.source} was made for {format_bytes(plan.capacity_bytes)} "
                    f"({plan.capacity_bytes} bytes) of GPU memory, but {device} has "
                    f"{format_bytes(memory_bytes)} ({memory_bytes} bytes), and the swap runtime "
                    f"refuses a plan made for more than the device has; partition the profile "
                    f"for it (atomc partition PROFILE --gpu-mem {memory_bytes}) and give that "
                    f"plan")
        host = self.host_bytes()
        if host_memory_bytes is not None and host > host_memory_bytes:
            return (f"{self.source}: {device}'s host has {format_bytes(host_memory_bytes)} "
                    f"({host_memory_bytes} bytes), but a peer with this plan keeps "
                    f"{format_bytes(host)} ({host} bytes) there (fp32 masters, AdamW moments, "
                    f"transfer copies); give it more host memory, or leave peers out "
                    f"(--modes)")
        return ""


@dataclass
class PeerPlan:
    """A peer's swap plan on one device, and its simulated step; or why there is none."""

    plan: Plan | None
    error: str = ""
    step_ns: int = 0
    compute_ns: int = 0
    prefetch_busy_ns: int = 0  # the host-to-device lane, one step
    host_bytes: int = 0


@dataclass
class HardwareModel:
    """The model on one kind of device (see the module docstring)."""

    name: str  # hardware profile name, or the measured profile's device
    profile: Profile
    units: list[Unit]
    block_plan: Plan  # the units as a plan: the cut values between them
    slowdown: float = 1.0
    no_update: bool = False  # ATOM Fig. 14: no optimizer step
    given: GivenPlan | None = None  # the peers' plan, instead of partitioning for each memory
    _peers: dict[tuple[int, int | None], PeerPlan] = field(default_factory=dict)

    @property
    def micro_batch(self) -> int:
        return self.profile.graph.batch_size or 1

    @property
    def device_memory_bytes(self) -> int | None:
        hw = self.profile.hardware
        return hw.memory_bytes if hw is not None else None

    @property
    def rng_state_bytes(self) -> int:
        """What a stage sends with each micro-batch's values besides them: the generator
        states the micro-batch's stream stands at (atomc.runtime.rng.StepRng.state), the CPU
        generator's (mt19937: 5056 bytes) and, on a GPU, the CUDA generator's."""
        gpu = self.profile.hardware is not None or self.profile.device.startswith("cuda")
        return (torch.default_generator.get_state().numel()
                + (CUDA_RNG_STATE_BYTES if gpu else 0))

    @property
    def master_value_bytes(self) -> int:
        """Bytes of one master value: float64 for a float64 model, else float32."""
        return 8 if self.profile.graph.dtype == "float64" else 4

    @property
    def master_bytes(self) -> int:
        """Bytes of the trainable weights in the master dtype: what peers average."""
        return self.master_bytes_of(self.profile.graph.params)

    def master_bytes_of(self, fqns) -> int:
        """Bytes of the trainable weights among `fqns` in the master dtype."""
        g = self.profile.graph
        master = self.master_value_bytes
        frozen = set(g.frozen or ())
        return sum(g.params[f].num_bytes // max(DTYPE_BYTES.get(g.params[f].dtype, 4), 1)
                   * master for f in fqns if f in g.params and f not in frozen)

    @cached_property
    def cpu_adam(self) -> tuple[float, str]:
        """The CPU AdamW rate the partitioner takes (resolve_cpu_adam "auto") and where it
        comes from: once per model, as for a measured profile it reads this host's cache."""
        return resolve_cpu_adam("auto", self.profile)

    def param_bytes(self, fqns: set[str]) -> int:
        specs = self.profile.graph.params
        return sum(specs[f].num_bytes for f in fqns if f in specs)

    # -- resident stages --------------------------------------------------------------------------

    def stage_compute_ns(self, start: int, stop: int, recompute: bool = False
                         ) -> tuple[int, int]:
        """(forward, backward) of one micro-batch over units [start, stop); a recomputing
        stage runs each block's forward again before its backward."""
        fwd = sum(u.fwd_ns for u in self.units[start:stop])
        bwd = sum(u.bwd_ns for u in self.units[start:stop]) + (fwd if recompute else 0)
        return round(fwd * self.slowdown), round(bwd * self.slowdown)

    def stage_memory_bytes(self, start: int, stop: int, in_flight: int,
                           recompute: bool = False) -> int:
        """Device bytes a resident stage over units [start, stop) needs with `in_flight`
        micro-batches in flight, keeping graphs or recomputing (stagemem.resident_stage_bytes:
        the layout runner's rule, over the units as a plan)."""
        copies = RESIDENT_COPIES_NO_UPDATE if self.no_update else RESIDENT_COPIES
        return resident_stage_bytes(self.block_plan, start, stop, in_flight,
                                    recompute=recompute, copies=copies)

    def optimizer_ns(self, fqns: set[str]) -> int:
        """A resident stage's AdamW step over `fqns` on the device (0 without updates)."""
        if self.no_update or not fqns:
            return 0
        master = self.param_bytes(fqns)
        hw = self.profile.hardware
        if hw is not None:
            rate = hw.mem_gbps / ADAM_BYTES_PER_MASTER_BYTE
        else:  # a CPU: its AdamW rate, as the partitioner takes it
            rate = self.cpu_adam[0]
        return ms_to_ns(master / (rate * 1e9) * 1e3) if rate > 0 else 0

    def boundary_bytes(self, start: int) -> tuple[int, int]:
        """(values, gradients) of one micro-batch crossing the cut before unit `start`: what
        earlier units made and later ones read (stagemem.boundary_bytes)."""
        return boundary_bytes(self.block_plan, start)

    # -- peers ------------------------------------------------------------------------------------

    def peer_plan(self, capacity_bytes: int, accum: int | None,
                  reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> PeerPlan:
        """The swap plan `atomc partition` makes for a device of `capacity_bytes` and its
        simulated step (ATOM's order, the list the swap runtime runs). With a given plan: that
        plan, its own C, on any device that holds it (`GivenPlan.misfit`); without an
        optimizer step (`no_update`) recosted without its CPU update."""
        if self.given is not None:
            return self._given_peer(self.given, capacity_bytes)
        key = (capacity_bytes, accum)
        if key in self._peers:
            return self._peers[key]
        cpu_adam, source = (0.0, "no update") if self.no_update else self.cpu_adam
        try:
            plan = partition(self.profile, capacity_bytes, reserve_bytes=reserve_bytes,
                             accum=accum, cpu_adam_gbps=cpu_adam, cpu_adam_source=source)
        except (InfeasiblePlanError, UsageError) as e:
            found = PeerPlan(plan=None, error=str(e))
        else:
            found = self._simulate_peer(plan)
        self._peers[key] = found
        return found

    def _given_peer(self, given: GivenPlan, capacity_bytes: int) -> PeerPlan:
        line = given.misfit("the device", capacity_bytes, None)
        if line:
            return PeerPlan(plan=None, error=line)
        key = (-1, None)
        if key not in self._peers:
            plan = given.plan
            if self.no_update and plan.cpu_adam_gbps:
                plan = recost(self.profile, plan, cpu_adam_gbps=0.0,
                              cpu_adam_source="no update")
            self._peers[key] = self._simulate_peer(plan, host=given.host_bytes())
        return self._peers[key]

    def _simulate_peer(self, plan: Plan, host: int | None = None) -> PeerPlan:
        sim = plan_step(plan, self.slowdown)  # partition's, where it simulated this plan
        if host is None:
            host = plan_host_memory(plan, self.profile.graph).total()
        return PeerPlan(plan=plan, step_ns=sim.step_ns, compute_ns=sim.compute_ns,
                        prefetch_busy_ns=ms_to_ns(sim.timeline.busy_ms("prefetch", step=0)),
                        host_bytes=host)

    # -- swapped layout stages ----------------------------------------------------------------

    def swapped_stage_times(self, start: int, stop: int, num_micro: int) -> list[StageTimes]:
        """Units [start, stop) as the sub-models of a swapped layout stage
        (atomc.stages.swapped: the swap runtime's executor with activations recomputed
        and its checkpoints kept on the device) over `num_micro` micro-batches: each unit's
        forward and backward of them all (the backward repeats the forward, except in the
        model's last unit, whose graphs are kept between its forward and backward of each
        micro-batch), its weights loaded, its gradients offloaded; nothing streams back in for
        the backward, and the list has no update (the runner steps the optimizer after the
        step: `swapped_stage_optimizer_ns`)."""
        last = len(self.units) - 1
        out = []
        for i in range(start, stop):
            u, s = self.units[i], self.block_plan.submodels[i]
            fwd = round(u.fwd_ns * self.slowdown)
            bwd = round(u.bwd_ns * self.slowdown) + (fwd if i < last else 0)
            out.append(StageTimes(fwd_ns=num_micro * fwd, bwd_ns=num_micro * bwd,
                                  load_ns=ms_to_ns(s.load_ms), checkpoint_ns=0,
                                  offload_ns=ms_to_ns(s.offload_ms), optimizer_ns=0))
        return out

    def swapped_stage_memory_bytes(self, start: int, stop: int, num_micro: int) -> int:
        """Device bytes of a swapped layout stage over units [start, stop)
        (stagemem.swapped_stage_bytes, over the units as a plan)."""
        return swapped_stage_bytes(self.block_plan, start, stop, num_micro)

    def swapped_stage_host_bytes(self, start: int, stop: int, num_micro: int) -> int:
        """Host bytes of a swapped layout stage over units [start, stop): the swap runtime's
        store for those sub-models (fp32 masters, AdamW moments, transfer copies; the
        partitioner's formula, atomc.partition.hostmem)."""
        plan = dataclasses.replace(self.block_plan, accum=num_micro,
                                   submodels=self.block_plan.submodels[start:stop])
        return plan_host_memory(plan, self.profile.graph).total()

    def swapped_stage_optimizer_ns(self, fqns: set[str]) -> int:
        """A swapped stage's update over `fqns`: CPU AdamW over their fp32 masters as the
        partitioner costs it (partition.cost.optimizer_ns: the rate it takes, and the
        runtime's fixed and per-tensor costs the profile measured; 0 without updates)."""
        if self.no_update or not fqns:
            return 0
        g = self.profile.graph
        frozen = set(g.frozen or ())
        tensors = sum(1 for f in fqns if f in g.params and f not in frozen)
        p = CostParams(1, 0, self.profile.h2d_gbps, self.profile.d2h_gbps, self.cpu_adam[0],
                       "recompute", **runtime_params(self.profile))
        return int(optimizer_ns(p, self.master_bytes_of(fqns), tensors))


def block_cuts(profile: Profile) -> list[int]:
    """Node indices where the units start: each repeated block, and what follows the last."""
    g = profile.graph
    if not g.blocks:
        raise UsageError(
            f"{g.model_path}: the traced model has no repeated blocks, which pipeline and SWARM "
            f"stages are cut from; compare needs a model of repeated blocks (a transformer)")
    cuts = []
    prev = ""
    for i, n in enumerate(g.nodes):
        if n.block != prev and i > 0:
            cuts.append(i)
        prev = n.block
    last_input = max((i for i, n in enumerate(g.nodes) if n.op == "placeholder"), default=-1)
    return [c for c in cuts if c > last_input]


def hardware_model(name: str, profile: Profile, *, slowdown: float = 1.0,
                   no_update: bool = False, given: GivenPlan | None = None) -> HardwareModel:
    """The units of `profile`'s model (see the module docstring); `given`: the plan its
    peers train with, made from `profile`."""
    if not slowdown > 0:
        raise UsageError(f"--slowdown {slowdown:g} must be more than 0")
    cuts = block_cuts(profile)
    plan = plan_from_cuts(profile, cuts, accum=1)
    g = profile.graph
    units = []
    for s in plan.submodels:
        costs = profile.costs[s.start:s.stop]
        nodes = g.nodes[s.start:s.stop]
        units.append(Unit(
            start=s.start, stop=s.stop,
            fwd_ns=ms_to_ns(sum(c.fwd_ms for c in costs)),
            bwd_ns=ms_to_ns(sum(c.bwd_ms for c in costs)),
            param_bytes=s.param_bytes,
            params=frozenset(f for n in nodes for f in (*n.param_fqns, *n.buffer_fqns))))
    return HardwareModel(name=name, profile=profile, units=units, block_plan=plan,
                         slowdown=slowdown, no_update=no_update, given=given)


def placement_plan(ref: HardwareModel, micro: int):
    """The units as a plan for `atomc place`: its message sizes per step (M micro-batches) and
    its compute, backward without recomputation (resident stages)."""
    return plan_from_cuts(ref.profile, block_cuts(ref.profile), accum=max(micro, 1),
                          activations="keep")


def host_memory_line(device: str, need: int, have: int,
                     side: dict[str, int] | None = None) -> str:
    """Why a peer does not fit its host; `side`: what the peer keeps beside its swap trainer
    (atomc.distributed.outer.peer_host_bytes' kinds)."""
    beside = sum(side.values()) if side else 0
    what = ("fp32 masters, AdamW moments, transfer copies" if not beside else
            f"{format_bytes(need - beside)} for the swap trainer's masters, moments and "
            f"copies, {describe_host_bytes(side)} beside it")
    return (f"device {device}: a peer keeps the whole model on its host, "
            f"{format_bytes(need)} ({need} bytes: {what}), but its host has "
            f"{format_bytes(have)} ({have} bytes); give it more host memory, or leave peers "
            f"out (--modes)")


__all__ = ["GivenPlan", "HardwareModel", "PeerPlan", "Unit", "block_cuts", "hardware_model",
           "host_memory_line", "placement_plan"]
