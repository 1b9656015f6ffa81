"""`atomc compare`: the modes predicted where the answer is known by hand (SWARM's included),
ATOM's ordering on a small estimated profile, plans given in place of profiles, and bad input
refused in one line."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from atomc.actions import pipeline_order
from atomc.cli import main
from atomc.compare import GivenPlan, Setting, compare, hardware_models, machines_of
from atomc.compare.costs import hardware_model
from atomc.compare.modes import links_of
from atomc.compare.peers import local_steps
from atomc.compare.swarm import assign_servers, commit_jobs
from atomc.ir import Plan, Profile
from atomc.partition import plan_step
from atomc.place.network import Device, Network
from atomc.profile import profile_model
from atomc.simulate.network import Links, StageCosts, pipeline_jobs, simulate_programs
from atomc.trace import runs_on_for, trace_model

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
HW = "gtx-1080"
ACCUM = 4
# peers that average as soon as the global batch is in: the known answers leave out
# hivemind's matchmaking and the progress tracker's lag
NO_WAITS = {"matchmaking_s": 0.0, "progress_lag_s": 0.0}


@pytest.fixture(scope="module")
def profile() -> Profile:
    traced = trace_model(GPT, "tiny", 2, runs_on=runs_on_for(HW))
    return profile_model(traced, target=HW)


@pytest.fixture(scope="module")
def profile_path(profile, tmp_path_factory) -> Path:
    return profile.save(tmp_path_factory.mktemp("compare") / "tiny.profile.json")


def network(n: int, gbps: float, delay_ms: float = 0.0, **device) -> Network:
    devices = tuple(Device(f"g{i}", "host", HW, device.get("memory_bytes")) for i in range(n))
    return Network(devices=devices,
                   delay_ms=tuple(tuple(0.0 if i == j else delay_ms for j in range(n))
                                  for i in range(n)),
                   bandwidth_gbps=tuple(tuple(gbps for _ in range(n)) for _ in range(n)),
                   name=f"{n}x{gbps:g}").check()


def write_network(path: Path, n: int, gbps: float, **extra) -> Path:
    data = network(n, gbps).to_json()
    for d in data["devices"]:
        d.update(extra)
    path.write_text(json.dumps(data))
    return path


def models_for(profile, net, sync):
    return hardware_models([profile], machines_of(net), no_update=not sync)


# ---------------------------------------------------------------------------------------------
# known answers


def test_one_device_is_its_swap_step_and_its_plain_step(profile):
    """One device: the peer's global batch is its swap plan's simulated step (nothing to
    average); the layout is one stage that runs every micro-batch's forward, then every
    backward, then AdamW; SWARM needs two stages and two devices."""
    net = network(1, 10.0)
    b = profile.graph.batch_size
    setting = Setting(global_batch=ACCUM * b, accum=ACCUM, **NO_WAITS)
    models = models_for(profile, net, sync=True)
    c = compare([profile], net, setting, models=models)
    hm = models[HW]
    peer = hm.peer_plan(hm.profile.hardware.memory_bytes, ACCUM)
    assert c.results["peers"].step_ns == peer.step_ns
    assert c.results["peers"].links == ()
    fwd, bwd = hm.stage_compute_ns(0, len(hm.units))
    every = set().union(*(u.params for u in hm.units))
    for sched in ("gpipe", "1f1b"):
        r = c.results[sched]
        assert r.feasible and r.detail["micro_batches"] == ACCUM
        assert r.step_ns == ACCUM * (fwd + bwd) + hm.optimizer_ns(every)
    assert not c.results["swarm"].feasible
    assert "2 stages" in c.results["swarm"].reason


def test_two_devices_on_an_infinitely_fast_link(profile):
    """Nothing waits for the network: each peer takes one local step; GPipe over two stages
    (stage 0 the slower in both directions) ends after stage 0's forwards, stage 1's forward
    and backward of the last and first micro-batch, and stage 0's backwards."""
    net = network(2, 1e9)  # a message of a few KiB takes under a nanosecond
    b = profile.graph.batch_size
    setting = Setting(global_batch=2 * ACCUM * b, accum=ACCUM, sync=False, **NO_WAITS,
                      stages=(2,))
    models = models_for(profile, net, sync=False)
    c = compare([profile], net, setting, modes=("peers", "gpipe", "1f1b"), models=models)
    hm = models[HW]
    peer = hm.peer_plan(hm.profile.hardware.memory_bytes, ACCUM)
    assert c.results["peers"].step_ns == peer.step_ns
    g = c.results["gpipe"]
    m = g.detail["micro_batches"]
    (f0, b0), (f1, b1) = (hm.stage_compute_ns(*r) for r in g.detail["ranges"])
    assert f0 >= f1 and b0 >= b1
    by_hand = m * f0 + f1 + b1 + m * b0
    assert by_hand <= g.step_ns <= by_hand + 2 * m  # a nanosecond a message at most
    assert g.binding.startswith("compute on")
    # with the averaging on, the peers' exchange adds nanoseconds only
    models = models_for(profile, net, sync=True)
    synced = compare([profile], net, Setting(global_batch=2 * ACCUM * b, accum=ACCUM,
                                             **NO_WAITS), modes=("peers",),
                     models=models)
    peer = models[HW].peer_plan(hm.profile.hardware.memory_bytes, ACCUM)
    assert 0 <= synced.results["peers"].step_ns - peer.step_ns <= 8


def test_a_slow_link_binds_every_pipeline(profile):
    """At 10 kbit/s a micro-batch's values take seconds on the link, so the layouts' steps are
    the link's: GPipe sends all values (with their generator states), then all gradients back,
    one after the other; 1F1B has the gradients of one micro-batch come back while the next
    one's values go, so only the last gradients add to the values. The peers' weights are one
    of hivemind's parts, which one peer averages: all of them go one way and the average
    comes back (tests/compare/test_compare_peers.py)."""
    gbps = 1e-5
    net = network(2, gbps)
    b = profile.graph.batch_size
    setting = Setting(global_batch=2 * ACCUM * b, accum=ACCUM, sync=False, **NO_WAITS,
                      stages=(2,))
    models = models_for(profile, net, sync=False)
    c = compare([profile], net, setting, modes=("gpipe", "1f1b"), models=models)
    hm = models[HW]
    g, p = c.results["gpipe"], c.results["1f1b"]
    m = g.detail["micro_batches"]
    cut = g.detail["ranges"][1][0]
    values, grads = hm.boundary_bytes(cut)
    t_values = (values + hm.rng_state_bytes) * 8 / (gbps * 1e9) * 1e9
    t_grads = grads * 8 / (gbps * 1e9) * 1e9
    assert g.step_ns == pytest.approx(m * (t_values + t_grads), rel=0.01)
    assert p.step_ns == pytest.approx(m * t_values + t_grads, rel=0.01)
    for r in (g, p):
        assert "link" in r.binding
    models = models_for(profile, net, sync=True)
    synced = compare([profile], net, Setting(global_batch=2 * ACCUM * b, accum=ACCUM,
                                             **NO_WAITS), modes=("peers",),
                     models=models)
    hm = models[HW]
    peer = hm.peer_plan(hm.profile.hardware.memory_bytes, ACCUM)
    wire = math.ceil(hm.master_bytes * 8 * 1e9 / (gbps * 1e9))
    assert synced.results["peers"].step_ns == peer.step_ns + 2 * wire
    assert "link" in synced.results["peers"].binding


def test_pipeline_jobs_time_the_action_lists():
    """The network simulator runs the orders of atomc.actions: 2 stages of equal compute f, b
    over an infinitely fast link take GPipe's (M + 1)(f + b)."""
    f, b, m = 10, 20, 5
    links = Links.uniform(2, math.inf)
    progs = [pipeline_jobs(pipeline_order("gpipe", m, j, 2), StageCosts(f, b, 1, 1, 1, 1),
                           step=0, replica=0, prev_device=0 if j else None,
                           next_device=None if j else 1) + [("mark", 0)] for j in range(2)]
    sim = simulate_programs(progs, links)
    assert sim.step_end(0) == (m + 1) * (f + b)
    with pytest.raises(ValueError, match="deadlock"):
        simulate_programs([[("recv", 1, "never")], []], links)


def test_peers_that_see_each_other_late_take_a_step_more():
    """Peers in step reach the global batch together, but each sees the others' last step only
    after the progress tracker's lag: they take one step more (measured: bench/RESULTS.md,
    modes-b); a slower peer takes fewer steps than a faster one."""
    second = 1_000_000_000
    assert local_steps([second] * 4, [8] * 4, 96, 0.0) == [3] * 4
    assert local_steps([second] * 4, [8] * 4, 96, 0.5) == [4] * 4
    fast, slow = local_steps([second, 2 * second], [8, 8], 96, 0.0)
    assert (fast, slow) == (8, 4)


# ---------------------------------------------------------------------------------------------
# ATOM's ordering


def test_atom_beats_the_pipelines_and_the_gap_grows_as_bandwidth_falls(profile):
    """ATOM Fig. 14 on a small estimated profile: 4 GPUs, C = 4, forward and backward only;
    peers against 4-stage GPipe and 1F1B at 10 Gbit/s, 800 and 400 Mbit/s."""
    b = profile.graph.batch_size
    setting = Setting(global_batch=4 * ACCUM * b, accum=ACCUM, sync=False, stages=(4,))
    models = None
    ratios = []
    for gbps in (10.0, 0.8, 0.4):
        net = network(4, gbps)
        models = models or models_for(profile, net, sync=False)
        r = compare([profile], net, setting, modes=("peers", "gpipe", "1f1b"),
                    models=models).results
        assert r["peers"].step_ns < min(r["gpipe"].step_ns, r["1f1b"].step_ns)
        ratios.append((r["gpipe"].step_ns / r["peers"].step_ns,
                       r["1f1b"].step_ns / r["peers"].step_ns))
    for faster, slower in itertools.pairwise(ratios):
        assert slower[0] > faster[0] and slower[1] > faster[1]


def test_1f1b_beats_gpipe_where_links_or_memory_bind(profile):
    """Where PipeDream's schedule wins in the model: a link so slow that both directions
    matter (1F1B uses them at once, GPipe one after the other), and devices whose memory holds
    1F1B's few micro-batches in flight but not GPipe's: GPipe then recomputes its blocks or
    splits its step into flushes (a bubble each), whichever is faster."""
    b = profile.graph.batch_size
    setting = Setting(global_batch=4 * ACCUM * b, accum=ACCUM, sync=False, stages=(4,))
    slow = network(4, 0.004)
    r = compare([profile], slow, setting, modes=("gpipe", "1f1b"),
                models=models_for(profile, slow, sync=False)).results
    assert r["1f1b"].step_ns < 0.85 * r["gpipe"].step_ns
    probe = models_for(profile, network(4, 10.0), sync=False)[HW]
    m = 4 * ACCUM
    tight = max(probe.stage_memory_bytes(a, a + 1, 4) for a in range(4)) + 1
    assert any(probe.stage_memory_bytes(a, a + 1, m) > tight for a in range(4))
    small = network(4, 10.0, memory_bytes=tight)
    r = compare([profile], small, setting, modes=("gpipe", "1f1b"),
                models=models_for(profile, small, sync=False)).results
    g, p = r["gpipe"].detail, r["1f1b"].detail
    assert g["recomputing"] or g["flush"] < m
    assert not p["recomputing"] and p["flush"] == m
    assert r["1f1b"].step_ns < r["gpipe"].step_ns


# ---------------------------------------------------------------------------------------------
# the command


def test_cli_prints_the_table_and_the_verdict(tmp_path, capsys, profile_path):
    net = write_network(tmp_path / "net.json", 2, 0.4)
    out = tmp_path / "c.json"
    assert main(["compare", str(profile_path), "--network", str(net), "--global-batch", "16",
                 "--accum", "4", "--budget-s", "0.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("ATOM peers", "layout, GPipe", "layout, 1F1B", "SWARM", "fastest:"):
        assert label in text
    data = json.loads(out.read_text())
    assert data["fastest"] in data["modes"] and data["modes"]["peers"]["feasible"]


@pytest.mark.parametrize("case", ["unknown gpu", "no gpu", "stage too large", "host too small"])
def test_bad_input_exits_2_in_one_line(tmp_path, capsys, profile_path, case):
    args = ["compare", str(profile_path), "--global-batch", "16", "--accum", "4",
            "--budget-s", "0.5"]
    if case == "unknown gpu":
        net = write_network(tmp_path / "n.json", 2, 1.0, gpu="gtx-9999")
        expect = ["g0", "gtx-9999", "hardware profile"]
    elif case == "no gpu":
        net = write_network(tmp_path / "n.json", 2, 1.0, gpu=None)
        expect = ["g0", "names no hardware"]
    elif case == "stage too large":
        net = write_network(tmp_path / "n.json", 2, 1.0, memory_bytes=200_000)
        args += ["--modes", "gpipe"]
        expect = ["needs", "bytes", "on device g", "200000 bytes"]
    else:
        net = write_network(tmp_path / "n.json", 2, 1.0, host_memory_bytes=1000)
        args += ["--modes", "peers"]
        expect = ["device g0", "host", "1000 bytes"]
    assert main(args + ["--network", str(net)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for word in expect:
        assert word in err


# ---------------------------------------------------------------------------------------------
# SWARM's known answers


def kinds_network(kinds: list[str], gbps: float, memory_bytes: int | None = None) -> Network:
    n = len(kinds)
    devices = tuple(Device(f"g{i}", "host", k, memory_bytes) for i, k in enumerate(kinds))
    return Network(devices=devices, delay_ms=tuple((0.0,) * n for _ in range(n)),
                   bandwidth_gbps=tuple((gbps,) * n for _ in range(n)),
                   name=f"{n}x{gbps:g}").check()


def server_ns(hm, rng, last: bool) -> int:
    """One SWARM server's compute per micro-batch, by hand: a stage before the last gets a
    forward call, then a backward call that runs the forward again; the last one call."""
    f, b = hm.stage_compute_ns(*rng)
    return f + b if last else 2 * f + b


def test_swarm_two_servers_on_an_infinitely_fast_link(profile):
    """Two identical devices, two stages, nothing waits for the network: the pipeline moves at
    its slower server, so the global batch takes its micro-batches x that server's time, plus
    the fill (one trip through both), within the wiring's efficiency (>= 95%: swarm.simulate)."""
    net = network(2, 1e9)
    b = profile.graph.batch_size
    m = 16
    setting = Setting(global_batch=m * b, sync=False, stages=(2,))
    models = models_for(profile, net, sync=False)
    r = compare([profile], net, setting, modes=("swarm",), models=models).results["swarm"]
    hm = models[HW]
    ranges = r.detail["ranges"]
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[1][1] == len(hm.units)
    t0, t1 = server_ns(hm, ranges[0], False), server_ns(hm, ranges[1], True)
    assert sorted(r.detail["server_ns"].values()) == sorted([t0, t1])
    slow = max(t0, t1)
    by_hand = m * slow + t0 + t1
    assert by_hand - 2 <= r.step_ns <= m * slow / 0.95 + t0 + t1
    assert r.detail["throughput_per_s"] == pytest.approx(1e9 / slow, rel=0.05)
    assert r.binding.startswith("compute on")


def test_swarm_puts_servers_where_the_slowest_stage_is_fastest(profile):
    """One fast device and two 1.5x slower ones, two stages: by hand, of the four ways to
    split them the two slow servers on the first stage (which runs a forward more per
    micro-batch) and the fast one on the last is best; the fast one alone on the first stage
    (what balancing the devices' mean speeds gives) is 25% slower."""
    net = kinds_network(["gtx-1080-ti", HW, HW], 1e9)
    models = {HW: hardware_model(HW, profile, slowdown=1.5, no_update=True),
              "gtx-1080-ti": hardware_model("gtx-1080-ti", profile, no_update=True)}
    b = profile.graph.batch_size
    setting = Setting(global_batch=16 * b, sync=False, stages=(2,))
    r = compare([profile], net, setting, modes=("swarm",), models=models).results["swarm"]
    fast, slow = models["gtx-1080-ti"], models[HW]
    ranges = r.detail["ranges"]

    def rate(hm, s: int) -> float:
        return 1e9 / server_ns(hm, ranges[s], s == 1)

    splits = {  # (stage 0's servers, stage 1's servers) -> the slower stage's micro-batches/s
        ("g0", "g1 g2"): min(rate(fast, 0), 2 * rate(slow, 1)),
        ("g1 g2", "g0"): min(2 * rate(slow, 0), rate(fast, 1)),
        ("g0 g1", "g2"): min(rate(fast, 0) + rate(slow, 0), rate(slow, 1)),
        ("g1", "g0 g2"): min(rate(slow, 0), rate(fast, 1) + rate(slow, 1)),
    }
    best = max(splits, key=splits.get)
    assert best == ("g1 g2", "g0")
    assert splits[best] > 1.2 * max(v for k, v in splits.items() if k != best)
    assert r.detail["assignment"] == [x.split() for x in best]
    assert 0.95 * splits[best] <= r.detail["throughput_per_s"] <= 1.01 * splits[best]


def test_swarm_bound_by_the_trainers_link(profile):
    """At 10 kbit/s the server away from the trainer waits on its link: it takes the last
    stage (one call: its input values and the micro-batch's inputs in, its input gradients
    back; the first stage's two calls carry more), and the global batch is the bytes through
    the trainer's busiest lane over its bandwidth, plus one micro-batch's trip."""
    gbps = 1e-5
    net = network(2, gbps)
    b = profile.graph.batch_size
    m = 8
    setting = Setting(global_batch=m * b, sync=False, stages=(2,))
    models = models_for(profile, net, sync=False)
    r = compare([profile], net, setting, modes=("swarm",), models=models).results["swarm"]
    hm = models[HW]
    assert r.detail["assignment"] == [["g0"], ["g1"]]  # the trainer's device on stage 0
    cut = r.detail["ranges"][1][0]
    values, grads = hm.boundary_bytes(cut)
    (tokens,) = [t for n in profile.graph.nodes if n.op == "placeholder" for t in n.outputs]
    inputs = math.prod(tokens.shape) * 8  # int64 token ids
    lanes = {(a, bb): nb for a, bb, nb, _ in r.links}
    assert lanes[("g0", "g1")] == m * (values + inputs)
    assert lanes[("g1", "g0")] == m * grads
    lane_ns = (values + inputs) * 8 / (gbps * 1e9) * 1e9
    first = server_ns(hm, r.detail["ranges"][0], False)
    assert r.step_ns == pytest.approx((m + 1) * lane_ns + first, rel=0.01)
    assert "link g0 -> g1" in r.binding


def test_swarm_commit_is_matchmaking_then_every_servers_whole_sums(profile):
    """After the pipeline, a stage's servers look for their group for swarm_matchmaking_s, then
    each fetches every other server's whole sums (atomc.swarm.commit), not a butterfly's
    shares: on a slow link every lane between two servers of a stage carries the stage's
    whole gradient bytes, and a stage's commit is the matchmaking plus those bytes over the
    link plus AdamW (a stage of one server: AdamW alone)."""
    gbps = 0.01
    net = network(4, gbps)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, stages=(2,), swarm_matchmaking_s=0.5)
    models = models_for(profile, net, sync=True)
    r = compare([profile], net, setting, modes=("swarm",), models=models).results["swarm"]
    hm = models[HW]
    lanes = {(x, y): nb for x, y, nb, _ in r.links}
    commits = []
    for s, servers in enumerate(r.detail["assignment"]):
        a, bb = r.detail["ranges"][s]
        fqns = set().union(*(u.params for u in hm.units[a:bb]))
        nbytes = hm.param_bytes(fqns)
        for x, y in itertools.permutations(servers, 2):
            assert lanes[(x, y)] == nbytes  # no trainer traffic between servers
        commits.append((0.5e9 + nbytes * 8 / gbps if len(servers) > 1 else 0)
                       + hm.optimizer_ns(fqns))
    assert max(len(x) for x in r.detail["assignment"]) > 1
    assert r.step_ns - r.detail["pipeline_ns"] == pytest.approx(max(commits), rel=1e-3)


def test_swarm_commit_jobs_send_whole_sums_on_every_link():
    """Three servers: each link carries the whole sums once each way (a butterfly would carry
    2/3 of them), over distinct links at once."""
    nbytes, gbps = 3_000_000, 1.0
    group = [0, 1, 2]
    sim = simulate_programs([commit_jobs(d, group, nbytes, "c") + [("mark", 0)]
                             for d in group], links_of(network(3, gbps)))
    assert sorted(sim.link_bytes.values()) == [nbytes] * 6
    assert sim.step_end(0) == pytest.approx(nbytes * 8 / gbps, rel=1e-6)


def test_swarm_stage_larger_than_every_device(profile):
    net = network(3, 10.0, memory_bytes=200_000)
    b = profile.graph.batch_size
    r = compare([profile], net, Setting(global_batch=4 * b, stages=(2, 3)), modes=("swarm",),
                models=models_for(profile, net, sync=True)).results["swarm"]
    assert not r.feasible
    assert "on device g" in r.reason and "200000 bytes" in r.reason and "needs" in r.reason


def test_assign_servers_never_puts_a_server_where_it_does_not_fit():
    """A rate of 0 (the stage does not fit the device) is avoided both where every
    assignment is tried and where Algorithm 2's moves improve the mean-rate balance."""
    small = np.array([[3.0, 0.0], [1.0, 1.0], [1.0, 1.0]])  # device 0 holds stage 0 only
    assert assign_servers(small) == [0, 1, 1]
    rates = np.ones((14, 2))  # 2 ** 14 assignments: the moves
    rates[:7, 1] = 0.0
    got = assign_servers(rates)
    assert all(got[d] == 0 for d in range(7)) and got.count(1) == 7


# ---------------------------------------------------------------------------------------------
# plans in place of profiles


@pytest.fixture(scope="module")
def plan_files(profile, tmp_path_factory) -> dict[str, Path]:
    """The profile and a plan `atomc partition` made from it beside it (4 GiB, C=2), a copy of
    the plan alone in another folder, and a plan of the model at another micro-batch."""
    folder = tmp_path_factory.mktemp("plans")
    prof = profile.save(folder / "tiny.profile.json")
    plan = folder / "tiny.plan.json"
    assert main(["partition", str(prof), "--gpu-mem", "4GiB", "--accum", "2",
                 "-o", str(plan)]) == 0
    alone = tmp_path_factory.mktemp("alone") / "tiny.plan.json"
    alone.write_text(plan.read_text())
    other = tmp_path_factory.mktemp("other")
    one = profile_model(trace_model(GPT, "tiny", 1, runs_on=runs_on_for(HW)), target=HW)
    one_prof = one.save(other / "one.profile.json")
    assert main(["partition", str(one_prof), "--gpu-mem", "4GiB",
                 "-o", str(other / "one.plan.json")]) == 0
    return {"profile": prof, "plan": plan, "alone": alone, "other": other / "one.plan.json"}


def test_a_plan_is_what_its_peers_train_with(profile, plan_files):
    """A plan made for 4 GiB at C=2 runs as it is on 8 GiB devices: the peers' local step is
    that plan's simulated schedule, not the plan compare would make (C=1 here); without the
    optimizer step it is recosted without its CPU update."""
    plan = Plan.load(plan_files["plan"])
    given = GivenPlan(plan=plan, profile=profile, source="tiny.plan.json")
    net = network(2, 0.4)
    b = profile.graph.batch_size
    setting = Setting(global_batch=8 * b, **NO_WAITS)
    mine = compare([profile], net, setting, modes=("peers",)).results["peers"]
    c = compare([], net, setting, modes=("peers",), plans=[given])
    r = c.results["peers"]
    assert plan.accum == 2 and "C=2," in r.config and "C=2," not in mine.config
    assert c.plans == {"g0": "tiny.plan.json", "g1": "tiny.plan.json"}
    step = plan_step(plan).step_ns
    assert r.detail["local_step_ns"] == {"g0": step, "g1": step}
    assert plan.cpu_adam_gbps > 0
    bare = hardware_models([], machines_of(net), no_update=True, plans=[given])[HW]
    unsynced = bare.peer_plan(8 << 30, None)
    assert unsynced.plan.cpu_adam_gbps == 0 and unsynced.plan.accum == 2
    assert 0 < unsynced.step_ns < step


def test_cli_takes_a_plan_and_finds_its_profile_beside_it(tmp_path, capsys, plan_files):
    net = write_network(tmp_path / "net.json", 2, 0.4)
    out = tmp_path / "c.json"
    plan = str(plan_files["plan"])
    assert main(["compare", plan, "--network", str(net), "--global-batch", "16",
                 "--modes", "peers", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"made from {plan_files['profile']} (found beside it)" in text
    assert "g0, g1 train with it (C=2" in text and "as it is" in text
    data = json.loads(out.read_text())
    assert [d["plan"] for d in data["devices"]] == [plan, plan]
    # the plan with its profile given: the same prediction
    assert main(["compare", str(plan_files["profile"]), plan, "--network", str(net),
                 "--global-batch", "16", "--modes", "peers"]) == 0
    assert "(given)" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["neither", "other model", "too little memory",
                                  "too little host memory", "no profile", "accum"])
def test_bad_plan_input_exits_2_in_one_line(tmp_path, capsys, plan_files, case):
    plan = str(plan_files["plan"])
    inputs = [plan]
    extra: dict = {}
    args = ["--global-batch", "16", "--modes", "peers"]
    if case == "neither":
        inputs = [str(write_network(tmp_path / "other.json", 2, 1.0))]
        expect = ["other.json", "atomc.network", "neither a profile"]
    elif case == "other model":
        inputs = [plan, str(plan_files["other"])]
        expect = ["one.plan.json", "batch 1", "batch 2"]
    elif case == "too little memory":
        extra = {"memory_bytes": 2 << 30}
        expect = [plan, "device g0", str(2 << 30) + " bytes", str(4 << 30) + " bytes"]
    elif case == "too little host memory":
        extra = {"host_memory_bytes": 1000}
        expect = [plan, "device g0's host", "1000 bytes"]
    elif case == "no profile":
        inputs = [str(plan_files["alone"])]
        expect = [str(plan_files["alone"]), "neither among the inputs nor beside"]
    else:
        args += ["--accum", "4"]
        expect = ["--accum 4", plan, "C=2"]
    net = write_network(tmp_path / "n.json", 2, 1.0, **extra)
    assert main(["compare", *inputs, "--network", str(net), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for word in expect:
        assert word in err
