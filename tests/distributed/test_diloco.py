"""DiLoCo's parts, each against an answer worked out by hand: the outer options and their
one-line errors, the fragments, hivemind's parts and bytes of a compressed round, the codecs
and int8's per-block bound (through hivemind's own averager), one peer's rounds with a
stand-in averager (the outer step, the fragments' carry), and `atomc compare --modes diloco`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from atomc.cli import main
from atomc.compare import Setting, compare, hardware_models, machines_of
from atomc.compare.diloco import round_shares
from atomc.distributed.outer import OuterConfig, OuterOptimizer, fragments_of
from atomc.distributed.rounds import (
    int8_bound,
    round_bytes,
    split_parts,
    values_per_part,
    wire_bytes,
)
from atomc.errors import PeerError, UsageError
from atomc.place.network import Device, Network
from atomc.profile import profile_model
from atomc.trace import runs_on_for, trace_model

from processes import SERIAL

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"
SCRIPT = ROOT / "examples" / "train_peer.py"
HW = "gtx-1080"


# ---- the outer options ------------------------------------------------------------------------


def test_outer_defaults_are_atom_s_averaging_and_diloco_s():
    assert OuterConfig().plain() and OuterConfig.make().plain()
    assert OuterConfig.make("sgd", lr=1.0, momentum=0.0, round_dtype="float32").plain("float32")
    assert not OuterConfig.make("sgd", round_dtype="float32").plain("float64")
    assert not OuterConfig.make("sgd", lr=0.5).plain()
    assert not OuterConfig.make("sgd", fragments=2).plain()
    nesterov = OuterConfig.make("nesterov")
    assert (nesterov.lr, nesterov.momentum, nesterov.plain()) == (0.7, 0.9, False)
    assert OuterConfig.from_json(nesterov.to_json()) == nesterov
    # why ATOM's averaging keeps its own path: the outer step at lr 1 is the average in exact
    # arithmetic, not in floating point
    g = torch.Generator().manual_seed(0)
    start, a, b = (torch.randn(10_000, generator=g) for _ in range(3))
    avg = (a + b) / 2
    delta = ((start - a) + (start - b)) / 2
    assert not torch.equal(start - delta, avg)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"inner_steps": 0}, "--inner-steps 0: a round needs at least one local step"),
    ({"lr": 0.0}, "--outer-lr 0.0: the outer learning rate must be a positive number"),
    ({"lr": -0.7}, "--outer-lr -0.7: the outer learning rate must be a positive number"),
    ({"lr": math.nan}, "--outer-lr nan"),
    ({"outer": "nesterov", "momentum": 0.0}, "--outer nesterov with --outer-momentum 0"),
    ({"momentum": 1.0}, "--outer-momentum 1.0: expected a number in [0, 1)"),
    ({"fragments": 0}, "--fragments 0"),
    ({"inner_steps": 32, "fragments": 3}, "--inner-steps 32 does not split into --fragments 3"),
    ({"outer": "adam"}, "--outer 'adam' is not one of sgd, nesterov"),
    ({"round_dtype": "int4"}, "--round-dtype 'int4' is not one of"),
])
def test_bad_outer_options_in_one_line(kwargs, said):
    with pytest.raises(UsageError) as e:
        OuterConfig.make(**kwargs)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_disagreement_names_both_values():
    mine, theirs = OuterConfig.make("sgd"), OuterConfig.make("nesterov", inner_steps=8)
    assert mine.disagreement(mine) == ""
    assert mine.disagreement(theirs) == (
        "--outer sgd --outer-lr 1 --outer-momentum 0 --inner-steps (global batch rule) here, "
        "--outer nesterov --outer-lr 0.7 --outer-momentum 0.9 --inner-steps 8 there")


def test_nesterov_outer_step_is_diloco_s():
    """torch's SGD(nesterov=True) on the start weights with the averaged pseudo-gradient:
    m = mu m + d (m = d the first time), start -= lr (d + mu m)."""
    cfg = OuterConfig.make("nesterov", lr=0.7, momentum=0.9)
    start = torch.arange(4, dtype=torch.float64)
    opt = OuterOptimizer([start], cfg)
    d1, d2 = torch.tensor([1.0, -1, 0.5, 0], dtype=torch.float64), torch.full((4,), 0.25,
                                                                              dtype=torch.float64)
    m = d1.clone()
    want = start - 0.7 * (d1 + 0.9 * m)
    assert torch.equal(opt.step(0, d1), want)
    m = 0.9 * m + d2
    want = want - 0.7 * (d2 + 0.9 * m)
    assert torch.equal(opt.step(0, d2), want)
    assert torch.equal(opt.pseudo_gradient(0, want - 1), torch.ones(4, dtype=torch.float64))


def test_fragments_are_consecutive_sub_models_with_the_smallest_largest():
    assert fragments_of([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragments_of([30, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert fragments_of([5, 5, 5], 3) == [[0], [1], [2]]
    assert fragments_of([1, 1, 100, 1], 3) == [[0, 1], [2], [3]]
    with pytest.raises(UsageError) as e:
        fragments_of([1, 2, 3], 4)
    assert str(e.value) == ("--fragments 4 is more than the package's 3 sub-models; a fragment "
                            "is one or more whole sub-models: give at most 3")


# ---- what a round puts on the wire --------------------------------------------------------------


@pytest.mark.parametrize("round_dtype", [None, "float16", "bfloat16", "int8"])
@pytest.mark.parametrize(("sizes", "members"), [((3_000_000,), 4), ((1_000_000, 2000), 3),
                                                ((100_000,), 2), ((2_500_000, 700), 4)])
def test_the_parts_are_hivemind_s(round_dtype, sizes, members):
    """hivemind's TensorPartContainer, with the round's compression (per tensor: the second
    one, buffers, exact) and even shares, cuts the tensors as split_parts does, and each part's
    message carries wire_bytes of buffer."""
    pytest.importorskip("hivemind")
    from hivemind.averaging.load_balancing import load_balance_peers
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.compression import NoCompression, PerTensorCompression
    from hivemind.compression.base import CompressionInfo

    from atomc.distributed.rounds import compression_for

    tensors = [torch.randn(n) for n in sizes]
    codec = PerTensorCompression([compression_for(round_dtype)] + [NoCompression()] * 3)
    infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
    total = sum(sizes)
    container = TensorPartContainer(tensors, load_balance_peers(total, [None] * members),
                                    compression=codec, tensor_infos=infos)
    theirs = [[(info.key, part.numel()) for part, info in container._input_parts_by_peer[i]]
              for i in range(members)]
    dtypes = [round_dtype] + [None] * 3
    mine = split_parts([(n, values_per_part(n, dtypes[i], 4)) for i, n in enumerate(sizes)],
                       members)
    assert mine == theirs
    for place in container._input_parts_by_peer[:1]:
        for part, info in list(place)[:2]:
            msg = codec.compress(part, info)
            assert len(msg.buffer) == wire_bytes(part.numel(), dtypes[info.key], 4)


def test_round_bytes_add_up():
    """What all members send is what all receive; uncompressed, a member sends 2 (n - 1) / n
    of the vector give or take a part; int8 sends about a quarter of float32's."""
    tensors = [(5_000_000, None, 4)]
    n = 4
    sent = [round_bytes(tensors, n, p) for p in range(n)]
    assert sum(s for s, _ in sent) == sum(r for _, r in sent)
    for s, _ in sent:
        assert abs(s - 2 * (n - 1) / n * 20e6) <= 2 * (n - 1) * (1 << 19)
    int8 = sum(round_bytes([(5_000_000, "int8", 4)], n, p)[0] for p in range(n))
    assert 0.24 < int8 / sum(s for s, _ in sent) < 0.27
    assert round_bytes(tensors, 1, 0) == (0, 0)


def test_codecs_round_trip():
    pytest.importorskip("hivemind")
    from atomc.distributed.rounds import compression_for

    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g) * torch.logspace(-6, 3, 10_000)
    bf = compression_for("bfloat16")
    back = bf.extract(bf.compress(x))
    assert back.dtype == torch.float32 and torch.equal(back, x.to(torch.bfloat16).float())
    q = compression_for("int8")
    back = q.extract(q.compress(x))
    assert bool(((back - x).abs() <= int8_bound(x) * (1 + 1e-6)).all())
    assert not bool(((back - x).abs() <= int8_bound(x) * 0.5).all())  # the bound is tight


# ---- int8 through hivemind's averager ------------------------------------------------------------


@SERIAL
def test_int8_round_within_the_per_block_bound():
    """Two averagers (atomc peer's, over int8) average 1.2M values: each member's result is
    the exact weighted mean within the per-block bound of hivemind's all-reduce: its own
    part's rounding, the returned difference's rounding, and the others' parts' rounding in
    the mean (half a step of each one's block, blocks counted from each part's start)."""
    pytest.importorskip("hivemind")
    import hivemind

    from atomc.distributed.averaging import make_averager
    from atomc.distributed.peerconfig import PeerConfig
    from atomc.distributed.rounds import compression_for

    n = 1_200_000
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, generator=g) * torch.linspace(0.01, 3, n) for _ in range(2)]
    weights = [3.0, 1.0]
    mean = (weights[0] * xs[0] + weights[1] * xs[1]) / sum(weights)
    cfg = PeerConfig(package="-", run_id="int8test", matchmaking_time_s=1.0,
                     averaging_timeout_s=30.0)
    dhts, avgs = [], []
    try:
        dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                 initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()]))
        for d, x in zip(dhts, xs):
            avgs.append(make_averager(hivemind, [x.clone()], d, cfg, None,
                                      compression=compression_for("int8")))
        controls = [a.step(weight=w, timeout=30, wait=False) for a, w in zip(avgs, weights)]
        for c in controls:
            assert c.result(timeout=60)
        results = []
        for a in avgs:
            with a.get_tensors() as t:
                results.append(t[0].clone())
    finally:
        for a in avgs:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    per_part = values_per_part(n, "int8", 4)

    def bound(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([int8_bound(p) for p in v.split(per_part)])

    others = sum(w * bound(x) for w, x in zip(weights, xs)) / sum(weights)
    for x, r in zip(xs, results):
        limit = bound(x) + bound(mean - x) * 1.01 + others + 1e-6
        err = (r - mean).abs()
        assert bool((err <= limit).all()), float((err - limit).max())
        assert float(err.max()) > 0  # rounded, not exact


# ---- one peer's rounds, with a stand-in averager -------------------------------------------------


class StandIn:
    """An averager that gives a fixed average and group: hivemind's StepControl's surface."""

    def __init__(self, tensors, average, names):
        self.tensors, self.average, self.names = tensors, average, names
        self.sent = []

    @contextmanager
    def get_tensors(self):
        yield self.tensors

    def step(self, weight, gather, timeout, allow_retries, wait):
        self.sent.append((self.tensors[0].clone(), weight, gather))
        self.tensors[0].copy_(self.average)
        group = {i: {"name": n, "epoch": gather["epoch"]} for i, n in enumerate(self.names)}

        class Done:
            stage = None

            def done(self):
                return True

            def result(self):
                return group

        return Done()


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory) -> Path:
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts

    d = tmp_path_factory.mktemp("diloco-unit")
    traced = trace_model(GPT, "tiny", 2)
    generate(plan_from_cuts(traced, [9, 39]), d / "pkg", traced=traced)
    return d / "pkg"


def test_a_fragment_round_applies_the_outer_step_and_keeps_the_steps_beside_it(tiny_pkg):
    """Two fragments: round 0 sends fragment 0's pseudo-gradient; at the next boundary its
    start weights take the outer step with the group's average, and its masters become them
    plus what the local steps in between did to it; fragment 1 is untouched until its round."""
    from atomc.distributed.diloco import OuterRounds, read_fragment
    from atomc.runtime import SwapTrainer

    tr = SwapTrainer.from_package(tiny_pkg, device="cpu", accum=2, seed=0, dtype="float64",
                                  optimizer={"lr": 1e-2, "weight_decay": 0.0})
    try:
        cfg = OuterConfig.make("nesterov", inner_steps=4, fragments=2)
        frags = fragments_of([L.owned_numel for L in tr.store.layouts], 2)
        rounds = OuterRounds(tr, cfg, frags, name="me", log=lambda s: None)
        g = torch.Generator().manual_seed(3)

        def batch():
            return (torch.randint(0, 256, (4, 16), generator=g),)

        start0 = read_fragment(tr, frags[0])
        start1 = read_fragment(tr, frags[1])
        tr.step(batch())
        tr.step(batch())
        at_launch = read_fragment(tr, frags[0])
        average = torch.full((rounds.width,), 1e-3, dtype=torch.float64)
        rounds.averager = StandIn(rounds.tensors(), average, ["me", "other"])
        rounds.launch(0, 16.0, 10.0)
        sent, weight, _ = rounds.averager.sent[0]
        assert weight == 16.0
        assert torch.equal(sent[:start0.numel()], start0 - at_launch)
        assert not sent[start0.numel():].any()  # padded to the largest fragment
        tr.step(batch())
        tr.step(batch())
        before = read_fragment(tr, frags[0])
        info = rounds.complete()
        assert info.members == {"me": 0, "other": 0} and info.place == 0
        assert (info.sent_bytes, info.received_bytes) == round_bytes(rounds.wire_tensors(), 2, 0)
        stepped = start0 - 0.7 * (average[:start0.numel()] * (1 + 0.9))
        torch.testing.assert_close(rounds.outer.starts[0].detach(), stepped, rtol=0, atol=1e-15)
        torch.testing.assert_close(read_fragment(tr, frags[0]), stepped + (before - at_launch),
                                   rtol=0, atol=1e-15)
        assert torch.equal(rounds.outer.starts[1].detach(), start1)
    finally:
        tr.close()


# ---- bad input on the command line ------------------------------------------------------------


@pytest.mark.parametrize(("flags", "said"), [
    (["--inner-steps", "0"], "--inner-steps 0: a round needs at least one local step"),
    (["--outer-lr", "0"], "--outer-lr 0.0: the outer learning rate must be a positive"),
    (["--outer", "nesterov", "--outer-lr", "-1"], "--outer-lr -1.0: the outer learning rate"),
])
def test_atomc_peer_refuses_bad_outer_options(flags, said, capsys):
    assert main(["peer", *flags, str(SCRIPT), "--package", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_atomc_peer_hands_the_outer_options_to_the_script(capsys, monkeypatch):
    """`atomc peer --print` shows them as ATOMC_PEER_* variables, and examples/train_peer.py
    reads them from there as its defaults."""
    import shlex

    assert main(["peer", "--print", "--min-peers", "3", "--outer", "nesterov", "--outer-lr",
                 "0.5", "--outer-momentum", "0.8", "--inner-steps", "32", "--round-dtype",
                 "int8", "--fragments", "2", str(SCRIPT), "--package", "x"]) == 0
    words = shlex.split(capsys.readouterr().out)
    env = dict(w.split("=", 1) for w in words if w.startswith("ATOMC_PEER_"))
    assert {k: env[k] for k in env if k != "ATOMC_PEER_RUN_ID" and k != "ATOMC_PEER_INITIAL_PEERS"
            } == {"ATOMC_PEER_MIN_PEERS": "3", "ATOMC_PEER_OUTER": "nesterov",
                  "ATOMC_PEER_OUTER_LR": "0.5", "ATOMC_PEER_OUTER_MOMENTUM": "0.8",
                  "ATOMC_PEER_INNER_STEPS": "32", "ATOMC_PEER_ROUND_DTYPE": "int8",
                  "ATOMC_PEER_FRAGMENTS": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sys.path.insert(0, str(SCRIPT.parent))
    import train_peer

    a = train_peer.parse_args(["--package", "x"])
    assert (a.min_peers, a.outer, a.outer_lr, a.outer_momentum, a.inner_steps, a.round_dtype,
            a.fragments) == (3, "nesterov", 0.5, 0.8, 32, "int8", 2)


def test_more_fragments_than_sub_models_is_one_line(tiny_pkg):
    """Checked against the package before the peer network starts."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--package", str(tiny_pkg), "--name", "p",
                        "--fragments", "4", "--outer", "nesterov"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert lines == [("train_peer (p): error: --fragments 4 is more than the package's 3 "
                      "sub-models; a fragment is one or more whole sub-models: give at most 3")]


# ---- atomc compare --modes diloco ----------------------------------------------------------------


@pytest.fixture(scope="module")
def profile():
    traced = trace_model(GPT, "mini", 2, runs_on=runs_on_for(HW))
    return profile_model(traced, target=HW)


def network(n: int, gbps: float) -> Network:
    devices = tuple(Device(f"g{i}", "host", HW, 2 << 30) for i in range(n))
    return Network(devices=devices, delay_ms=tuple((0.0,) * n for _ in range(n)),
                   bandwidth_gbps=tuple((gbps,) * n for _ in range(n)), name="n").check()


def diloco(profile, net, **kw):
    models = hardware_models([profile], machines_of(net))
    setting = Setting(global_batch=4 * 8, accum=4, matchmaking_s=0.0, progress_lag_s=0.0, **kw)
    return compare([profile], net, setting, modes=("peers", "diloco"), models=models), models


def test_diloco_on_a_free_link_is_h_local_steps(profile):
    net = network(4, 1e12)
    c, models = diloco(profile, net, inner_steps=8)
    r = c.results["diloco"]
    hm = models[HW]
    step = hm.peer_plan(2 << 30, 4).step_ns
    assert abs(r.detail["cycle_ns"] - 8 * step) <= 64  # a few nanoseconds a message
    assert r.detail["cycle_samples"] == 4 * 8 * 4 * 2
    assert r.step_ns == round(r.detail["cycle_ns"] * 32 / r.detail["cycle_samples"])
    assert r.detail["utilization"] == pytest.approx(1.0, abs=1e-6)


def test_diloco_bytes_are_the_codec_s_parts(profile):
    """Every link carries, each round, the parts hivemind's butterfly sends it (mean over the
    group orders), at the round dtype's bytes; int8 is about a quarter of float32; bytes per
    token against data parallelism: H = 8 rounds of int8 are under 1/(8 x 3.9)."""
    net = network(4, 0.1)
    c32, _ = diloco(profile, net, inner_steps=8)
    c8, _ = diloco(profile, net, inner_steps=8, round_dtype="int8")
    r32, r8 = c32.results["diloco"], c8.results["diloco"]
    for r, dtype in ((r32, None), (r8, "int8")):  # all members send 2 (n - 1) x the parts
        total = sum(sum(s) for s in round_shares(r.detail["round_values"], 4, dtype, 4, 1 << 19))
        assert sum(r.detail["round_bytes_per_peer"].values()) == pytest.approx(2 * 3 * total)
    ratio = (sum(r8.detail["round_bytes_per_peer"].values())
             / sum(r32.detail["round_bytes_per_peer"].values()))
    assert 0.24 < ratio < 0.27
    assert r8.detail["vs_dp"] < 1 / (8 * 3.9)
    assert r8.step_ns < r32.step_ns


def test_fragments_hide_a_round_shorter_than_their_steps(profile):
    """K fragments, nothing waiting but the link: a pass takes K x max(H/K local steps, one
    round), the round running beside the next steps."""
    hm_net = network(2, 1e12)
    _, models = diloco(profile, hm_net, inner_steps=8)
    step = models[HW].peer_plan(2 << 30, 4).step_ns
    for gbps in (10.0, 0.001):
        c, _ = diloco(profile, network(2, gbps), inner_steps=8, fragments=2)
        r = c.results["diloco"]
        assert r.detail["cycle_ns"] == pytest.approx(2 * max(4 * step, r.detail["round_ns"]),
                                                     rel=1e-6)


@pytest.mark.parametrize("round_dtype", [None, "int8"])
def test_a_slow_link_s_round_is_its_bytes_over_the_bandwidth(profile, round_dtype):
    """Two peers, nothing to wait for but the link (1.25 MB/s): a round sends each member's copy
    of the other's half and brings the averaged half back, the vector's wire bytes S each way,
    so it takes S/B, later by at most the stream window and a part; a pass is H local steps
    and the round; the compute utilization, the communication share and the bytes per token
    against data parallelism's (2 (n - 1) / n of the fp32 gradients a step, the vector's raw
    bytes for n = 2) follow by hand."""
    h, bps = 8, 1.25e6
    c, models = diloco(profile, network(2, bps * 8 / 1e9), inner_steps=h,
                       round_dtype=round_dtype)
    d = c.results["diloco"].detail
    width = d["round_values"]
    assert width == models[HW].master_bytes // 4  # one fragment: every master
    wire = (width + 4 * math.ceil(width / 1024)) if round_dtype else 4 * width
    ideal = wire / bps * 1e9
    assert ideal <= d["round_ns"] <= ideal + ((256 << 10) + (1 << 19)) / bps * 1e9
    step = models[HW].peer_plan(2 << 30, 4).step_ns
    assert d["cycle_ns"] == pytest.approx(h * step + d["round_ns"], abs=64)
    assert d["communication_share"] == pytest.approx(d["round_ns"] / d["cycle_ns"], rel=1e-6)
    assert d["utilization"] == pytest.approx(h * step / d["cycle_ns"], rel=1e-6)
    sent = sum(d["round_bytes_per_peer"].values()) / 2  # a member's, each round
    assert sent == pytest.approx(wire, rel=1e-3)  # plus int8's 4-byte header a part
    assert d["vs_dp"] == pytest.approx(wire / (4 * width) / h, rel=1e-3)


def test_compare_reports_utilization_share_and_bytes_per_token(profile, tmp_path, capsys):
    """The table's DiLoCo row says what decentralized runs report, the numbers of --json."""
    import json

    path = profile.save(tmp_path / "mini.profile.json")
    (tmp_path / "net.json").write_text(json.dumps(network(4, 0.05).to_json()))
    out = tmp_path / "c.json"
    assert main(["compare", str(path), "--network", str(tmp_path / "net.json"),
                 "--global-batch", "32", "--accum", "4", "--modes", "peers,diloco",
                 "--inner-steps", "32", "--round-dtype", "int8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())["modes"]["diloco"]["detail"]
    assert 0 < d["communication_share"] < 1 and 0 < d["utilization"] < 1
    assert d["vs_dp"] == pytest.approx(d["bytes_per_token"] / d["dp_bytes_per_token"])
    line = next(x for x in text.splitlines() if "of data parallelism's" in x
                and "communication" in x)
    assert (f"compute utilization {d['utilization']:.0%}; communication "
            f"{d['communication_share']:.0%} of the wall time; ") in line
    assert f"{d['vs_dp']:.2%} of data parallelism's" in line
    assert "H=32, int8 rounds of 1 fragment(s)" in text and "DiLoCo peers" in text


@pytest.mark.parametrize(("flags", "said"), [
    (["--modes", "diloco", "--inner-steps", "0"], "--inner-steps 0: a round needs"),
    (["--modes", "diloco", "--fragments", "9"], "--fragments 9 is more than the 4 sub-models"),
    (["--inner-steps", "8"], ("--inner-steps set DiLoCo's rounds, but --modes does not name "
                              "diloco")),
])
def test_compare_refuses_bad_diloco_options(profile, tmp_path, capsys, flags, said):
    import json

    path = profile.save(tmp_path / "mini.profile.json")
    (tmp_path / "net.json").write_text(json.dumps(network(4, 0.1).to_json()))
    assert main(["compare", str(path), "--network", str(tmp_path / "net.json"),
                 "--global-batch", "32", "--accum", "4", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


# ---- host memory -----------------------------------------------------------------------------


def test_peer_host_bytes_count_the_outer_state_and_refuse_in_one_line():
    from atomc.distributed.outer import check_host_bytes, peer_host_bytes

    n, frag, buffers, state = 1_000_000, 400_000, 10, 12_000_000
    plain = peer_host_bytes(n, frag, buffers, "float32", state, OuterConfig())
    assert plain == {"averaged_weights": 4_000_040, "shared_state": state, "outer_state": 0,
                     "round_buffers": 0}
    cfg = OuterConfig.make("nesterov", round_dtype="int8", fragments=2)
    diloco = peer_host_bytes(n, frag, buffers, "float32", state, cfg)
    # start weights and momentum; their copy for joining peers; the round's tensor (the largest
    # fragment and the buffers) with the pseudo-gradient and the weights at launch
    assert diloco == {"averaged_weights": 4_000_040, "shared_state": state + 8_000_000,
                      "outer_state": 8_000_000, "round_buffers": 400_010 * 4 + 2 * 1_600_000}
    check_host_bytes(diloco, sum(diloco.values()))
    check_host_bytes(diloco, None)  # no figure on this system: not checked
    with pytest.raises(UsageError) as e:
        check_host_bytes(diloco, 10_000_000)
    said = str(e.value)
    assert "\n" not in said and said.startswith("atomc peer: host memory: the peer needs")
    assert "outer state (start weights, momentum)" in said and "--fragments K" in said


# ---- the outer state on the offload drives ----------------------------------------------------


@pytest.mark.parametrize(("outer", "dtype"), [("nesterov", torch.float64),
                                              ("nesterov", torch.float32), ("sgd", torch.float64)])
def test_outer_state_on_disk_steps_as_in_memory_bit_for_bit(tmp_path, outer, dtype):
    """DiskOuterOptimizer (one record a fragment on the drives) against OuterOptimizer: the
    same steps, resets and pseudo-gradients, every bit, and the same state for joining peers
    either way; its files are gone once closed."""
    from atomc.distributed.outer import DiskOuterOptimizer, OuterOptimizer
    from atomc.runtime.disk import check_dirs

    g = torch.Generator().manual_seed(5)
    starts = [torch.randn(n, generator=g, dtype=dtype) for n in (1000, 37, 4096)]
    cfg = OuterConfig.make(outer, momentum=0.0 if outer == "sgd" else None)
    drives = check_dirs([tmp_path], 1)
    ram, disk = OuterOptimizer(starts, cfg), DiskOuterOptimizer(starts, cfg, drives)
    try:
        per_value = dtype.itemsize * (2 if outer == "nesterov" else 1)
        assert disk.disk_bytes >= sum(s.numel() for s in starts) * per_value
        assert len(list(tmp_path.glob("atomc-run-*/*"))) == len(starts)
        for r in range(4):
            f = r % len(starts)
            now = starts[f] + 0.01 * torch.randn(starts[f].shape, generator=g, dtype=dtype)
            assert torch.equal(ram.pseudo_gradient(f, now), disk.pseudo_gradient(f, now))
            avg = torch.randn(starts[f].shape, generator=g, dtype=dtype)
            assert torch.equal(ram.step(f, avg), disk.step(f, avg))
            if r == 2:
                ram.reset(f, now)
                disk.reset(f, now)
        a, b = ram.state_dict(), disk.state_dict()
        assert all(torch.equal(x, y) for x, y in zip(a["starts"], b["starts"]))
        assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
        assert a["opt"]["state"].keys() == b["opt"]["state"].keys()
        for k, v in a["opt"]["state"].items():
            assert torch.equal(v["momentum_buffer"], b["opt"]["state"][k]["momentum_buffer"])
        # a joining peer with its state on disk takes the state of one without, and steps on
        joined = DiskOuterOptimizer([torch.zeros_like(s) for s in starts], cfg, drives)
        try:
            joined.load_state_dict(a, "peer A's state")
            avg = torch.randn(starts[0].shape, generator=g, dtype=dtype)
            assert torch.equal(ram.step(0, avg), joined.step(0, avg))
        finally:
            joined.close()
        with pytest.raises(PeerError, match="fragments of other sizes"):
            disk.load_state_dict({"starts": a["starts"][:2], "opt": a["opt"]}, "peer B's state")
    finally:
        disk.close()
    assert not list(tmp_path.glob("atomc-run-*"))


def test_peer_host_bytes_hold_one_fragment_of_an_outer_state_on_disk():
    from atomc.distributed.outer import peer_host_bytes

    cfg = OuterConfig.make("nesterov", fragments=2)
    on_host = peer_host_bytes(1_000_000, 400_000, 0, "float32", 0, cfg)
    on_disk = peer_host_bytes(1_000_000, 400_000, 0, "float32", 0, cfg, outer_on_disk=True)
    assert on_host["outer_state"] == 8_000_000 and on_disk["outer_state"] == 3_200_000
    # the copy a joining peer downloads is made whole either way
    assert on_disk["shared_state"] == on_host["shared_state"] == 8_000_000


@pytest.mark.parametrize("cfg", [OuterConfig(), OuterConfig.make("nesterov", fragments=2),
                                 OuterConfig.make("nesterov", round_dtype="int8", fragments=3)])
def test_compare_counts_a_peer_s_host_bytes_as_atomc_peer_does(tiny_pkg, cfg):
    """The sizes compare reads from a plan (peer_side_bytes) are the ones `atomc peer` reads
    from its running trainer (PeerTrainer._check_host), kind by kind."""
    from types import SimpleNamespace

    from atomc.codegen.manual import plan_from_cuts
    from atomc.compare.peers import peer_side_bytes
    from atomc.distributed.diloco import fragment_widths, master_sizes
    from atomc.distributed.outer import peer_host_bytes
    from atomc.runtime import SwapTrainer

    traced = trace_model(GPT, "tiny", 2)
    plan = plan_from_cuts(traced, [9, 39])
    model = SimpleNamespace(profile=SimpleNamespace(graph=traced.graph), master_value_bytes=4)
    tr = SwapTrainer.from_package(tiny_pkg, device="cpu", accum=2, seed=0, dtype="float32")
    try:
        tr.step([torch.randint(0, 64, (2, 16)) for _ in range(2)])  # the moments exist
        sizes = master_sizes(tr)
        states = [s for sub in tr.optimizer.state_dict() for s in sub["state"].values()]
        counters = sum(s["step"].numel() * s["step"].element_size() for s in states)
        state = sum(sizes) * 4 + sum(t.numel() * t.element_size() for s in states
                                     for t in s.values())
        width, buffers = fragment_widths(tr, fragments_of(sizes, cfg.fragments))
        expect = peer_host_bytes(sum(sizes), width, buffers, "float32", state, cfg)
    finally:
        tr.close()
    # compare leaves out AdamW's step counters, a scalar a weight tensor
    expect["shared_state"] -= counters
    assert 0 < counters < 1e-3 * sum(expect.values())
    assert peer_side_bytes(model, plan, cfg) == expect


def test_compare_s_peers_count_what_they_keep_beside_the_trainer(profile):
    """A peer's host bytes in compare are its trainer's plan and what the peer keeps beside it;
    DiLoCo's outer state makes the same devices' peers need more, and a host between the two
    figures takes ATOM's peers and refuses DiLoCo's in one line that names the outer state."""
    from atomc.compare.peers import peer_side_bytes

    c, models = diloco(profile, network(2, 1.0), inner_steps=8)
    hm = models[HW]
    pp = hm.peer_plan(2 << 30, 4)
    atom = c.results["peers"].detail["host_bytes"]["g0"]
    dl = c.results["diloco"].detail["host_bytes"]["g0"]
    side = sum(peer_side_bytes(hm, pp.plan, OuterConfig()).values())
    assert atom == pp.host_bytes + side > pp.host_bytes
    # the start weights and the momentum, their copy for joining peers, and the round's tensor,
    # pseudo-gradient and weights at launch (one fragment: every master; the model has no
    # buffers)
    assert dl - atom == (2 + 2 + 3) * hm.master_bytes
    between = (atom + dl) // 2
    setting = Setting(global_batch=4 * 8, accum=4, matchmaking_s=0.0, progress_lag_s=0.0,
                      inner_steps=8)
    c2 = compare([profile], network(2, 1.0), setting, modes=("peers", "diloco"),
                 models=models, host_memory=[between, between])
    assert c2.results["peers"].feasible
    r = c2.results["diloco"]
    assert not r.feasible
    assert "outer state" in r.reason and str(between) in r.reason and "\n" not in r.reason
