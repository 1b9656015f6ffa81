"""Partition: Profile -> Plan (docs/design.md, section "Partition: Algorithm 1, exact"; ATOM
III-D and Algorithm 1).

`partition(profile, capacity_bytes, ...)` cuts the profiled graph into consecutive sub-models
that can be swapped through a GPU of `capacity_bytes` (less a reserve) while the next one
loads, chooses the accumulation degree C, and returns a Plan whose predicted step time and GPU
utilisation come from the swap simulator (atomc.simulate).

The decision is split as docs/design.md, section "Style" asks: tables.py (the C-independent
prefix tables of every node range), cost.py (one run's cost formulas: per-sub-model times and
bytes, the step's handover), constraints.py (each plan constraint's slack and message),
search.py (exact dynamic programme with block folding), caps.py (the searches under caps on
the largest sub-model), weigh.py (the plans weighed for C), advice.py (what a refusal
advises), build.py (cuts -> Plan, recost, hashes), accum.py (choice of C), check.py (an
independent checker), stagemem.py (a pipeline stage's device bytes over a plan).
"""

from __future__ import annotations

import dataclasses

from atomc.ir import OpGraph, Plan, Profile, SweepPoint
from atomc.partition.activations import choose_policy
from atomc.partition.advice import ADVICE_STEP, budget_advice, min_capacity_bytes
from atomc.partition.build import (
    build_plan,
    graph_hash,
    host_gap_ms,
    plan_step,
    profile_hash,
    recost,
    same_step,
)
from atomc.partition.caps import plan_tables
from atomc.partition.cost import ACTIVATIONS, DEFAULT_CPU_ADAM_GBPS
from atomc.partition.hostmem import HostBudget, check_plan_host, disk_times, plan_host_memory
from atomc.partition.precision import device_view, resolve_precision
from atomc.partition.weigh import weigh
from atomc.simulate import binding_lane
from atomc.units import NS_PER_MS, format_bytes, format_ms

__all__ = ["ADVICE_STEP", "DEFAULT_MAX_ACCUM", "DEFAULT_RESERVE_BYTES", "POLICIES",
           "budget_advice", "build_plan", "graph_hash", "host_gap_ms", "min_capacity_bytes",
           "partition", "plan_step", "plan_tables", "profile_hash", "recost", "sweep_point",
           "tokens_per_s", "with_disk"]

DEFAULT_RESERVE_BYTES = 1 << 30  # CUDA context, allocator fragmentation, the loss
DEFAULT_MAX_ACCUM = 64
# what `partition(activations=...)` takes: "auto" chooses per operator (partition.activations)
POLICIES = ("auto", *ACTIVATIONS)


def partition(profile: Profile, capacity_bytes: int, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
              accum: int | str | None = None, max_accum: int = DEFAULT_MAX_ACCUM,
              activations: str = "auto", fold_blocks: bool = True,
              cpu_adam_gbps: float = DEFAULT_CPU_ADAM_GBPS, transfer_dtype: str | None = None,
              autocast: str | None = None, cpu_adam_source: str = "given",
              max_global_batch: str | None = None, host: HostBudget | None = None) -> Plan:
    """The best plan for a GPU of `capacity_bytes`; InfeasiblePlanError when nothing fits.

    `transfer_dtype` is the dtype of the device copies of weights and gradients and `autocast`
    the compute dtype (atomc.partition.precision.resolve_precision gives the defaults).

    C (`accum`): given, or (None) the one that trains the most tokens a second
    (partition.throughput), from the smallest that has a plan meeting every constraint
    (accum.choose_accum: "min" stops there) up to `max_accum` and `max_global_batch` (samples,
    or tokens with a "tokens" suffix), among those whose host memory fits `host` (the plan
    states its bytes by kind; UsageError when no C fits). The runtime's two weight and two
    gradient slots are
    sized for the largest sub-model and held all step (atomc.runtime.slots), a bound no pair
    of neighbours sees: at each C the search runs with caps on the largest sub-model's
    parameters (every range within the cap, its working memory beside four slots of the cap),
    and the best plan over the caps is kept."""
    weighed = weigh(profile, capacity_bytes, reserve_bytes, accum, max_accum,
                    "recompute" if activations == "auto" else activations, fold_blocks,
                    cpu_adam_gbps, transfer_dtype, autocast, cpu_adam_source, max_global_batch)
    host = host or HostBudget()
    view = device_view(profile, resolve_precision(profile, transfer_dtype, autocast))

    def with_host(plan: Plan) -> Plan:
        memory = plan_host_memory(plan, profile.graph, host.optimizer_states, host.limit_bytes,
                                  host.source, clipping=host.clipping, disk=host.disk)
        return with_disk(dataclasses.replace(plan, host=memory), profile.graph)

    weighed = [(with_host(plan), searched) for plan, searched in weighed]
    if activations == "auto":  # cut for recomputation, then the policy (partition.activations)
        # the operators' outputs sent to the host take what the host has left
        weighed = [(with_host(choose_policy(
                        plan, profile, view=view,
                        host_room_bytes=(host.limit_bytes - plan.host.total()
                                         if host.limit_bytes else None))), searched)
                   for plan, searched in weighed]
    fitting = [w for w in weighed if not host.limit_bytes or w[0].host.total() <= host.limit_bytes]
    if not fitting:
        smallest = weighed[0][0]
        check_plan_host(smallest.host, frozen=smallest.host.frozen_params > 0)
    best = max(fitting, key=lambda w: (tokens_per_s(w[0]), -w[0].accum))[0]
    if len(weighed) == 1:
        return best
    sweep = tuple(sweep_point(plan, searched) for plan, searched in weighed)
    smallest = weighed[0][0]
    notes = best.notes
    if best.accum != smallest.accum:
        first = (f"the smallest C that meets every constraint is {smallest.accum} "
                 f"({tokens_per_s(smallest):,.0f})" if smallest.feasible else
                 f"no C weighed meets every constraint ({smallest.binding.split(':')[0]} binds "
                 f"from C={smallest.accum}, {tokens_per_s(smallest):,.0f})")
        notes = (*notes, (f"C={best.accum} trains the most tokens a second "
                         f"({tokens_per_s(best):,.0f}); {first}"))
    return same_step(dataclasses.replace(best, sweep=sweep, notes=notes), best)


def with_disk(plan: Plan, graph: OpGraph) -> Plan:
    """`plan` (its host memory planned) with the disk tier's traffic in its steps: each
    sub-model's states on disk read before its update and written after it, its image read
    before its loads. That traffic must hide under the compute it overlaps, as the loads must:
    where it does not, the plan says by how much the step grows; where the drives lack the
    space, that binds."""
    host = plan.host
    if host is None or host.disk is None or not host.disk_kinds:
        return plan
    timed = disk_times(plan, graph, host)
    sim = plan_step(timed)
    step_ms = sim.step_ns / NS_PER_MS
    disk = host.disk
    binding, feasible = plan.binding, plan.feasible
    room = disk.drives * disk.capacity_bytes
    if room and host.disk_need_bytes > room:
        feasible = False
        binding = (f"disk capacity: the states need {format_bytes(host.disk_need_bytes)} on the "
                   f"drives ({format_bytes(sum(host.disk_by_kind.values()))} of states, one "
                   f"record written beside them and a checkpoint's set), {disk.drives} drive(s) "
                   f"have {format_bytes(room)}")
    elif step_ms > plan.predicted_step_ms * (1 + 1e-9) + 1e-6:
        feasible = False
        moved = sum(s.disk_read_ms + s.disk_write_ms + 2 * s.image_read_ms
                    for s in timed.submodels)
        binding = binding or (
            f"disk: the states' traffic ({format_ms(moved)} a step on {disk.drives} drive(s)) "
            f"outlasts the compute it overlaps: the step grows by "
            f"{format_ms(step_ms - plan.predicted_step_ms)}")
    out = dataclasses.replace(timed, predicted_step_ms=step_ms,
                              predicted_utilisation=sim.utilisation, feasible=feasible,
                              binding=binding)
    return same_step(out, timed)


def tokens_per_s(plan: Plan) -> float:
    """A plan's predicted tokens a second (samples where the model takes no token ids)."""
    return plan.tokens_per_step / (plan.predicted_step_ms / 1e3) if plan.predicted_step_ms else 0.0


def sweep_point(plan: Plan, searched: bool) -> SweepPoint:
    """What `atomc show --sweep` prints of a plan weighed for C."""
    sim = plan_step(plan)
    host = plan.host
    over = host is not None and host.limit_bytes and host.total() > host.limit_bytes
    return SweepPoint(accum=plan.accum, step_ms=plan.predicted_step_ms,
                      tokens_per_s=tokens_per_s(plan), gpu_busy=plan.predicted_utilisation,
                      binding=("host memory" if over else binding_lane(sim.timeline)),
                      feasible=plan.feasible and not over, searched=searched,
                      host_bytes=host.total() if host is not None else 0)
