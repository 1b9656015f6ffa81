"""Mixed-precision plans: the device's bytes at a transfer and autocast dtype, plans for them,
and the options' errors.

- the autocast op lists equal the installed torch's (torch/include/ATen/autocast_mode.h);
- the propagated dtypes equal what torch computes under autocast, for ops whose CPU and CUDA
  lists agree (CPU autocast runs here; tests/gpu checks every op on CUDA);
- half-precision weights halve parameter, gradient and load costs (norm weights stay float32),
  autocast shrinks activations, and the plan records the dtypes;
- half-precision plans: the search equals brute force over the device's bytes and every plan
  passes the independent checker;
- bad dtypes and profiles without the throughput give one clear line.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomc.cli import main as atomc_main
from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import InfeasiblePlanError, UsageError
from atomc.partition import partition
from atomc.partition.autocast import FP32, LOWER, device_dtypes
from atomc.partition.check import check_plan
from atomc.partition.cost import CostParams
from atomc.partition.precision import Precision, device_view, resolve_precision
from atomc.partition.search import search
from atomc.partition.tables import build_tables, node_facts
from atomc.profile import profile_model
from atomc.runtime import SwapTrainer
from atomc.trace import trace_model

from helpers.brute_force import brute_force
from synthetic import MB, random_profile

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def gpt_estimated():
    return profile_model(trace_model(GPT, "mini", 1), target="rtx-3090", progress=False)


# ---------------------------------------------------------------------------------------------
# the autocast rule


def _header_lists() -> dict[str, set[str]]:
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("this torch ships no ATen headers")
    text = header.read_text()
    out = {}
    for name in ("AT_FORALL_LOWER_PRECISION_FP", "AT_FORALL_FP32", "AT_FORALL_FP32_SET_OPT_DTYPE"):
        body = re.search(rf"#define {name}\(_\)(.*?)\n\n", text, re.S)
        assert body, name
        out[name] = set(re.findall(r"_\((\w+)", body.group(1)))
    return out


def test_autocast_lists_are_the_installed_torchs():
    lists = _header_lists()
    assert lists["AT_FORALL_LOWER_PRECISION_FP"] == LOWER
    assert lists["AT_FORALL_FP32"] | lists["AT_FORALL_FP32_SET_OPT_DTYPE"] | {"norm"} == FP32


def _torch_dtypes(traced, dtype: torch.dtype) -> list[tuple[str, ...]]:
    """Every node's output dtypes when the traced graph runs with `dtype` weights under CPU
    autocast to `dtype`."""
    gm = traced.gm.to(dtype)
    seen: dict[str, tuple[str, ...]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            leaves = torch.utils._pytree.tree_leaves(out)
            seen[n.name] = tuple(str(t.dtype).removeprefix("torch.") for t in leaves
                                 if isinstance(t, torch.Tensor))
            return out

    with torch.autocast("cpu", dtype=dtype):
        Recorder(gm).run(*traced.inputs)
    return [seen.get(n.name, ()) for n in traced.graph.nodes]


MLP_CNN = '''
import torch
from torch import nn


class Net(nn.Module):  # the name of an input class: atomc traces it from this file
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.nn.functional.gelu(self.fc1(h))
        h = h + torch.tanh(self.fc2(h))  # a residual add of two half values
        mask = (h > 0).float()  # an explicit cast from bool
        return self.head(h * mask) + x.mean()  # a 0-dim float32 value does not promote


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)
'''


def test_propagated_dtypes_equal_torchs_under_autocast(tmp_path):
    """Convolutions, linears, elementwise ops, a cast and promotion with a float32 value, half
    weights: ops whose autocast behaviour CPU and CUDA share (tests/gpu checks CUDA)."""
    path = tmp_path / "mlp_cnn.py"
    path.write_text(MLP_CNN)
    traced = trace_model(path, None, 2, device="cpu")
    graph = traced.graph
    params = dict.fromkeys(graph.params, "bfloat16")
    predicted = device_dtypes(graph, params, "bfloat16")
    assert predicted[:-1] == _torch_dtypes(traced, torch.bfloat16)[:-1]  # the output node has none
    names = [n.name for n in graph.nodes]
    assert predicted[names.index("conv")] == ("bfloat16",)
    assert predicted[names.index("mul")] == ("float32",)  # half values times a float32 mask
    assert predicted[names.index("add_1")] == ("bfloat16",)  # a 0-dim float32 mean: no promotion


def test_gpt_values_under_autocast(gpt_estimated):
    """CUDA's rule on GPT: linears and attention in the autocast dtype, layer norms in float32;
    with float32 weights the residual stream stays float32 (embeddings are float32)."""
    graph = gpt_estimated.graph
    by_type = {}
    for half_weights in (True, False):
        params = {f: ("bfloat16" if half_weights and f not in graph.full_precision else "float32")
                  for f in graph.params}
        dtypes = device_dtypes(graph, params, "bfloat16")
        by_type[half_weights] = {(n.module_type, d) for n, d in zip(graph.nodes, dtypes)
                                 if n.op == "call_module"}
    assert ("Linear", ("bfloat16",)) in by_type[True]
    assert ("LayerNorm", ("float32",)) in by_type[True]
    assert ("Embedding", ("bfloat16",)) in by_type[True]
    assert ("Embedding", ("float32",)) in by_type[False]
    assert ("Linear", ("bfloat16",)) in by_type[False]


def test_device_view_bytes(gpt_estimated):
    profile = gpt_estimated
    g = profile.graph
    view = device_view(profile, Precision("bfloat16", "bfloat16"))
    assert g.full_precision and all("ln" in f for f in g.full_precision)
    for fqn, spec in g.params.items():
        half = fqn not in g.full_precision
        assert view.graph.params[fqn].num_bytes == spec.num_bytes // (2 if half else 1)
    assert view.graph.structure_hash() != g.structure_hash()
    same = device_view(profile, Precision("float32"))
    assert same is profile  # nothing changes: the profile itself
    # activations: every linear's output and saved bytes halve
    for n, n2, c, c2 in zip(g.nodes, view.graph.nodes, profile.costs, view.costs):
        if n.module_type == "Linear":
            assert n2.outputs[0].num_bytes * 2 == n.outputs[0].num_bytes
            assert abs(c2.saved_bytes * 2 - c.saved_bytes) <= 1


# ---------------------------------------------------------------------------------------------
# plans


def test_half_plan_halves_weights_and_records_dtypes(gpt_estimated, tmp_path):
    usable = 64 * MB
    full = partition(gpt_estimated, usable, reserve_bytes=0, accum=2, cpu_adam_gbps=8.0,
                     transfer_dtype="float32", autocast="bfloat16")
    half = partition(gpt_estimated, usable, reserve_bytes=0, accum=2, cpu_adam_gbps=8.0,
                     transfer_dtype="bfloat16")
    assert (half.transfer_dtype, half.autocast) == ("bfloat16", "bfloat16")
    assert (full.transfer_dtype, full.autocast) == ("float32", "bfloat16")
    total = {p.transfer_dtype: sum(s.param_bytes for s in p.submodels) for p in (full, half)}
    assert total["bfloat16"] < 0.55 * total["float32"]
    assert half.predicted_step_ms <= full.predicted_step_ms
    for plan in (full, half):
        problems = check_plan(gpt_estimated, plan)
        assert not [v for v in problems if v.constraint in ("structure", "recorded", "memory")]
    # the CPU update still reads float32 masters: the same optimizer time per parameter
    opt = {p.transfer_dtype: sum(s.optimizer_ms for s in p.submodels) for p in (full, half)}
    assert opt["bfloat16"] == pytest.approx(opt["float32"], rel=1e-6)
    half.save(tmp_path / "p.json")
    again = type(half).load(tmp_path / "p.json")
    assert (again.transfer_dtype, again.autocast) == ("bfloat16", "bfloat16")


def _half_case(seed: int):
    """A random graph whose operators are linears (they compute in the autocast dtype) fed by
    integer ids, so autocast changes activations as well as weights."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(3, 10))
    g = profile.graph
    nodes = []
    for n in g.nodes:
        if n.op == "placeholder":
            out = tuple(dataclasses.replace(o, dtype="int64") for o in n.outputs)
            n = dataclasses.replace(n, outputs=out)
        elif n.op != "output" and rng.random() < 0.7:
            n = dataclasses.replace(n, module_type="Linear")
        nodes.append(n)
    profile = dataclasses.replace(profile, graph=dataclasses.replace(g, nodes=tuple(nodes)))
    return (profile, rng.randint(1, 4), rng.randint(30, 300) * MB, rng.choice([8.0, 3.0, 0.0]),
            rng.choice(["recompute", "keep"]), rng.choice(["bfloat16", "float16"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**9))
def test_half_search_matches_brute_force_and_the_checker(seed):
    profile, accum, usable, cpu, activations, dtype = _half_case(seed)
    view = device_view(profile, resolve_precision(profile, dtype))
    assert sum(s.num_bytes for s in view.graph.params.values()) * 2 == \
        sum(s.num_bytes for s in profile.graph.params.values())
    facts = node_facts(view)
    params = CostParams(accum, usable, view.h2d_gbps, view.d2h_gbps, cpu, activations)
    tables = build_tables(facts, facts.num_nodes)
    for tier in (0, 2):
        got = search(tables, params, tier)
        assert (got.objective if got else None) == brute_force(view, accum, usable, tier, cpu,
                                                               activations)
    try:
        plan = partition(profile, usable, reserve_bytes=0, accum=accum, cpu_adam_gbps=cpu,
                         activations=activations, transfer_dtype=dtype)
    except InfeasiblePlanError:
        return
    assert plan.transfer_dtype == dtype
    problems = check_plan(profile, plan)
    assert not [v for v in problems if v.constraint in ("structure", "recorded", "memory")]
    assert plan.feasible == (not problems)


# ---------------------------------------------------------------------------------------------
# options and their errors


def test_defaults_follow_the_profile(gpt_estimated):
    assert resolve_precision(gpt_estimated) == Precision("float32", "bfloat16")
    assert resolve_precision(gpt_estimated, "bf16") == Precision("bfloat16", "bfloat16")
    assert resolve_precision(gpt_estimated, autocast="bfloat16").autocast == "bfloat16"


@pytest.mark.parametrize("options, message", [
    ({"transfer_dtype": "fp8"}, "is not a training dtype; choose one of float32"),
    ({"transfer_dtype": "float64"}, "wider than the model's float32 weights"),
    ({"transfer_dtype": "float16"}, "estimated for bfloat16 compute"),
    ({"transfer_dtype": "bfloat16", "autocast": "none"}, "computed under autocast"),
    ({"autocast": "float64"}, "autocast computes in float16 or bfloat16"),
])
def test_bad_precision_options(gpt_estimated, options, message):
    with pytest.raises(UsageError, match=message):
        resolve_precision(gpt_estimated, **options)


def test_missing_throughput_names_the_alternative():
    graph = trace_model(GPT, "tiny", 1)
    v100 = profile_model(graph, target="v100-32gb", progress=False)
    with pytest.raises(UsageError, match=r"v100-32gb has no bfloat16 throughput.*"
                                         r"--transfer-dtype float16"):
        resolve_precision(v100, "bfloat16")
    assert resolve_precision(v100, "float16") == Precision("float16", "float16")
    pascal = profile_model(graph, target="gtx-1080-ti", compute_dtype="float32", progress=False)
    if "float16" not in pascal.hardware.peak_tflops:
        with pytest.raises(UsageError, match=r"no float16 throughput.*--transfer-dtype float32"):
            resolve_precision(pascal, "float16")


def test_measured_profile_notes_the_compute_dtype_it_was_timed_in():
    profile = profile_model(trace_model(GPT, "tiny", 1), device="cpu", repeats=1,
                            progress=False)
    precision = resolve_precision(profile, "bfloat16")
    assert precision.notes and "measured in float32" in precision.notes[0]
    plan = partition(profile, 1 << 30, reserve_bytes=0, cpu_adam_gbps=8.0,
                     transfer_dtype="bfloat16")
    assert any("measured in float32" in n for n in plan.notes)


def test_cli_unknown_dtype_is_one_line(tmp_path, capsys, gpt_estimated):
    path = tmp_path / "p.profile.json"
    gpt_estimated.save(path)
    rc = atomc_main(["partition", str(path), "--gpu-mem", "2GiB", "--transfer-dtype", "fp8",
                     "--cpu-adam-gbps", "8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "float16" in err and "Traceback" not in err
    rc = atomc_main(["partition", str(path), "--gpu-mem", "2GiB", "--transfer-dtype", "bf16",
                     "--cpu-adam-gbps", "8", "-o", str(tmp_path / "plan.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "weights and gradients bfloat16 on the GPU, compute autocast bfloat16" in out


def test_runtime_holds_a_run_to_the_planned_dtypes():
    from atomc.runtime.config import TrainerConfig
    from atomc.runtime.package import PackagePlan

    half = PackagePlan(transfer_dtype="bfloat16", autocast="bfloat16")
    assert TrainerConfig().dtypes_for(torch.float32, half) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(UsageError, match="planned for bfloat16 weights"):
        TrainerConfig(transfer_dtype="float32").dtypes_for(torch.float32, half)
    with pytest.raises(UsageError, match="sized for autocast bfloat16"):
        TrainerConfig(autocast="float16").dtypes_for(torch.float32, half)
    full = PackagePlan(transfer_dtype="float32", autocast="")
    assert TrainerConfig().dtypes_for(torch.float64, full) == (torch.float64, None)
    with pytest.raises(UsageError, match=r"planned for float32 weights.*--transfer-dtype bfloat16"):
        TrainerConfig(transfer_dtype="bf16").dtypes_for(torch.float32, full)
    with pytest.raises(UsageError, match=r"sized for no autocast.*--autocast bfloat16"):
        TrainerConfig(autocast="bf16").dtypes_for(torch.float32, full)
    mixed = PackagePlan(transfer_dtype="float32", autocast="float16")
    assert TrainerConfig().dtypes_for(torch.float32, mixed) == (torch.float32, torch.float16)
    # a hand-made plan or an older package records no dtypes: nothing to hold the run to
    assert TrainerConfig(transfer_dtype="bf16").dtypes_for(torch.float32, PackagePlan()) == \
        (torch.bfloat16, torch.bfloat16)


CASTS_AND_NORMS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 32)
        self.weight = nn.Parameter(torch.ones(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        h = self.fc(h)
        dtype = h.dtype
        v = h.to(torch.float32)  # as Hugging Face's RMS norms do: a no-op in the trace
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(self.weight * v.to(dtype))


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)
'''


def test_constant_casts_hold_and_batch_norm_keeps_its_input_dtype(tmp_path):
    """`.to(torch.float32)` of a value traced in float32 still casts when autocast makes it
    half (the graph holds the dtype as a constant), and batch norm's output keeps its half
    input's dtype beside float32 weights (on no autocast list; tests/gpu checks both)."""
    path = tmp_path / "casts.py"
    path.write_text(CASTS_AND_NORMS)
    traced = trace_model(path, None, 2, device="cpu")
    graph = traced.graph
    names = [n.name for n in graph.nodes]
    casts = [n for n in graph.nodes if n.cast_to]
    assert casts and all(n.cast_to == "float32" for n in casts)
    wide = set(graph.full_precision)
    assert wide  # the batch norm's weights stay float32
    params = {f: ("float32" if f in wide else "bfloat16") for f in graph.params}
    predicted = device_dtypes(graph, params, "bfloat16")
    after_fc = names.index(next(n.name for n in graph.nodes if "fc" in n.module_fqn
                                and n.op != "get_attr"))
    for n in casts:  # the first cast follows a half linear, and casts it to float32
        assert predicted[names.index(n.name)] == ("float32",)
        assert names.index(n.name) > after_fc
    bn = next(i for i, n in enumerate(graph.nodes) if n.module_fqn == "bn" and n.op != "get_attr"
              and n.outputs)
    assert predicted[bn][0] == "bfloat16"
    assert all(d == "float32" for d in predicted[bn][1:])  # statistics, where returned


STATISTICS_OF_WEIGHTS = '''
import torch
import torch.nn.functional as F
from torch import nn


class StandardizedConv(nn.Conv2d):
    """BiT's convolution: its weight standardized per output channel by a batch norm; NFNet's
    also scales it by a gain, the batch norm's weight."""

    def __init__(self, *args, gain=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1)) if gain else None

    def forward(self, x):
        scale = None if self.gain is None else (self.gain * 0.5).view(-1)
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                         weight=scale, training=True, momentum=0.0,
                         eps=1e-8).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, padding=1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = StandardizedConv(3, 8, 3, padding=1)
        self.scaled = StandardizedConv(8, 8, 3, padding=1, gain=True)
        self.plain = nn.Conv2d(8, 8, 3, padding=1)
        self.classes = nn.Parameter(torch.randn(10, 8))  # a cosine classifier's

    def forward(self, x):
        h = self.plain(torch.relu(self.scaled(torch.relu(self.conv(x))))).mean((2, 3))
        return F.normalize(h, dim=-1) @ F.normalize(self.classes.t().contiguous(), dim=0)


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)
'''


def test_weights_the_graph_takes_statistics_of_stay_float32(tmp_path):
    """Weight standardization and a normalized weight: autocast takes those statistics in
    float32 (the weight stays float32), so a half-precision plan keeps such weights float32
    too; a plain convolution's weight goes half."""
    path = tmp_path / "stats.py"
    path.write_text(STATISTICS_OF_WEIGHTS)
    wide = set(trace_model(path, None, 2, device="cpu").graph.full_precision)
    assert {"conv.weight", "classes", "scaled.weight", "scaled.gain"} <= wide
    assert not wide & {"conv.bias", "scaled.bias", "plain.weight", "plain.bias"}


def test_a_bfloat16_package_standardizes_weights_scaled_by_their_gain(tmp_path):
    """NFNet's convolutions in a bfloat16 plan: the standardized weight and the gain that
    scales it meet in one float32 batch norm (a bfloat16 gain stopped the CPU's)."""
    path = tmp_path / "stats.py"
    path.write_text(STATISTICS_OF_WEIGHTS)
    traced = trace_model(path, None, 2, device="cpu")
    n = len(traced.graph.nodes)
    plan = dataclasses.replace(plan_from_cuts(traced, [n // 3, 2 * n // 3]),
                               transfer_dtype="bfloat16", autocast="bfloat16")
    pkg = generate(plan, tmp_path / "pkg", traced=traced)
    torch.manual_seed(0)
    trainer = SwapTrainer.from_package(pkg, device="cpu",
                                       state_dict=traced.module.build_model().state_dict(),
                                       loss_fn=lambda out, batch: out.float().pow(2).mean())
    loss = trainer.step((torch.randn(2, 3, 8, 8),))
    assert torch.isfinite(torch.tensor(loss))
    trainer.close()
