"""`atomc compare`: the modes predicted where the answer is known by hand, ATOM's ordering on a
small estimated profile, and bad input refused in one line."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from atomc.actions import pipeline_order
from atomc.cli import main
from atomc.compare import Setting, compare, hardware_models, machines_of
from atomc.compare.peers import local_steps
from atomc.ir import Profile
from atomc.place.network import Device, Network
from atomc.profile import profile_model
from atomc.simulate.network import Links, StageCosts, pipeline_jobs, simulate_programs
from atomc.trace import runs_on_for, trace_model

GPT = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
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
    one's values go, so only the last gradients add to the values. The peers' average is two
    phases of half the weights each."""
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
    share = math.ceil(hm.master_bytes / 2)
    wire = math.ceil(share * 8 * 1e9 / (gbps * 1e9))
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
