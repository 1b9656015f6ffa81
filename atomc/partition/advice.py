"""What a refusal advises: every operator must fit alone, and the smallest GPU memory at which
some C has a plan meeting every constraint."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from atomc.errors import InfeasiblePlanError
from atomc.ir import Profile
from atomc.partition.accum import (
    Outcome,
    choose_accum,
)
from atomc.partition.caps import folding_of, over_caps, plan_tables
from atomc.partition.constraints import (
    MEMORY,
    plan_slacks,
)
from atomc.partition.cost import (
    CostParams,
    derive,
    plan_costs,
    range_cost,
)
from atomc.partition.tables import (
    NodeFacts,
    RangeTables,
    allowed_cuts,
    build_tables,
)
from atomc.units import format_bytes

_MIB = 1 << 20


def check_operators_fit(profile: Profile, facts: NodeFacts, tables: RangeTables, params_for,
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


def no_partition_error(view: Profile, facts: NodeFacts, params_for, capacity_bytes: int,
                       reserve_bytes: int, accum: int, activations: str, fold_blocks: bool,
                       max_accum: int, fixed: bool) -> InfeasiblePlanError:
    """Why no C up to `max_accum` (`fixed`: C = `accum`) has a plan although every operator
    fits alone, and the budget that works (budget_advice)."""
    need = min_capacity_bytes(facts, params_for(accum), reserve_bytes, view)
    return InfeasiblePlanError(
        f"no partition fits {format_bytes(capacity_bytes)} "
        f"(reserve {format_bytes(reserve_bytes)}) at C={accum}: every operator fits alone, but "
        f"no cut leaves room for the runtime's two weight and two gradient slots (each the "
        f"size of the largest sub-model) beside every sub-model's working memory and the "
        f"sub-model loading next; "
        + budget_advice(view, facts, params_for, reserve_bytes, need, activations,
                        fold_blocks, max_accum, fixed=fixed))


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
        folding = folding_of(view, tables, fold_blocks and activations != "keep")

        def run(c: int) -> Outcome:
            p = dataclasses.replace(params_for(c), usable_bytes=usable)
            d = derive(tables, p)
            ok = over_caps(tables, p, d, folding, 0, first=True) is not None
            return Outcome(c, ok, fits=lambda: over_caps(tables, p, d, folding, 2,
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
    folding = folding_of(view, tables, p.activations != "keep") if view is not None else None
    while hi - lo > _MIB:
        mid = (lo + hi) // 2
        q = CostParams(p.accum, mid, p.h2d_gbps, p.d2h_gbps, p.cpu_adam_gbps, p.activations)
        if over_caps(tables, q, derive(tables, q), folding, 2, first=True) is not None:
            hi = mid
        else:
            lo = mid
    return -(-(hi + reserve_bytes) // _MIB) * _MIB
