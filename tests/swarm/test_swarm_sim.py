"""SWARM rebalancing (atomc.swarm.balance) and the swarm simulator (atomc.swarm.simulate):
Algorithm 2's choices by hand, the no-flap rule as an invariant, the best assignment against
brute force, stochastic wiring against the flow model, and the simulated swarm against
SWARM's Table 5."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atomc.swarm.balance import (
    Move,
    ServerLoad,
    assignment_bound,
    best_assignment,
    choose_join_stage,
    choose_move,
    min_stage_throughput,
    plan_moves,
    rate_on,
    stage_loads,
    stage_throughputs,
)
from atomc.swarm.simulate import (
    ChurnTrace,
    SwarmSimConfig,
    simulate_swarm,
    simulate_wiring,
    synthetic_churn_trace,
)


def swarm(*stages: list[float], queue: float = 0.0) -> list[ServerLoad]:
    """Servers named s{stage}.{j} with the given throughputs, stage by stage."""
    return [ServerLoad(f"s{s}.{j}", s, v, queue) for s, speeds in enumerate(stages)
            for j, v in enumerate(speeds)]


def apply(servers: list[ServerLoad], move: Move) -> list[ServerLoad]:
    return [ServerLoad(s.peer, move.to_stage, s.throughput, s.queue) if s.peer == move.peer
            else s for s in servers]


# --- Algorithm 2 by hand ---------------------------------------------------------------------


def test_throughputs_and_loads():
    servers = swarm([1, 2], [1], [], [0.5])
    assert stage_throughputs(servers, 4)[:3] == [3.0, 1.0, 0.0]
    servers = swarm([1, 2], [1], [])
    assert stage_loads(servers, 3) == [0.0, 0.0, math.inf]
    assert stage_loads(swarm([1, 2], [1, 1]), 2) == [2 / 3, 1.0]  # the bottleneck is at 1
    with pytest.raises(ValueError, match="stage 3"):
        stage_throughputs(swarm([1], [1], [], [1]), 3)
    with pytest.raises(ValueError, match="non-negative"):
        ServerLoad("x", 0, -1.0, 0.0)


def test_move_goes_from_least_to_most_loaded_stage():
    servers = swarm([1, 1, 1, 1, 1], [1, 1, 1], [1, 1, 1, 1])
    move = choose_move(servers, 3)
    assert (move.from_stage, move.to_stage) == (0, 1)
    assert (move.from_throughput, move.to_throughput) == (5.0, 3.0)
    assert stage_throughputs(apply(servers, move), 3) == [4.0, 4.0, 4.0]
    assert choose_move(apply(servers, move), 3) is None


def test_stage_costs_weigh_what_a_server_brings_to_another_stage():
    """Stage 0 costs twice stage 1 per sample: a server of stage 1 serves it at half its rate,
    which a gain threshold sees (equal costs would see the move raise the bottleneck by 1)."""
    servers = swarm([1], [1, 1, 1])
    assert choose_move(servers, 2, min_gain=0.6).peer.startswith("s1.")
    assert choose_move(servers, 2, min_gain=0.6, cost=[2.0, 1.0]) is None  # 1 -> 1.5 only
    assert choose_move(servers, 2, min_gain=0.4, cost=[2.0, 1.0]) is not None
    with pytest.raises(ValueError, match="one positive cost per stage"):
        choose_move(servers, 2, cost=[1.0])


def test_no_move_when_balanced_or_when_it_would_flap():
    assert choose_move(swarm([1, 1], [1, 1], [2]), 3) is None
    # stage 0 is ahead by 1.5, but its only servers are 2 fast: moving one would make
    # stage 0 the bottleneck (2 < 2.5), and moving it back would be the next move
    assert choose_move(swarm([2, 2], [2.5]), 2) is None
    # with a slower server there, both fit (5 - 2 = 3 > 2.5; 5 - 1 = 4 > 2.5), and the one
    # that leaves the pair's lower throughput highest moves: min(4, 3.5) > min(3, 4.5)
    move = choose_move(swarm([2, 2, 1], [2.5]), 2)
    assert move.peer == "s0.2"


def test_empty_stage_is_filled_first():
    move = choose_move(swarm([1, 1, 1], [1], []), 3)
    assert (move.from_stage, move.to_stage) == (0, 2)
    # a lone server is never moved out of its stage, even to fill an empty one
    assert choose_move(swarm([1], []), 2) is None


def test_ties_reach_the_balance_one_move_at_a_time():
    # (10, 10, 8, 8): no single move raises the minimum, two moves reach (9, 9, 9, 9)
    servers = swarm([1] * 10, [1] * 10, [1] * 8, [1] * 8)
    for _ in range(2):
        move = choose_move(servers, 4)
        assert move is not None
        servers = apply(servers, move)
    assert stage_throughputs(servers, 4) == [9.0] * 4
    assert choose_move(servers, 4) is None


def test_mover_is_the_least_queued_candidate_and_never_a_loading_one():
    servers = [ServerLoad("a", 0, 1, 3.0), ServerLoad("b", 0, 1, 0.5),
               ServerLoad("c", 0, 1, 2.0), ServerLoad("d", 1, 1, 9.0)]
    assert choose_move(servers, 2).peer == "b"  # Algorithm 2, lines 21-26
    loading = [ServerLoad("b", 0, 1, 0.5, loading=True) if s.peer == "b" else s
               for s in servers]
    assert choose_move(loading, 2).peer == "c"
    # a loading server still counts for its stage: the gap it fills is not filled twice
    assert choose_move([*servers, ServerLoad("e", 1, 1, 0.0, loading=True)], 2) is None


def test_min_gain_holds_back_small_moves():
    servers = swarm([1] * 11, [1] * 10)  # moving one gives (10, 11): the lower stays 10
    assert choose_move(servers, 2) is None
    servers = swarm([1] * 12, [1] * 10)  # moving one: 10 -> 11, a 10% gain
    assert choose_move(servers, 2) is not None
    assert choose_move(servers, 2, min_gain=0.1) is None
    assert choose_move(servers, 2, min_gain=0.09) is not None


def test_small_swarms_take_the_best_assignment_where_single_moves_stall():
    servers = swarm([1, 1], [2, 2])  # (2, 4): moving a 2 gives (4, 2), no better
    assert choose_move(servers, 2) is None
    plan = plan_moves(servers, 2)  # a 1 and a 2 trade places: (3, 3)
    assert [(m.peer, m.from_stage, m.to_stage) for m in plan] == [("s0.1", 0, 1),
                                                                  ("s1.0", 1, 0)]
    for m in plan:
        servers = apply(servers, m)
    assert stage_throughputs(servers, 2) == [3, 3]
    # the fewest moves among the best: one server fills an empty stage
    assert [(m.peer, m.to_stage) for m in plan_moves(swarm([4, 3, 3], []), 2)] == [("s0.0", 1)]
    assert plan_moves(swarm([5], [5]), 2) == []  # balanced: nothing
    assert plan_moves(swarm([1] * 5, [1] * 3), 2, min_gain=0.4) == []  # 3 -> 4: held back
    assert len(plan_moves(swarm([1] * 5, [1] * 3), 2, min_gain=0.3)) == 1
    # each move is charged min_gain: the trade (2 moves, 2 -> 3) is worth 50%, not 2 x 30%
    assert len(plan_moves(swarm([1, 1], [2, 2]), 2, min_gain=0.2)) == 2
    assert plan_moves(swarm([1, 1], [2, 2]), 2, min_gain=0.3) == []
    assert plan_moves(swarm([1] * 12, [1] * 10), 2) is None  # 2^22 assignments: Algorithm 2


def test_plans_put_fast_servers_on_cheap_stages_and_leave_loading_ones():
    # stage 0 costs twice stage 1: a server of 10/s on stage 0 serves 20/s on stage 1
    servers = [ServerLoad("fast", 0, 10.0, 0), ServerLoad("slow", 1, 10.0, 0)]
    plan = plan_moves(servers, 2, cost=[2.0, 1.0])
    # slow serves 5/s on stage 0, fast 20/s on stage 1: the swap lowers the pipeline; stay
    assert plan == []
    servers = [ServerLoad("a", 1, 20.0, 0), ServerLoad("b", 1, 20.0, 0),
               ServerLoad("c", 0, 4.0, 0, loading=True)]
    plan = plan_moves(servers, 2, cost=[2.0, 1.0])
    # c stays (loading); one of a, b goes to stage 0 at 10/s: (4 + 10, 20)
    assert [(m.peer, m.from_stage, m.to_stage) for m in plan] == [("a", 1, 0)]
    # a rate measured on the other stage before outweighs the costs' estimate: the swap that
    # the costs put at (5, 20) was measured at (11, 12)
    servers = [ServerLoad("fast", 0, 10.0, 0, served=(0.0, 12.0)),
               ServerLoad("slow", 1, 10.0, 0, served=(11.0, 0.0))]
    plan = plan_moves(servers, 2, cost=[2.0, 1.0])
    assert sorted((m.peer, m.to_stage) for m in plan) == [("fast", 1), ("slow", 0)]
    assert rate_on(servers[0], 1, [2.0, 1.0]) == 12.0
    assert rate_on(servers[0], 0, [2.0, 1.0]) == 10.0
    assert rate_on(ServerLoad("new", 0, 10.0, 0), 1, [2.0, 1.0]) == 20.0
    with pytest.raises(ValueError, match="rates where it served"):
        ServerLoad("x", 0, 1.0, 0.0, served=(-1.0,))


def test_join_goes_to_the_stage_that_needs_it_most():
    assert choose_join_stage(swarm([2, 2], [1, 1], [3]), 3) == 1
    assert choose_join_stage(swarm([2, 2], [], [3], []), 4) == 1  # empty first, lower index
    assert choose_join_stage([], 3) == 0
    # speeds, not server counts: one fast server outweighs three slow ones
    assert choose_join_stage(swarm([4], [1, 1, 1]), 2) == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.lists(st.tuples(st.integers(0, 4), st.integers(1, 8)),
                                   min_size=1, max_size=24))
def test_moves_never_lower_the_pipeline_and_never_cycle(num_stages, raw):
    servers = [ServerLoad(f"p{i}", s % num_stages, v / 2, 0.0) for i, (s, v) in enumerate(raw)]
    seen = set()
    low = min(stage_throughputs(servers, num_stages))
    for _ in range(10 * len(servers) * num_stages):
        state = tuple(sorted((s.peer, s.stage) for s in servers))
        assert state not in seen
        seen.add(state)
        move = choose_move(servers, num_stages)
        if move is None:
            break
        before = sorted(stage_throughputs(servers, num_stages))
        servers = apply(servers, move)
        after = sorted(stage_throughputs(servers, num_stages))
        assert after > before  # lexicographically: the potential that rules out cycles
        assert min(after) >= low
        low = min(after)
    else:
        pytest.fail("choose_move kept moving")
    # a stage that had servers still has some
    for k in {s % num_stages for s, _ in raw}:
        assert any(s.stage == k for s in servers)


# --- the best assignment ---------------------------------------------------------------------


def brute_force(x: list[float], num_stages: int) -> float:
    """The best lowest-stage throughput over all num_stages ** len(x) assignments."""
    n = len(x)
    codes = np.arange(num_stages ** n)
    digits = (codes[:, None] // num_stages ** np.arange(n)) % num_stages  # assignment x server
    sums = np.stack([(digits == s) @ np.asarray(x, float) for s in range(num_stages)], axis=1)
    return float(sums.min(axis=1).max())


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 30), min_size=0, max_size=8))
def test_best_assignment_is_exact_against_brute_force(num_stages, ints):
    x = [v / 3 for v in ints]
    assign = best_assignment(x, num_stages)
    assert len(assign) == len(x) and all(0 <= s < num_stages for s in assign)
    got = min_stage_throughput(x, assign, num_stages) if x else 0.0
    exact = brute_force(x, num_stages) if x else 0.0
    assert got == pytest.approx(exact, abs=1e-9)
    assert assignment_bound(x, num_stages) >= exact - 1e-9


def test_best_assignment_is_exact_where_local_search_is_not():
    # total 46: the optimum splits it 23 / 23 (11 + 9 + 3 | 9 + 7 + 6 + 1); LPT with moves
    # and swaps stops at 22
    x = [11, 9, 9, 7, 6, 3, 1]
    assert min_stage_throughput(x, best_assignment(x, 2), 2) == 23
    assert min_stage_throughput(x, best_assignment(x, 2, exact_limit=0), 2) == 22


def test_large_assignments_stay_within_the_bound():
    rng = np.random.default_rng(3)
    for n, s in ((60, 4), (400, 4), (200, 8)):
        x = np.exp(rng.normal(0, 0.3, n))
        got = min_stage_throughput(x, best_assignment(x, s), s)
        bound = assignment_bound(x, s)
        assert got <= bound + 1e-9
        assert got >= bound - (s - 1) / s * x.max()  # LPT's guarantee
        assert got >= 0.995 * bound  # what local search reaches in practice


def test_bound_counts_servers_too_fast_to_share():
    assert assignment_bound([10, 1, 1, 1, 1], 2) == 4  # the 10 alone; the rest make 4
    assert assignment_bound([1, 1], 3) == 0


# --- stochastic wiring (Algorithm 1) against the flow model ----------------------------------


def test_stochastic_wiring_reaches_the_flow_models_throughput():
    rng = np.random.default_rng(1)
    speeds = [list(np.exp(rng.normal(0, 0.4, n))) for n in (8, 10, 7, 9)]
    result = simulate_wiring(speeds, num_microbatches=3000, seed=1)
    assert result.efficiency >= 0.95
    bottleneck = int(np.argmin([sum(s) for s in speeds]))
    assert min(result.busy[bottleneck]) >= 0.9  # every server of it kept busy
    # and each served micro-batches in proportion to its speed
    jobs = np.array(result.jobs[bottleneck], dtype=float)
    share = np.array(speeds[bottleneck]) / sum(speeds[bottleneck])
    assert np.allclose(jobs / jobs.sum(), share, atol=0.03)


def test_stochastic_wiring_starves_without_enough_in_flight():
    speeds = [[1.0] * 4] * 3
    few = simulate_wiring(speeds, inflight=2, num_microbatches=600)
    assert few.efficiency < 0.3  # 2 micro-batches for 12 servers


# --- the simulated swarm ---------------------------------------------------------------------


def no_churn(speeds: list[float]) -> ChurnTrace:
    empty = np.zeros(0)
    return ChurnTrace(np.asarray(speeds, float), np.full(len(speeds), 500.0), empty,
                      np.zeros(0, dtype=np.int64), empty, empty)


@pytest.mark.parametrize("speeds", [[1.0] * 400, list(np.exp(np.random.default_rng(2).normal(
    0, 0.4, 12)))])
def test_no_churn_from_a_balanced_start_is_optimal(speeds):
    config = SwarmSimConfig(num_peers=len(speeds), duration_h=2, rebalance_period_s=60)
    result = simulate_swarm(config, no_churn(speeds))
    assert result.percent_of_optimal() == pytest.approx(100.0, abs=1e-9)
    assert result.num_joins == result.num_leaves == 0
    assert result.throughput == pytest.approx(result.optimal, rel=1e-12)


@pytest.fixture(scope="module")
def table5():
    """SWARM App. I's setting (4 stages, 32 h), 400 peers, the calibrated trace, seed 0."""
    out = {}
    for name, period, join in (("none", None, "random"), ("T=300", 300.0, "neediest"),
                               ("T=60", 60.0, "neediest")):
        out[name] = simulate_swarm(SwarmSimConfig(rebalance_period_s=period, join=join))
    return out


def test_without_rebalancing_churn_unbalances_the_pipeline(table5):
    none = table5["none"]
    # SWARM's Table 5: 82.7% overall, 99.0% in the first hour, 45.4% in the last
    assert 70 <= none.percent_of_optimal() <= 90
    assert none.percent_of_optimal(0, 3600) >= 95
    assert none.percent_of_optimal(31 * 3600) < none.percent_of_optimal(0, 3600) - 15
    assert none.num_moves == 0 and none.num_leaves > 500


def test_rebalancing_every_minute_stays_near_optimal(table5):
    t60, t300 = table5["T=60"], table5["T=300"]
    assert t60.percent_of_optimal() >= 97.0  # SWARM: 97.6
    assert t60.percent_of_optimal(31 * 3600) >= 95.0  # SWARM: 91.7
    assert t300.percent_of_optimal() >= 95.0  # SWARM: 95.8
    assert t60.percent_of_optimal() >= t300.percent_of_optimal() - 0.2
    assert t60.num_moves > t300.num_moves > 0
    # the flow never exceeds the optimum it is measured against
    assert np.all(t60.throughput <= t60.optimal + 1e-9)


def test_simulation_is_deterministic_in_its_seed():
    config = SwarmSimConfig(num_peers=120, duration_h=8, mean_lifetime_h=4,
                            rebalance_period_s=120)
    a, b = simulate_swarm(config), simulate_swarm(config)
    assert np.array_equal(a.times_s, b.times_s) and np.array_equal(a.throughput, b.throughput)
    assert a.num_moves == b.num_moves and str(a) == str(b)
    c = simulate_swarm(dataclasses.replace(config, seed=1))
    assert not np.array_equal(a.throughput, c.throughput)


def test_every_policy_meets_the_same_trace():
    base = SwarmSimConfig(num_peers=100, duration_h=4, mean_lifetime_h=3)
    t1 = synthetic_churn_trace(base)
    t2 = synthetic_churn_trace(dataclasses.replace(base, rebalance_period_s=None, join="random"))
    assert np.array_equal(t1.times_s, t2.times_s) and np.array_equal(t1.speeds, t2.speeds)
    times, live = t1.num_live()
    assert live[0] == 100 and np.all(live >= 0) and np.all(np.diff(times) >= 0)


def test_bursts_keep_the_preemption_rate():
    counts = []
    for burst in (1.0, 6.0):
        config = SwarmSimConfig(burst_mean=burst, replace_probability=1.0, mean_lifetime_h=6)
        trace = synthetic_churn_trace(config)
        counts.append(int(np.sum(trace.deltas < 0)))
        if burst > 1:  # many leaves share an instant
            assert len(np.unique(trace.times_s[trace.deltas < 0])) < counts[-1] / 3
    # 400 peers over 32 h at one preemption per 6 h each: ~2100, with or without bursts
    assert all(1500 < c < 2800 for c in counts)


def test_config_is_checked():
    with pytest.raises(ValueError, match="removal"):
        SwarmSimConfig(removal="oldest")
    with pytest.raises(ValueError, match="rebalance_period_s"):
        SwarmSimConfig(rebalance_period_s=0)
