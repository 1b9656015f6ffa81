"""The peers' averaging round as atomc.compare.peers models hivemind's: the vector cut into whole
parts per member, the members that start a flow-control window after the leader, and the round
through `compare`, each against an answer worked out by hand."""

from __future__ import annotations

import math

import pytest

from atomc.compare import Setting, compare, hardware_models, machines_of
from atomc.compare.peers import ORDERS, averaging_programs, group_orders, share_parts
from atomc.place.network import Device, Network
from atomc.simulate.network import Links, simulate_programs

P = 1 << 19  # hivemind's part: 512 KiB, 131072 float32 values
VALUES = P // 4
BPS = 8e6  # a link of 1 MB/s


def wire_ns(nbytes: int) -> int:
    return math.ceil(nbytes * 8 * 1e9 / BPS)


def round_ns(order, leader, shares, window, n=None) -> int:
    n = n or len(order)
    jobs = averaging_programs(list(order), leader, 0, shares, window)
    sim = simulate_programs([[*jobs.get(d, []), ("mark", 0)] for d in range(n)],
                            Links.uniform(n, BPS))
    return sim.step_end(0)


def test_whole_parts_go_to_the_place_they_overlap_most():
    """Four parts over three members: the even shares end at 4/3 and 8/3 parts, so the second
    part (2/3 in the second share) and the third (2/3 in it too) both go to the second place;
    two parts over four members leave two places empty; the last part is the short one."""
    assert share_parts(4 * VALUES, 3, 4, P) == [[P], [P, P], [P]]
    assert share_parts(2 * VALUES, 4, 4, P) == [[P], [], [P], []]
    assert share_parts(3 * VALUES + 10, 2, 4, P) == [[P, P], [P, 40]]
    # float64 vectors: half the values a part
    assert share_parts(4 * VALUES // 2, 3, 8, P) == [[P], [P, P], [P]]
    assert share_parts(0, 3, 4, P) == [[], [], []]


@pytest.mark.parametrize(("values", "members"), [(834304, 4), (4 * VALUES, 3), (1000, 3),
                                                 (2 * VALUES, 4), (10_000_000, 12)])
def test_the_parts_are_hivemind_s(values, members):
    """hivemind's own TensorPartContainer, with the fractions its load balancing gives members
    that state no bandwidth (atomc peer states none), cuts the vector the same way."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("hivemind")
    from hivemind.averaging.load_balancing import load_balance_peers
    from hivemind.averaging.partition import TensorPartContainer

    container = TensorPartContainer([torch.zeros(values)],
                                    load_balance_peers(values, [None] * members))
    theirs = [[part.numel() * 4 for part, _ in container._input_parts_by_peer[i]]
              for i in range(members)]
    assert share_parts(values, members, 4, P) == theirs


def test_the_largest_shares_bind_the_round():
    """Three members, four parts (shares of 1, 2 and 1 parts), starting together: every link
    to and from the middle member carries its two parts and the other's one, 3 parts each
    way, and the round ends when they are through (3P on a link); an even split would put
    8/3 P on every link."""
    shares = share_parts(4 * VALUES, 3, 4, P)
    for order in group_orders([0, 1, 2], 0):
        assert round_ns(order, order[0], shares, window=0) == 3 * wire_ns(P)
    assert 3 * wire_ns(P) > 2 * wire_ns(math.ceil(4 * P / 3))


def test_a_member_starts_when_the_leader_s_first_window_is_through():
    """Two members of one part each. The leader starts at once and streams its copy of the
    other's part; the other starts when the first `window` bytes of it have crossed (its own
    matchmaking messages wait behind them), so its part reaches the leader window/B + P/B in,
    and the leader's averaged part is back window/B + 2P/B in. Without a window both start
    together: 2P/B, the even exchange of the old model."""
    shares = share_parts(2 * VALUES, 2, 4, P)
    assert shares == [[P], [P]]
    window = 256 << 10
    for order in ([0, 1], [1, 0]):
        assert round_ns(order, 0, shares, window) == wire_ns(window + 2 * P)
        assert round_ns(order, 0, shares, 0) == 2 * wire_ns(P)
    # the window only delays: the bytes on each link are the part and the averaged part
    jobs = averaging_programs([0, 1], 0, 0, shares, window)
    sim = simulate_programs([[*jobs[d], ("mark", 0)] for d in (0, 1)], Links.uniform(2, BPS))
    assert sim.link_bytes == {(0, 1): 2 * P, (1, 0): 2 * P}
    # a window as large as the leader's whole stream to the member: it starts once that is in
    assert round_ns([1, 0], 0, [[P // 2], [P // 2]], window) == 3 * wire_ns(P // 2)


def test_group_orders():
    """Every order for up to four members (hivemind shuffles uniformly), ORDERS seeded ones
    beyond, the same for the same seed."""
    assert len(group_orders(list(range(4)), 0)) == 24
    five = group_orders(list(range(5)), 3)
    assert len(five) == ORDERS and five == group_orders(list(range(5)), 3)
    assert all(sorted(o) == list(range(5)) for o in five)


@pytest.fixture(scope="module")
def tiny():
    from pathlib import Path

    from atomc.profile import profile_model
    from atomc.trace import runs_on_for, trace_model

    gpt = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    return profile_model(trace_model(gpt, "tiny", 2, runs_on=runs_on_for("gtx-1080")),
                         target="gtx-1080")


def test_compare_times_the_round_of_a_one_part_model(tiny):
    """The tiny GPT's weights (under 512 KiB) are one part: one of two peers reduces all of it,
    so the other sends all its weights and gets the average back, 2V/B after the group forms
    in either order (the leader's stream to the other is shorter than a window, so the other
    starts once it is through, or at once when it has nothing to receive); an even split, as
    the old model had it, takes V/B."""
    gbps = 1e-3
    devices = tuple(Device(f"g{i}", "host", "gtx-1080") for i in range(2))
    net = Network(devices=devices, delay_ms=((0.0, 0.0), (0.0, 0.0)),
                  bandwidth_gbps=((gbps, gbps), (gbps, gbps)), name="2x1M").check()
    models = hardware_models([tiny], machines_of(net))
    setting = Setting(global_batch=2 * 4 * tiny.graph.batch_size, accum=4, matchmaking_s=0.5,
                      progress_lag_s=0.0)
    r = compare([tiny], net, setting, modes=("peers",), models=models).results["peers"]
    hm = models["gtx-1080"]
    peer = hm.peer_plan(hm.profile.hardware.memory_bytes, 4)
    v = hm.master_bytes
    assert v < P
    one_way = math.ceil(v * 8 * 1e9 / (gbps * 1e9))
    assert r.detail["averaging_start_ns"] == peer.step_ns + 500_000_000
    assert r.step_ns == peer.step_ns + 500_000_000 + 2 * one_way
    assert r.detail["shares_bytes"] == [v, 0]
