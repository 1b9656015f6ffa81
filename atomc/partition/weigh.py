"""The plans `partition` weighs for C: checks on the request, the search at each C over the
slot caps (partition.caps), the choice of C (partition.accum, partition.throughput), and each
candidate as a Plan (partition.build)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from atomc.errors import UsageError
from atomc.ir import Plan, Profile
from atomc.partition.accum import (
    Outcome,
    choose_accum,
    takes_tokens,
    tokens_per_microbatch,
)
from atomc.partition.advice import check_operators_fit, no_partition_error
from atomc.partition.build import build_plan, host_gap_ms
from atomc.partition.caps import (
    folding_of,
    largest_params,
    over_caps,
    plan_tables,
    plan_utilisation,
    simulated_score,
)
from atomc.partition.constraints import (
    MEMORY,
    plan_slacks,
)
from atomc.partition.cost import (
    ACTIVATIONS,
    CostParams,
    CostTables,
    derive,
    plan_costs,
    range_stage_times,
    runtime_params,
    with_slot_cap,
)
from atomc.partition.precision import Precision, device_view, resolve_precision
from atomc.partition.search import (
    Folding,
    SearchResult,
    search,
)
from atomc.partition.tables import (
    NodeFacts,
    RangeTables,
    build_tables,
    node_facts,
)
from atomc.partition.throughput import Candidate, parse_global_batch, sweep_accum
from atomc.simulate.events import copies_on_host, simulate_swap
from atomc.units import NS_PER_MS, format_bytes

# a plan whose GPU computes this share of its step is not searched again at a larger C
BUSY_ENOUGH = 0.9


def weigh(profile: Profile, capacity_bytes: int, reserve_bytes: int, accum: int | str | None,
          max_accum: int, activations: str, fold_blocks: bool, cpu_adam_gbps: float,
          transfer_dtype: str | None, autocast: str | None, cpu_adam_source: str,
          max_global_batch: str | None) -> list[tuple[Plan, bool]]:
    """The plans weighed for C, by C (the smallest feasible one first), each with whether its
    own search found it (else: another C's cuts costed at its C); one plan when C is given
    or the smallest feasible one is asked for ("min")."""
    accum, smallest = _checked(accum, max_accum, activations, capacity_bytes, reserve_bytes)
    w = _Weighing.of(profile, capacity_bytes, reserve_bytes, activations, fold_blocks,
                     cpu_adam_gbps, transfer_dtype, autocast, cpu_adam_source,
                     accum_fixed=accum is not None)
    check_operators_fit(w.view, w.facts, build_tables(w.facts, 1), w.params_for, accum or 1,
                        reserve_bytes, fold_blocks, max_accum if accum is None else accum,
                        fixed=accum is not None)
    choice = choose_accum(w.run, max_accum, fixed=accum)
    if choice.outcome is None:
        raise no_partition_error(w.view, w.facts, w.params_for, capacity_bytes, reserve_bytes,
                                 accum or 1, activations, fold_blocks,
                                 max_accum if accum is None else accum, fixed=accum is not None)
    o = choice.outcome
    result = w.kept_result(o)
    notes = [f"accumulation degrees tried: {', '.join(str(c) for c in sorted(choice.tried))}"]
    sweep = accum is None and not smallest
    stop = _largest_accum(w.view, o.accum, max_accum, max_global_batch) if sweep else 0
    first = _candidate(w.tables, profile, w.params_for(o.accum), result.cuts,
                       result.early_prefetch, result.tier, result)
    if sweep:
        candidates = sweep_accum(
            first, lambda c, base: _at(w.tables, profile, w.params_for(c),
                                       lambda: w.derived(c), base, w.folding),
            lambda c: _best_at(w.tables, profile, w.params_for(c), w.run(c)), stop, w.tokens)
    else:
        candidates = [first]
    return [(w.plan_of(cand, result, notes), cand.searched) for cand in candidates]


def _checked(accum: int | str | None, max_accum: int, activations: str, capacity_bytes: int,
             reserve_bytes: int) -> tuple[int | None, bool]:
    """(C given or None, whether the smallest feasible C is asked for); UsageError for a
    request that cannot be weighed."""
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
    if capacity_bytes - reserve_bytes <= 0:
        raise UsageError(
            f"GPU memory {format_bytes(capacity_bytes)} leaves nothing after the reserve of "
            f"{format_bytes(reserve_bytes)}; give a larger --gpu-mem or a smaller --reserve")
    return accum, smallest


def _largest_accum(view: Profile, kept: int, max_accum: int, max_global_batch: str | None) -> int:
    """The largest C the sweep weighs: `max_accum`, and what --max-global-batch allows
    (UsageError when that is below `kept`, the smallest C whose plan meets every constraint)."""
    bound = parse_global_batch(max_global_batch, view.graph.batch_size,
                               tokens_per_microbatch(view), takes_tokens(view))
    if bound is None:
        return max_accum
    if kept > bound:
        raise UsageError(
            f"--max-global-batch {max_global_batch} allows C <= {bound}, but the "
            f"smallest C whose plan meets every constraint is {kept}; raise "
            f"--max-global-batch or give --gpu-mem more")
    return min(max_accum, bound)


@dataclass
class _Weighing:
    """One request's search state: the profile as the device holds it, its range tables and
    folding, and what turns a C into cost parameters."""

    profile: Profile
    view: Profile
    precision: Precision
    facts: NodeFacts
    fold: bool
    capacity_bytes: int
    reserve_bytes: int
    activations: str
    cpu_adam_gbps: float
    cpu_adam_source: str
    accum_fixed: bool
    _derived: dict[int, CostTables] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, profile: Profile, capacity_bytes: int, reserve_bytes: int, activations: str,
           fold_blocks: bool, cpu_adam_gbps: float, transfer_dtype: str | None,
           autocast: str | None, cpu_adam_source: str, accum_fixed: bool) -> _Weighing:
        precision = resolve_precision(profile, transfer_dtype, autocast)
        view = device_view(profile, precision)
        return cls(profile, view, precision, node_facts(view),
                   fold_blocks and activations != "keep", capacity_bytes, reserve_bytes,
                   activations, cpu_adam_gbps, cpu_adam_source, accum_fixed)

    @cached_property
    def tables(self) -> RangeTables:
        return plan_tables(self.facts, self.usable, self.activations)

    @cached_property
    def folding(self) -> Folding | None:
        return folding_of(self.view, self.tables, self.fold)

    @property
    def usable(self) -> int:
        return self.capacity_bytes - self.reserve_bytes

    @property
    def tokens(self) -> int:
        return tokens_per_microbatch(self.view)

    def params_for(self, c: int) -> CostParams:
        profile = self.profile
        return CostParams(c, self.usable, profile.h2d_gbps, profile.d2h_gbps,
                          self.cpu_adam_gbps, self.activations, **runtime_params(profile))

    def derived(self, c: int) -> CostTables:
        """The range tables' costs at C (derived once per C: every cap and tier shares them)."""
        if c not in self._derived:
            self._derived[c] = derive(self.tables, self.params_for(c))
        return self._derived[c]

    def run(self, c: int) -> Outcome:
        """C weighed: whether it is feasible needs one plan under one cap; the best over the
        caps is only wanted at the C kept."""
        tables, folding = self.tables, self.folding
        p = self.params_for(c)
        d = self.derived(c)
        done: dict = {}  # searches by (tier, cap), shared by the questions asked of this C

        def best(tier: int, score):
            found = over_caps(tables, p, d, folding, tier, score, cache=done)
            return found, (0.0 if found is None else plan_utilisation(tables, p, found))

        if over_caps(tables, p, d, folding, 0, first=True, cache=done) is not None:
            return Outcome(c, True, relax=lambda: best(0, None))
        # memory alone decides whether a larger C can still help; tier 2 also gives a plan
        # (its step an estimate: the simulator's step decides between the caps)
        return Outcome(c, False, relax=lambda: best(2, lambda r: simulated_score(tables, p, r)),
                       fits=lambda: over_caps(tables, p, d, folding, 2, first=True,
                                              cache=done) is not None)

    def kept_result(self, o: Outcome) -> SearchResult:
        """The search result at the C kept: at an infeasible C, loads-only stalls (tier 1,
        exact) may simulate faster than tier 2's plan, which only an estimate guides: keep
        whichever the simulator prefers."""
        result: SearchResult = o.result  # type: ignore[assignment]
        if o.feasible:
            return result
        p = self.params_for(o.accum)
        d = self.derived(o.accum)
        tier1 = search(self.tables, p, 1, self.folding,
                       with_slot_cap(d, largest_params(self.tables, p, result), self.usable))
        if tier1 is not None and plan_utilisation(self.tables, p, tier1) >= o.utilisation:
            return tier1
        return result

    def plan_of(self, cand: Candidate, result: SearchResult, notes: list[str]) -> Plan:
        """The candidate as a Plan, its notes: `notes`, the folding, the runtime's slots."""
        pc = self.params_for(cand.accum)
        found = cand.result if cand.result is not None else result
        largest = max(c.param_bytes for c in plan_costs(self.tables, pc, list(cand.cuts)))
        own = list(notes)
        if found.folded_positions:
            own.append(f"repeated blocks folded {found.folded_positions} of "
                       f"{self.facts.num_nodes - 1} cut positions")
        each = "one" if not cand.cuts else "two"
        own.append(f"the runtime's {each} weight and {each} gradient slots, each the size of "
                   f"the largest sub-model ({format_bytes(largest)}): "
                   f"{format_bytes(min(2, len(cand.cuts) + 1) * 2 * largest)} of "
                   f"{format_bytes(self.usable)}")
        own.extend(self.precision.notes)
        plan = build_plan(self.profile, self.tables, pc, cand.cuts,
                          capacity_bytes=self.capacity_bytes, reserve_bytes=self.reserve_bytes,
                          accum_fixed=self.accum_fixed, tier=cand.tier, notes=own,
                          early_prefetch=cand.early_prefetch, precision=self.precision,
                          view=self.view, cpu_adam_source=self.cpu_adam_source)
        return dataclasses.replace(plan, tokens_per_step=pc.accum * self.tokens)


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


def _at(tables: RangeTables, profile: Profile, p: CostParams,
        derived: Callable[[], CostTables], base: Candidate,
        folding: Folding | None) -> Candidate | None:
    """A plan at `p`'s C (`derived()`: its cost tables): `base`'s cuts costed again where their
    memory still fits, else the first plan a search finds (every constraint, else memory
    alone); None when none fits."""
    costs = plan_costs(tables, p, list(base.cuts))
    slacks = plan_slacks(costs, p.usable_bytes, base.early_prefetch)
    if all(s.slack >= 0 for s in slacks if s.constraint == MEMORY):
        again = _candidate(tables, profile, p, base.cuts, base.early_prefetch, 0, None)
        if again.sim.utilisation >= BUSY_ENOUGH:
            return again
        # cuts made for a smaller C where the GPU waited (a CPU update or the links bound
        # it) need not suit this C: a search here may find cuts of more tokens a second
        found = over_caps(tables, p, derived(), folding, 0, first=True)
        if found is None:
            return again
        searched = _candidate(tables, profile, p, found.cuts, found.early_prefetch,
                              found.tier, found)
        return min((again, searched), key=lambda c: (not c.feasible, c.sim.step_ns))
    d = derived()
    for tier in (0, 2):
        found = over_caps(tables, p, d, folding, tier, first=True)
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
