"""The best plan by brute force: every cut set, judged by the independent checker
(atomc.partition.check) and timed by the simulator, to hold the search to (test_partition,
test_precision)."""

from __future__ import annotations

import itertools

from atomc.ir import Profile
from atomc.partition.check import Checker, update_tail
from atomc.partition.tables import allowed_cuts, node_facts
from atomc.simulate.events import StageTimes, simulate_swap

LOAD_OVERLAPS = {"forward overlap", "backward overlap"}


def _estimate(facts, early: bool) -> int:
    """Tier 2's objective, written out again from the checker's numbers (search.py docstring)."""
    first = facts[0]
    total = facts[-1].fwd_ns + max(first.bwd_ns, first.checkpoint_ns)
    if len(facts) == 1:
        return total + first.offload_ns + first.adam_ns + first.load_ns
    second = facts[1]
    # P_0's update tail, exact: it queues behind P_1's offload and update (the checker's)
    tail, update1_end = update_tail(facts)
    if early:
        wait = max(update1_end, 0) + second.load_ns
        total += first.fwd_ns + max(tail, wait) + first.load_ns
    else:
        total += max(first.fwd_ns, second.load_ns) + tail + first.load_ns
    for i, (left, right) in enumerate(itertools.pairwise(facts)):
        if i:
            total += max(left.fwd_ns, right.load_ns)
            # later pairs: each overrun as if it stalled the step
            total += max(right.offload_ns - left.bwd_ns, 0)
            total += max(right.offload_ns + right.adam_ns - left.bwd_ns - left.offload_ns, 0)
        reload = left.load_ns if i + 2 < len(facts) else 0
        total += max(right.bwd_ns, right.checkpoint_ns + reload)
    return total


def brute_force(profile: Profile, accum: int, usable: int, tier: int, cpu_gbps: float,
                activations: str = "recompute"):
    """Best (step, cut bytes, count) over all cut sets and both handovers, or None, under the
    constraints the search checks: neighbours in pairs (the runtime's slots, which
    `partition` adds on top of the search, are left out)."""
    checker = Checker(profile, accum, usable, activations, cpu_gbps)
    n = len(profile.graph.nodes)
    positions = [q for q in range(1, n) if allowed_cuts(node_facts(profile))[q]]
    cache = {}
    best = None
    for r in range(len(positions) + 1):
        for cuts in itertools.combinations(positions, r):
            bounds = [0, *cuts, n]
            facts = []
            for a, b in itertools.pairwise(bounds):
                if (a, b) not in cache:
                    cache[a, b] = checker.range_facts(a, b)
                facts.append(cache[a, b])
            cut_bytes = sum(sum(checker.value_bytes[v] for v in checker.crossing(q)) for q in cuts)
            for early in ([False, True] if cuts else [False]):
                kinds = {v.constraint for v in checker.check_facts(facts, early)
                         if "in the slots" not in v.message}
                if ("memory" in kinds or (tier == 0 and kinds)
                        or (tier == 1 and kinds - LOAD_OVERLAPS)):
                    continue
                if tier < 2:
                    stages = [StageTimes(f.fwd_ns, f.bwd_ns, f.load_ns, f.checkpoint_ns,
                                         f.offload_ns, f.adam_ns) for f in facts]
                    step = simulate_swap(stages, accum, early_prefetch=early).step_ns
                else:
                    step = _estimate(facts, early)
                key = (step, cut_bytes, len(facts))
                if best is None or key < best:
                    best = key
    return best
