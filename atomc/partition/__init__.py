"""Partition: Profile -> Plan (docs/design.md, section "Partition: Algorithm 1, exact"; ATOM
III-D and Algorithm 1).

`partition(profile, capacity_bytes, ...)` cuts the profiled graph into consecutive sub-models
that can be swapped through a GPU of `capacity_bytes` (less a reserve) while the next one
loads, chooses the accumulation degree C, and returns a Plan whose predicted step time and GPU
utilisation come from the swap simulator (atomc.simulate).

The decision is split as docs/design.md, section "Style" asks: tables.py (the C-independent
prefix tables of every node range), cost.py (one run's cost formulas: per-sub-model times and
bytes, the step's handover), constraints.py (each plan constraint's slack and message),
search.py (exact dynamic programme with block folding), accum.py (choice of C), check.py (an
independent checker).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from atomc import __version__
from atomc.errors import InfeasiblePlanError, UsageError
from atomc.ir import SCHEMA_VERSION, CutTensor, OpGraph, Plan, Profile, Submodel, SweepPoint
from atomc.jsonio import canonical_hash
from atomc.partition.accum import (
    Outcome,
    choose_accum,
    physical_bound_accum,
    takes_tokens,
    tokens_per_microbatch,
)
from atomc.partition.activations import apply_policy, choose_policy
from atomc.partition.constraints import (
    BACKWARD_OVERLAP,
    FORWARD_OVERLAP,
    GRADIENT_OFFLOAD,
    MEMORY,
    OPTIMIZER,
    plan_slacks,
)
from atomc.partition.cost import (
    ACTIVATIONS,
    DEFAULT_CPU_ADAM_GBPS,
    CostParams,
    CostTables,
    RangeCost,
    derive,
    first_tail,
    plan_costs,
    range_cost,
    range_stage_times,
    runtime_params,
    slot_fits,
    with_slot_cap,
)
from atomc.partition.hostmem import HostBudget, check_plan_host, disk_times, plan_host_memory
from atomc.partition.memo import once_per_object
from atomc.partition.precision import Precision, device_view, model_dtype, resolve_precision
from atomc.partition.search import (
    Folding,
    SearchResult,
    block_period,
    prepare_folding,
    search,
)
from atomc.partition.tables import (
    NodeFacts,
    RangeTables,
    allowed_cuts,
    build_tables,
    live_sets,
    max_width_for,
    node_facts,
)
from atomc.partition.throughput import Candidate, parse_global_batch, sweep_accum
from atomc.simulate import binding_lane, simulate_plan
from atomc.simulate.events import copies_on_host, simulate_swap
from atomc.units import NS_PER_MS, format_bytes, format_ms

__all__ = ["DEFAULT_MAX_ACCUM", "DEFAULT_RESERVE_BYTES", "POLICIES", "build_plan", "partition",
           "recost"]

DEFAULT_RESERVE_BYTES = 1 << 30  # CUDA context, allocator fragmentation, the loss
DEFAULT_MAX_ACCUM = 64
# a plan whose GPU computes this share of its step is not searched again at a larger C
BUSY_ENOUGH = 0.9
# what `partition(activations=...)` takes: "auto" chooses per operator (partition.activations)
POLICIES = ("auto", *ACTIVATIONS)
_MIB = 1 << 20
# caps on the largest sub-model tried at one C: each at most this fraction of the one before
# (snapped down to a range's size), then the smallest that can hold the largest operator
_CAP_STEP = 0.85


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
    weighed = _weigh(profile, capacity_bytes, reserve_bytes, accum, max_accum,
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
    return dataclasses.replace(best, sweep=sweep, notes=notes)


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
    sim = simulate_plan(timed)
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
    return dataclasses.replace(timed, predicted_step_ms=step_ms,
                               predicted_utilisation=sim.utilisation, feasible=feasible,
                               binding=binding)


def tokens_per_s(plan: Plan) -> float:
    """A plan's predicted tokens a second (samples where the model takes no token ids)."""
    return plan.tokens_per_step / (plan.predicted_step_ms / 1e3) if plan.predicted_step_ms else 0.0


def sweep_point(plan: Plan, searched: bool) -> SweepPoint:
    """What `atomc show --sweep` prints of a plan weighed for C."""
    sim = simulate_plan(plan)
    host = plan.host
    over = host is not None and host.limit_bytes and host.total() > host.limit_bytes
    return SweepPoint(accum=plan.accum, step_ms=plan.predicted_step_ms,
                      tokens_per_s=tokens_per_s(plan), gpu_busy=plan.predicted_utilisation,
                      binding=("host memory" if over else binding_lane(sim.timeline)),
                      feasible=plan.feasible and not over, searched=searched,
                      host_bytes=host.total() if host is not None else 0)


def _weigh(profile: Profile, capacity_bytes: int, reserve_bytes: int, accum: int | str | None,
           max_accum: int, activations: str, fold_blocks: bool, cpu_adam_gbps: float,
           transfer_dtype: str | None, autocast: str | None, cpu_adam_source: str,
           max_global_batch: str | None) -> list[tuple[Plan, bool]]:
    """The plans weighed for C, by C (the smallest feasible one first), each with whether its
    own search found it (else: another C's cuts costed at its C); one plan when C is given
    or the smallest feasible one is asked for ("min")."""
    smallest = accum == "min"
    if isinstance(accum, str):
        if not smallest:
            raise UsageError(f"--accum {accum!r}: give a number C, or min (the smallest C that "
                             f"meets every constraint; default: the C of the most tokens a "
                             f"second)")
        accum = None
    if activations not in ACTIVATIONS:
        raise UsageError(f"activations {activations!r}: expected one of auto, "
                         f"{', '.join(ACTIVATIONS)}")
    if accum is not None and accum < 1:
        raise UsageError(f"--accum {accum} must be 1 or more")
    if max_accum < 1:
        raise UsageError(f"--max-accum {max_accum} must be 1 or more")
    usable = capacity_bytes - reserve_bytes
    if usable <= 0:
        raise UsageError(
            f"GPU memory {format_bytes(capacity_bytes)} leaves nothing after the reserve of "
            f"{format_bytes(reserve_bytes)}; give a larger --gpu-mem or a smaller --reserve")
    precision = resolve_precision(profile, transfer_dtype, autocast)
    view = device_view(profile, precision)
    facts = node_facts(view)

    def params_for(c: int) -> CostParams:
        return CostParams(c, usable, profile.h2d_gbps, profile.d2h_gbps, cpu_adam_gbps,
                          activations, **runtime_params(profile))

    _check_operators_fit(view, facts, build_tables(facts, 1), params_for, accum or 1,
                         reserve_bytes, fold_blocks, max_accum if accum is None else accum,
                         fixed=accum is not None)
    tables = plan_tables(facts, usable, activations)
    folding = _folding(view, tables, fold_blocks and activations != "keep")

    def run(c: int) -> Outcome:
        # Whether C is feasible needs one plan under one cap; the best over the caps is only
        # wanted at the C kept
        p = params_for(c)
        d = derive(tables, p)
        done: dict = {}  # searches by (tier, cap), shared by the questions asked of this C

        def best(tier: int, score):
            found = _over_caps(tables, p, d, folding, tier, score, cache=done)
            return found, (0.0 if found is None else _utilisation(tables, p, found))

        if _over_caps(tables, p, d, folding, 0, first=True, cache=done) is not None:
            return Outcome(c, True, relax=lambda: best(0, lambda r: r.objective))
        # memory alone decides whether a larger C can still help; tier 2 also gives a plan
        # (its step an estimate: the simulator's step decides between the caps)
        return Outcome(c, False, relax=lambda: best(2, lambda r: _simulated(tables, p, r)),
                       fits=lambda: _over_caps(tables, p, d, folding, 2, first=True,
                                               cache=done) is not None)

    choice = choose_accum(run, max_accum, fixed=accum)
    if choice.outcome is None:
        c = accum or 1
        need = min_capacity_bytes(facts, params_for(c), reserve_bytes, view)
        raise InfeasiblePlanError(
            f"no partition fits {format_bytes(capacity_bytes)} "
            f"(reserve {format_bytes(reserve_bytes)}) at C={c}: every operator fits alone, but "
            f"no cut leaves room for the runtime's two weight and two gradient slots (each the "
            f"size of the largest sub-model) beside every sub-model's working memory and the "
            f"sub-model loading next; "
            + budget_advice(view, facts, params_for, reserve_bytes, need, activations,
                            fold_blocks, max_accum if accum is None else accum,
                            fixed=accum is not None))
    o = choice.outcome
    result: SearchResult = o.result  # type: ignore[assignment]
    p = params_for(o.accum)
    if not o.feasible:
        # at the C kept, loads-only stalls (tier 1, exact) may simulate faster than tier 2's plan,
        # which only an estimate guides: keep whichever the simulator prefers
        d = derive(tables, p)
        tier1 = search(tables, p, 1, folding,
                       with_slot_cap(d, _largest_params(tables, p, result), usable))
        if tier1 is not None and _utilisation(tables, p, tier1) >= o.utilisation:
            result = tier1
    notes = [f"accumulation degrees tried: {', '.join(str(c) for c in sorted(choice.tried))}"]
    cuts, early, tier = result.cuts, result.early_prefetch, result.tier
    tokens = tokens_per_microbatch(view)
    if accum is None and not smallest:
        stop = max_accum
        bound = parse_global_batch(max_global_batch, view.graph.batch_size, tokens,
                                   takes_tokens(view))
        if bound is not None:
            stop = min(stop, bound)
            if o.accum > bound:
                raise UsageError(
                    f"--max-global-batch {max_global_batch} allows C <= {bound}, but the "
                    f"smallest C whose plan meets every constraint is {o.accum}; raise "
                    f"--max-global-batch or give --gpu-mem more")
        candidates = sweep_accum(
            _candidate(tables, profile, p, result.cuts, result.early_prefetch, result.tier,
                       result), lambda c, base: _at(tables, profile, params_for(c), base, folding),
            lambda c: _best_at(tables, profile, params_for(c), run(c)), stop, tokens)
    else:
        candidates = [_candidate(tables, profile, p, cuts, early, tier, result)]

    def plan_of(cand: Candidate) -> Plan:
        pc = params_for(cand.accum)
        found = cand.result if cand.result is not None else result
        largest = max(c.param_bytes for c in plan_costs(tables, pc, list(cand.cuts)))
        own = list(notes)
        if found.folded_positions:
            own.append(f"repeated blocks folded {found.folded_positions} of "
                       f"{facts.num_nodes - 1} cut positions")
        each = "one" if not cand.cuts else "two"
        own.append(f"the runtime's {each} weight and {each} gradient slots, each the size of "
                   f"the largest sub-model ({format_bytes(largest)}): "
                   f"{format_bytes(min(2, len(cand.cuts) + 1) * 2 * largest)} of "
                   f"{format_bytes(usable)}")
        own.extend(precision.notes)
        plan = build_plan(profile, tables, pc, cand.cuts,
                          capacity_bytes=capacity_bytes, reserve_bytes=reserve_bytes,
                          accum_fixed=accum is not None, tier=cand.tier, notes=own,
                          early_prefetch=cand.early_prefetch, precision=precision, view=view,
                          cpu_adam_source=cpu_adam_source)
        return dataclasses.replace(plan, tokens_per_step=pc.accum * tokens)

    return [(plan_of(cand), cand.searched) for cand in candidates]


def _simulated_cuts(tables: RangeTables, profile: Profile, p: CostParams, cuts,
                    early_prefetch: bool):
    """(costs, simulation) of a plan with these cuts at `p`, as build_plan simulates it."""
    costs = plan_costs(tables, p, list(cuts))
    sim = simulate_swap(range_stage_times(costs), p.accum,
                        early_prefetch=early_prefetch and len(costs) > 1,
                        host_copies=copies_on_host(profile.device),
                        host_gap_ns=round(host_gap_ms(profile) * NS_PER_MS), record=True)
    return costs, sim


def _candidate(tables: RangeTables, profile: Profile, p: CostParams, cuts, early_prefetch: bool,
               tier: int, result: SearchResult | None) -> Candidate:
    costs, sim = _simulated_cuts(tables, profile, p, cuts, early_prefetch)
    feasible = all(s.slack >= 0 for s in plan_slacks(costs, p.usable_bytes, early_prefetch))
    return Candidate(p.accum, tuple(cuts), early_prefetch, sim, feasible, result is not None,
                     tier=tier if result is not None else (0 if feasible else 1), result=result)


def _at(tables: RangeTables, profile: Profile, p: CostParams, base: Candidate,
        folding: Folding | None) -> Candidate | None:
    """A plan at `p`'s C: `base`'s cuts costed again where their memory still fits, else the
    first plan a search finds (every constraint, else memory alone); None when none fits."""
    costs = plan_costs(tables, p, list(base.cuts))
    slacks = plan_slacks(costs, p.usable_bytes, base.early_prefetch)
    if all(s.slack >= 0 for s in slacks if s.constraint == MEMORY):
        again = _candidate(tables, profile, p, base.cuts, base.early_prefetch, 0, None)
        if again.sim.utilisation >= BUSY_ENOUGH:
            return again
        # cuts made for a smaller C where the GPU waited (a CPU update or the links bound
        # it) need not suit this C: a search here may find cuts of more tokens a second
        found = _over_caps(tables, p, derive(tables, p), folding, 0, first=True)
        if found is None:
            return again
        searched = _candidate(tables, profile, p, found.cuts, found.early_prefetch,
                              found.tier, found)
        return min((again, searched), key=lambda c: (not c.feasible, c.sim.step_ns))
    d = derive(tables, p)
    for tier in (0, 2):
        found = _over_caps(tables, p, d, folding, tier, first=True)
        if found is not None:
            return _candidate(tables, profile, p, found.cuts, found.early_prefetch, found.tier,
                              found)
    return None


def _best_at(tables: RangeTables, profile: Profile, p: CostParams,
             outcome: Outcome) -> Candidate | None:
    found = outcome.result
    if found is None:
        return None
    return _candidate(tables, profile, p, found.cuts, found.early_prefetch, found.tier, found)


def plan_tables(facts: NodeFacts, usable_bytes: int, activations: str = "recompute"
                ) -> RangeTables:
    """Range tables wide enough for every sub-model a plan within `usable_bytes` can hold.

    With two sub-models or more, the runtime's four slots of the largest sub-model fit in the
    budget, so no sub-model's parameters and gradients (at most twice its parameters) exceed
    half of it. Only a plan of one sub-model (one weight and one gradient slot) can be wider:
    the whole graph, whose memory no C changes but kept activations' (C = 1 is the least).
    The search's work grows with the square of the width."""
    n = facts.num_nodes
    if max_width_for(facts, usable_bytes) >= n:
        tables = build_tables(facts, n)
        whole = range_cost(tables, CostParams(1, usable_bytes, 1.0, 1.0, 0.0, activations), 0, n)
        work = max(whole.mem_fwd_bytes - whole.param_bytes,
                   whole.mem_bwd_bytes - whole.param_bytes - whole.grad_bytes)
        if 2 * whole.param_bytes + work <= usable_bytes:
            return tables
    return build_tables(facts, max_width_for(facts, usable_bytes // 2))


def _folding(view: Profile, tables: RangeTables, fold: bool) -> Folding | None:
    """Where the tables repeat, when the graph's blocks do. Kept activations make a range's
    memory depend on where it starts (no two starts repeat): the caller does not fold then."""
    if not fold:
        return None
    g = view.graph
    # a node without compute (a parameter read, an input) has its name in its signature, so
    # that it is never measured as another; blocks whose parameters are read inside them
    # (torch.export's graphs) are alike when those reads are alike in kind and shape. Alike
    # blocks only propose a period: the search folds where the costs themselves repeat
    alike = tuple(f"{n.op}:{n.outputs}" if n.op in ("placeholder", "get_attr", "output")
                  else n.signature for n in g.nodes)
    return prepare_folding(tables, block_period(
        tables, g.blocks, tuple(n.block for n in g.nodes), alike))


def _over_caps(tables: RangeTables, p: CostParams, d: CostTables, folding: Folding | None,
               tier: int, score=None, first: bool = False,
               cache: dict | None = None) -> SearchResult | None:
    """The best plan of `tier` by `score` over caps on the largest sub-model's parameters (or,
    with `first`, the first plan found).

    Every cap worth trying is the size of a range that fits beside its own slots
    (cost.slot_fits), at least the largest single operator's. They are tried from the largest
    down, each at most _CAP_STEP of the one before (snapped down to a range's size); a plan
    found jumps the descent to below its own largest sub-model (every cap between gives it
    again). Smaller caps mean more sub-models, more cuts and more recomputation, so once a
    plan is found the descent stops at the first cap that does no better. Searches at one C
    share `d` (a cap only narrows its ranges) and `cache`, by tier and cap."""
    fits = slot_fits(d, p.usable_bytes)
    floor = int(tables.param_bytes[:, 1].max()) if tables.max_width >= 1 else 0
    sizes = np.unique(d.param_bytes[fits])
    sizes = sizes[sizes >= floor]
    if not len(sizes):
        return None

    cache = {} if cache is None else cache

    def attempt(cap: int):
        if (tier, cap) not in cache:
            cache[tier, cap] = search(tables, p, tier, folding,
                                      with_slot_cap(d, cap, p.usable_bytes))
        return cache[tier, cap]

    if first and tier == 2:
        # whether memory allows any plan: the smallest cap leaves the most working memory and
        # the narrowest ranges (the cheapest search) first
        return next((r for cap in _descending(sizes)[::-1] if (r := attempt(cap))), None)
    best = None
    cap = int(sizes[-1])
    while True:
        r = attempt(cap)
        if r is not None and first:
            return r
        if r is not None and (best is None or score(r) < best[0]):
            best = (score(r), r)
            cap = min(cap, _largest_params(tables, p, r))
        elif best is not None:
            break
        below = sizes[sizes <= int(cap * _CAP_STEP)]
        nxt = int(below[-1]) if len(below) else int(sizes[0])
        if nxt >= cap:
            break
        cap = nxt
    return None if best is None else best[1]


def _descending(sizes: np.ndarray) -> list[int]:
    """Caps from the largest size down, each at most _CAP_STEP of the one before, and the
    smallest size last."""
    out = [int(sizes[-1])]
    while out[-1] > sizes[0]:
        below = sizes[sizes <= int(out[-1] * _CAP_STEP)]
        out.append(int(below[-1]) if len(below) else int(sizes[0]))
    return out


def _simulated(tables: RangeTables, p: CostParams, result: SearchResult) -> tuple[int, int, int]:
    """A relaxed plan's score: its simulated step (the search's sum is an estimate there)."""
    costs = plan_costs(tables, p, result.cuts)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=result.early_prefetch,
                        record=False)
    return (sim.step_ns, result.cut_bytes, result.num_submodels)


def _largest_params(tables: RangeTables, p: CostParams, result: SearchResult) -> int:
    return max(c.param_bytes for c in plan_costs(tables, p, list(result.cuts)))


def recost(profile: Profile, plan: Plan, cpu_adam_gbps: float | None = None,
           cpu_adam_source: str | None = None) -> Plan:
    """`plan`'s decisions (cuts, C, activations, the step-boundary handover, dtypes, budget)
    costed and simulated on another profile of the same graph (a calibrated one): what the plan
    takes there. The CPU update rate is the plan's unless given."""
    if graph_hash(profile.graph) != plan.graph_hash:
        raise UsageError(
            f"the plan was made for graph {plan.graph_hash}, the profile is of graph "
            f"{graph_hash(profile.graph)}; give a profile of the model the plan cuts")
    n = len(profile.graph.nodes)
    bounds = [s.start for s in plan.submodels] + [plan.submodels[-1].stop]
    if bounds[0] != 0 or bounds[-1] != n or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise UsageError(f"the plan's node ranges do not cover the profile's {n} nodes in order; "
                         f"give the profile the plan was made from")
    precision = Precision(plan.transfer_dtype or model_dtype(profile.graph), plan.autocast)
    view = device_view(profile, precision)
    facts = node_facts(view)
    tables = build_tables(facts, max(b - a for a, b in itertools.pairwise(bounds)))
    rate = plan.cpu_adam_gbps if cpu_adam_gbps is None else cpu_adam_gbps
    auto = plan.activations == "auto"
    p = CostParams(plan.accum, plan.capacity_bytes - plan.reserve_bytes, profile.h2d_gbps,
                   profile.d2h_gbps, rate, "recompute" if auto else plan.activations,
                   **runtime_params(profile))
    out = build_plan(profile, tables, p, bounds[1:-1], capacity_bytes=plan.capacity_bytes,
                     reserve_bytes=plan.reserve_bytes, accum_fixed=plan.accum_fixed,
                     tier=plan.search_tier, notes=[f"the cuts of plan {plan.content_hash()}"],
                     early_prefetch=plan.early_prefetch, precision=precision, view=view,
                     cpu_adam_source=cpu_adam_source or plan.cpu_adam_source or "given")
    return apply_policy(out, profile, plan) if auto else out


def host_gap_ms(profile: Profile) -> float:
    """On a CPU device, the runtime thread's own time before each action: calibrated when
    the profile is, else measured with the profile (0: neither)."""
    if not copies_on_host(profile.device):
        return 0.0
    if profile.calibration is not None:
        return profile.calibration.host_gap_ms
    return profile.runtime.action_ms if profile.runtime is not None else 0.0


def _utilisation(tables: RangeTables, p: CostParams, result: SearchResult) -> float:
    """The share of the simulated step that computes the model, the score plans are chosen by.
    The runtime's own time per call keeps the compute lane busy and trains nothing: counted
    as compute, it made a plan of more, smaller sub-models look busier, and on a CPU the
    slot-cap choice took 18 sub-models whose step was 4% longer than 14's and 9-25% longer than
    the 3-12 it takes now."""
    costs = plan_costs(tables, p, result.cuts)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=result.early_prefetch,
                        record=False)
    own = len(costs) * p.accum * (p.call_fwd_ns + p.call_bwd_ns)
    return (sim.compute_ns - own) / sim.step_ns if sim.step_ns else 0.0




def _check_operators_fit(profile: Profile, facts: NodeFacts, tables: RangeTables, params_for,
                         accum: int, reserve_bytes: int, fold_blocks: bool, max_accum: int,
                         fixed: bool) -> None:
    """Every operator must fit alone (docs/partitioning.md, section "The constraints") at C =
    `accum`; else name the largest and a budget that works (budget_advice)."""
    p = params_for(accum)
    d = derive(tables, p)
    alone = np.maximum(d.mem_fwd_bytes[:, 1], d.mem_bwd_bytes[:, 1])  # ranges of one node
    j = int(np.argmax(alone))
    need = int(alone[j])
    if need <= p.usable_bytes:
        return
    c = range_cost(tables, p, j, j + 1)
    node = profile.graph.nodes[j]
    where = f" ({node.module_fqn})" if node.module_fqn else ""
    kept = ""
    if p.activations == "keep":
        kept_bytes = p.accum * int(tables.saved_prefix[j + 1])
        kept = (f"; with --activations keep, {format_bytes(kept_bytes)} of it is the saved "
                f"activations of C={p.accum} micro-batches of this operator and every one "
                f"before it, which stay on the GPU until their backward: --activations "
                f"recompute needs far less")
    raise InfeasiblePlanError(
        f"operator '{node.name}'{where} alone needs {format_bytes(need)} at C={p.accum} "
        f"(parameters {format_bytes(c.param_bytes)}, gradients {format_bytes(c.grad_bytes)}, "
        f"working memory {format_bytes(need - c.param_bytes - c.grad_bytes)}), but the GPU leaves "
        f"{format_bytes(p.usable_bytes)} after the reserve of {format_bytes(reserve_bytes)}; "
        + budget_advice(profile, facts, params_for, reserve_bytes,
                        min_capacity_bytes(facts, p, reserve_bytes, profile), p.activations,
                        fold_blocks, max_accum, fixed=fixed)
        + kept)


ADVICE_STEP = 64 * _MIB  # how finely the budget a refusal advises is searched
ADVICE_REACH = 8  # how far above memory's own minimum it is searched (a factor)


def budget_advice(view: Profile, facts: NodeFacts, params_for, reserve_bytes: int,
                  memory_bytes: int, activations: str, fold_blocks: bool, max_accum: int,
                  fixed: bool = False) -> str:
    """What a refusal advises: the smallest --gpu-mem (to ADVICE_STEP) from `memory_bytes`
    (where memory alone first fits) at which some C up to `max_accum` (`fixed`: that C) has
    a plan meeting every constraint: memory, the links, the CPU update. Feasibility grows
    with the budget: stepped up from memory's minimum by a quarter at a time, then bisected."""

    def feasible(capacity: int) -> bool:
        usable = capacity - reserve_bytes
        tables = plan_tables(facts, usable, activations)
        folding = _folding(view, tables, fold_blocks and activations != "keep")

        def run(c: int) -> Outcome:
            p = dataclasses.replace(params_for(c), usable_bytes=usable)
            d = derive(tables, p)
            ok = _over_caps(tables, p, d, folding, 0, first=True) is not None
            return Outcome(c, ok, fits=lambda: _over_caps(tables, p, d, folding, 2,
                                                           first=True) is not None)

        o = choose_accum(run, max_accum, fixed=max_accum if fixed else None).outcome
        return o is not None and o.feasible

    def flag(n: int) -> str:
        return f"{format_bytes(n)} (--gpu-mem {n // _MIB}MiB)"

    if feasible(memory_bytes):
        return f"the smallest budget that works is {flag(memory_bytes)}"
    lo, hi = memory_bytes, None
    while hi is None and lo < ADVICE_REACH * memory_bytes:
        step = -(-(lo // 4) // ADVICE_STEP) * ADVICE_STEP
        if feasible(lo + step):
            hi = lo + step
        else:
            lo += step
    at = f"C={max_accum}" if fixed else f"any C up to {max_accum}"
    if hi is None:
        return (f"memory fits from {flag(memory_bytes)}, but up to {format_bytes(lo)} no plan "
                f"at {at} meets the links' and the CPU update's constraints too; partition "
                f"at {memory_bytes // _MIB}MiB to see which binds")
    while hi - lo > ADVICE_STEP:
        mid = lo + (hi - lo) // 2 // ADVICE_STEP * ADVICE_STEP
        if mid <= lo:
            break
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return (f"the smallest budget that works is {flag(hi)}, where a plan meets every "
            f"constraint (memory alone fits from {format_bytes(memory_bytes)}; below "
            f"{format_bytes(hi)} the links or the CPU update bind at {at})")


def min_capacity_bytes(facts: NodeFacts, p: CostParams, reserve_bytes: int,
                       view: Profile | None = None) -> int:
    """Smallest --gpu-mem (to 1 MiB, reserve included) for which some plan meets memory at p.accum,
    the runtime's slots counted.

    Bisection on the memory-only search: feasibility only grows with capacity. The plan that
    cuts at every allowed position meets memory at its own largest requirement, so that is an
    upper end that works. `view` (the profile as the device holds it) lets the search fold
    repeated blocks.
    """
    n = facts.num_nodes
    allowed = allowed_cuts(facts)
    cuts = [q for q in range(1, n) if allowed[q]]
    bounds = [0, *cuts, n]
    wide = build_tables(facts, max(b - a for a, b in itertools.pairwise(bounds)))
    hi = max(-s.slack for s in plan_slacks(plan_costs(wide, CostParams(
        p.accum, 0, p.h2d_gbps, p.d2h_gbps, p.cpu_adam_gbps, p.activations), cuts), 0)
        if s.constraint == MEMORY)
    lo = 0
    tables = plan_tables(facts, hi, p.activations)
    folding = _folding(view, tables, p.activations != "keep") if view is not None else None
    while hi - lo > _MIB:
        mid = (lo + hi) // 2
        q = CostParams(p.accum, mid, p.h2d_gbps, p.d2h_gbps, p.cpu_adam_gbps, p.activations)
        if _over_caps(tables, q, derive(tables, q), folding, 2, first=True) is not None:
            hi = mid
        else:
            lo = mid
    return -(-(hi + reserve_bytes) // _MIB) * _MIB


def _cut_tensor(profile: Profile, j: int) -> CutTensor:
    """A value crossing a cut, named by its node. Non-tensor values (sizes) have dtype "" and no
    bytes; a node with several tensor outputs crosses as one value of dtype "tuple"."""
    node = profile.graph.nodes[j]
    outs = node.outputs
    if len(outs) == 1:
        return CutTensor(node.name, outs[0].shape, outs[0].dtype, outs[0].num_bytes)
    if not outs:
        return CutTensor(node.name, (), "", 0)
    return CutTensor(node.name, (), "tuple", sum(o.num_bytes for o in outs))


def build_plan(profile: Profile, tables: RangeTables, p: CostParams, cuts,
               capacity_bytes: int, reserve_bytes: int, accum_fixed: bool = False,
               tier: int = 0, notes: list[str] | None = None,
               early_prefetch: bool = False, precision: Precision | None = None,
               view: Profile | None = None, cpu_adam_source: str = "given") -> Plan:
    """A Plan for given cut positions: costs, slacks, cut tensors and the simulated step.

    Costs come from the range tables, built from `view` (the profile as the device holds it
    at `precision`; the profile itself when None). atomc.codegen.manual.plan_from_cuts builds
    a Plan for hand-chosen cuts without them."""
    facts = tables.facts
    view = view or profile
    graph = view.graph
    costs: list[RangeCost] = plan_costs(tables, p, list(cuts))
    early_prefetch = early_prefetch and len(costs) > 1
    # on a CPU the runtime's thread copies too, and spends time of its own between actions
    # (measured with the profile, or by a calibration): the plan predicts that (the search
    # times copies hidden, as on a GPU; on the CPU they are a few percent of a step)
    host = copies_on_host(profile.device)
    gap_ms = host_gap_ms(profile)
    sim = simulate_swap(range_stage_times(costs), p.accum, early_prefetch=early_prefetch,
                        host_copies=host, host_gap_ns=round(gap_ms * NS_PER_MS))
    slacks = plan_slacks(costs, p.usable_bytes, early_prefetch)
    k = len(costs)
    index = graph.node_index()
    worst: dict[tuple[int, str], int] = {}  # smallest slack of each (sub-model, constraint)
    for s in slacks:
        key = (s.submodel, s.constraint)
        worst[key] = min(worst.get(key, s.slack), s.slack)
    crossing = live_sets(facts, [c.stop for c in costs[:-1]])
    submodels = []
    for i, c in enumerate(costs):
        mem = worst[(i, MEMORY)]
        nxt = costs[i + 1] if i + 1 < k else None
        inputs = sorted({index[src] for n in graph.nodes[c.start:c.stop] for src in n.inputs
                         if index[src] < c.start}
                        | {j for j in range(c.start, c.stop) if facts.ops[j] == "placeholder"})
        outputs = [j for j in range(c.start, c.stop) if facts.last_use[j] >= c.stop]
        if nxt is None and facts.output_index >= 0:
            out_node = graph.nodes[facts.output_index]
            outputs = [index[name] for name in out_node.inputs]
        layers = tuple(dict.fromkeys(n.module_fqn for n in graph.nodes[c.start:c.stop]
                                     if n.module_fqn))
        submodels.append(Submodel(
            index=i, start=c.start, stop=c.stop,
            first_node=graph.nodes[c.start].name, last_node=graph.nodes[c.stop - 1].name,
            layers=layers, param_bytes=c.param_bytes,
            peak_bytes=max(c.mem_fwd_bytes, c.mem_bwd_bytes),
            fwd_ms=c.fwd_ns / NS_PER_MS, bwd_ms=c.bwd_ns / NS_PER_MS,
            load_ms=c.load_fwd_ns / NS_PER_MS, offload_ms=c.offload_ns / NS_PER_MS,
            slack_memory_bytes=mem,
            slack_fwd_ms=worst.get((i, FORWARD_OVERLAP), c.accum_fwd_ns) / NS_PER_MS,
            slack_bwd_ms=min(worst.get((i, BACKWARD_OVERLAP), c.accum_bwd_ns - c.checkpoint_ns),
                             worst.get((i, GRADIENT_OFFLOAD), c.accum_bwd_ns)) / NS_PER_MS,
            inputs=tuple(_cut_tensor(view, j) for j in inputs),
            outputs=tuple(_cut_tensor(view, j) for j in outputs),
            checkpoint_ms=c.checkpoint_ns / NS_PER_MS, optimizer_ms=c.optimizer_ns / NS_PER_MS,
            # sub-model 0's is no constraint (the step boundary prices it), but the same sum
            slack_optimizer_ms=worst.get((i, OPTIMIZER), c.accum_bwd_ns + c.offload_ns - (
                nxt.offload_ns + nxt.optimizer_ns if nxt else 0)) / NS_PER_MS,
            crossing=tuple(_cut_tensor(view, j) for j in crossing[i]) if nxt else (),
        ))
    violated = [s for s in slacks if s.slack < 0]
    binding = ""
    if violated:
        # the worst time deficit binds (memory always holds in a returned plan)
        worst = min(violated, key=lambda s: (s.constraint == MEMORY, s.slack))
        binding = (f"sub-model {worst.submodel}: {worst.constraint} short by "
                   f"{-worst.slack / NS_PER_MS:.1f} ms ({worst.detail})"
                   if worst.constraint != MEMORY else
                   f"sub-model {worst.submodel}: memory short by {format_bytes(-worst.slack)} "
                   f"({worst.detail})")
    bound = physical_bound_accum(view)
    all_notes = list(notes or [])
    if k > 1:
        tail, _ = first_tail(costs)
        first, second = costs[0], costs[1]
        own = first.offload_ns + first.optimizer_ns
        if tail > own:
            all_notes.append(
                f"step boundary: sub-model 0's update waits {(tail - own) / NS_PER_MS:.1f} ms "
                f"for sub-model 1's (its offload + CPU update "
                f"{(second.offload_ns + second.optimizer_ns) / NS_PER_MS:.1f} ms vs sub-model "
                f"0's C*t_bwd + offload {(first.accum_bwd_ns + first.offload_ns) / NS_PER_MS:.1f}"
                f" ms); the GPU waits for sub-model 0's update there anyway, and the predicted "
                f"step includes the wait")
    all_notes.append(f"physical bound C >= {bound:.1f} (bytes/param * achieved FLOP/s / "
                     f"(2 * H2D B/s * tokens per micro-batch))")
    all_notes.append(f"CPU AdamW at {p.cpu_adam_gbps:g} GB/s of fp32 masters ({cpu_adam_source})")
    precision = precision or Precision(model_dtype(profile.graph))
    if tier:
        all_notes.append("no plan meets every constraint at this C: "
                         + ("loads may stall" if tier == 1
                            else "loads and gradient offloads may stall"))
    return Plan(
        profile_hash=profile_hash(profile), graph_hash=graph_hash(profile.graph),
        model_path=graph.model_path, config=graph.config, batch_size=graph.batch_size,
        options=dict(graph.options), device=profile.device, capacity_bytes=capacity_bytes,
        reserve_bytes=reserve_bytes, accum=p.accum, accum_fixed=accum_fixed,
        activations=p.activations, submodels=tuple(submodels),
        cut_bytes=int(sum(int(tables.cut_bytes[q]) for q in cuts)),
        predicted_step_ms=sim.step_ns / NS_PER_MS, predicted_utilisation=sim.utilisation,
        physical_bound_accum=bound, feasible=not violated, binding=binding,
        atomc_version=__version__, notes=tuple(all_notes), cpu_adam_gbps=p.cpu_adam_gbps,
        search_tier=tier, early_prefetch=early_prefetch, cpu_adam_source=cpu_adam_source,
        transfer_dtype=precision.transfer_dtype, autocast=precision.autocast,
        host_gap_ms=gap_ms or None,
    )


def _fields(obj):
    """json.dumps hook: a dataclass as the dict ir.to_data makes of it (one level; the C
    encoder recurses, and turns tuples into lists as to_data does)."""
    tp = type(obj)
    names = _FIELDS.get(tp)
    if names is None:
        import dataclasses

        if not dataclasses.is_dataclass(obj):
            raise TypeError(f"cannot hash a {tp.__name__}")
        names = _FIELDS[tp] = tuple(f.name for f in dataclasses.fields(obj))
    optional = getattr(tp, "OPTIONAL", ())  # written only when set, as ir.to_data does
    return {name: getattr(obj, name) for name in names
            if not (name in optional and getattr(obj, name) is None)}


_FIELDS: dict[type, tuple[str, ...]] = {}


def profile_hash(profile: Profile) -> str:
    """Profile.content_hash(), computed faster (tests compare the two), once per profile."""
    def compute() -> str:
        fields = _fields(profile)
        data = {"kind": profile.KIND, "schema_version": SCHEMA_VERSION, **fields}
        return canonical_hash(data, default=_fields)

    return once_per_object(profile, "profile_hash", compute)


def graph_hash(graph: OpGraph) -> str:
    """OpGraph.structure_hash(), computed faster (tests compare the two), once per graph."""
    def compute() -> str:
        data = {"nodes": graph.nodes, "params": graph.params, "frontend": graph.frontend}
        return canonical_hash(data, default=_fields)

    return once_per_object(graph, "graph_hash", compute)
