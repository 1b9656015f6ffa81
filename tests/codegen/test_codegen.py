"""Codegen: generated sub-models reproduce the original model; the package keeps its contract.

Equivalence is checked against the unpartitioned model in float64 (1e-10) and float32 (1e-6):
outputs and every parameter's gradient (a tied weight's gradient is the sum over its holders).
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

from atomc.cli import main as atomc_main
from atomc.codegen import emit_plan, generate, load_package
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import CodegenError, TraceError, UsageError
from atomc.ir import Plan
from atomc.profile import profile_model
from atomc.trace import trace_model

from helpers.detached import run_detached

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt.py"
MODELS = REPO / "tests" / "models"
GOLDEN = REPO / "tests" / "golden"

_TRACES: dict = {}


def traced(path: Path, config: str | None = None, batch_size: int = 2, frontend: str = "auto"):
    """Trace on CPU (real weights) once per model; tests share it read-only."""
    key = (str(path), config, batch_size, frontend)
    if key not in _TRACES:
        _TRACES[key] = trace_model(path, config, batch_size, device="cpu", frontend=frontend)
    return _TRACES[key]


def cuts_at(t, *names: str) -> list[int]:
    index = {n.name: i for i, n in enumerate(t.gm.graph.nodes)}
    return [index[name] for name in names]


def build_package(t, cuts: list[int], out: Path, profile=None):
    plan = plan_from_cuts(profile if profile is not None else t, cuts)
    generate(plan, out, traced=t)
    return plan, load_package(out)


def run_chain(package, submodels, inputs):
    values = inputs
    for sub in submodels[:-1]:
        values = sub(*values)
        assert isinstance(values, tuple) and len(values) == len(type(sub).OUTPUTS)
    return submodels[-1](*values)


def assert_equivalent(t, package, dtype: torch.dtype, tol: float, seed: int = 0) -> None:
    """Sub-models run as the runtimes run them (helpers.detached) vs the original model:
    outputs and parameter gradients."""
    torch.manual_seed(seed)
    model = copy.deepcopy(t.model).to(dtype)
    submodels = [s.to(dtype) for s in package.build_submodels()]
    unused = package.load_original_state_dict(submodels, model.state_dict())
    assert unused == []
    package.tie_parameters(submodels)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in t.inputs)
    loss_fn = t.module.loss_fn

    expected = model(*inputs)
    loss_fn(expected, inputs).backward()
    got, _ = run_detached(package, submodels, inputs, loss_fn)
    exp_leaves, exp_spec = tree_flatten(expected)
    got_leaves, got_spec = tree_flatten(got)
    assert exp_spec == got_spec
    for e, g in zip(exp_leaves, got_leaves):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)

    grads: dict[str, dict[int, torch.Tensor]] = {}
    for sub, names in zip(submodels, package.PARAM_NAMES):
        params = dict(sub.named_parameters())
        for local, fqn in names.items():
            if local in params:
                p = params[local]
                grads.setdefault(fqn, {})[id(p)] = p.grad
    for fqn, p in model.named_parameters():
        assert fqn in grads, f"{fqn} is in no sub-model"
        if not p.requires_grad:  # frozen in the model, frozen in its sub-models
            assert all(g is None for g in grads[fqn].values()), fqn
            continue
        total = sum(g for g in grads[fqn].values() if g is not None)
        torch.testing.assert_close(total, p.grad, rtol=tol, atol=tol, msg=f"gradient of {fqn}")


# ---------------------------------------------------------------------------------------------
# numerical equivalence

GPT_PLANS = {
    "one-cut-inside-block": ("h_0_attn_c_attn",),
    "block-boundaries": ("h_0_ln_1", "h_1_ln_1", "ln_f"),
    "many-small": ("drop", "h_0_attn_c_attn", "scaled_dot_product_attention", "add_1",
                   "h_0_mlp_c_proj", "h_1_ln_1", "view_7", "ln_f", "lm_head"),
    "whole-model": (),
    "device-and-size-cross": ("arange", "h_1_ln_1"),
}


@pytest.mark.parametrize("plan_name", sorted(GPT_PLANS))
def test_gpt_float64(tmp_path, plan_name):
    t = traced(GPT, "tiny")
    _, package = build_package(t, cuts_at(t, *GPT_PLANS[plan_name]), tmp_path / "pkg")
    assert len(package.SUBMODELS) == len(GPT_PLANS[plan_name]) + 1
    assert_equivalent(t, package, torch.float64, 1e-10)
    if plan_name == "device-and-size-cross":
        assert package.BOUNDARIES[0]["outputs"]["idx_device"] == {"kind": "other"}  # a device
        assert package.BOUNDARIES[0]["outputs"]["idx_shape"] == {"kind": "int"}


def test_gpt_float32_with_profile(tmp_path):
    t = traced(GPT, "tiny")
    profile = profile_model(t, device="cpu", repeats=1, progress=False)
    plan, package = build_package(t, cuts_at(t, "h_0_mlp_c_fc", "h_1_ln_1"), tmp_path / "pkg",
                                  profile)
    assert all(s.fwd_ms > 0 and s.param_bytes > 0 for s in plan.submodels)
    assert plan.profile_hash == profile.content_hash()
    assert_equivalent(t, package, torch.float32, 1e-6)


def test_tied_embedding_split_across_submodels(tmp_path):
    t = traced(GPT, "tiny")
    _, package = build_package(t, cuts_at(t, "h_0_ln_1", "ln_f"), tmp_path / "pkg")
    holders = package.TIED["wte.weight"]
    assert [i for i, _ in holders] == [0, 2]
    assert package.ALIASES == {"lm_head.weight": "wte.weight"}
    submodels = package.build_submodels()
    package.tie_parameters(submodels)
    shared = [submodels[i].get_parameter(local) for i, local in holders]
    assert shared[0] is shared[1]
    params = {id(p) for s in submodels for p in s.parameters()}
    original = sum(1 for _ in traced(GPT, "tiny").model.parameters())  # tied weight counted once
    assert len(params) == original
    assert_equivalent(t, package, torch.float64, 1e-10)


def test_skip_connection_across_two_cuts(tmp_path):
    t = traced(MODELS / "skip.py", batch_size=3)
    _, package = build_package(t, cuts_at(t, "a_1", "b", "c"), tmp_path / "pkg")
    # `h` is produced in sub-model 0 and read in sub-model 3: passed through 1 and 2
    for i in range(3):
        assert "h" in package.SUBMODELS[i].OUTPUTS
    assert "h" in package.SUBMODELS[3].INPUTS
    assert [cls.OUTPUTS for cls in package.SUBMODELS] == [  # named as the model's code does
        ("h", "a"), ("h", "a_2"), ("h", "b"), ("out",)]
    # layer `a` runs in sub-models 0 and 1: its weights are tied between them
    assert package.TIED == {"a.weight": [(0, "a.weight"), (1, "a.weight")],
                            "a.bias": [(0, "a.bias"), (1, "a.bias")]}
    assert_equivalent(t, package, torch.float64, 1e-10)
    assert_equivalent(t, package, torch.float32, 1e-6)


def test_multiple_inputs_and_outputs(tmp_path):
    t = traced(MODELS / "multi_out.py", batch_size=4)
    _, package = build_package(t, cuts_at(t, "mid", "gelu", "head"), tmp_path / "pkg")
    assert package.MODEL_INPUTS == ("x", "scale")
    # `scale` is read only by the last sub-model, `features` is an output of the first
    assert "scale" in package.SUBMODELS[2].INPUTS and "features" in package.SUBMODELS[2].OUTPUTS
    assert set(package.SUBMODELS[3].OUTPUTS) == {"logits", "features", "mean", "amax"}
    # the in-place update whose result nothing reads is kept, as a statement
    assert ("        h.mul_(0.5)  # [4, 12] float32"
            in (tmp_path / "pkg" / "submodel_1.py").read_text())
    assert_equivalent(t, package, torch.float64, 1e-10)


def test_tied_weight_read_directly_and_free_parameters(tmp_path):
    t = traced(MODELS / "tied.py", batch_size=3)
    _, package = build_package(t, cuts_at(t, "body_1", "linear"), tmp_path / "pkg")
    assert package.TIED == {"emb.weight": [(0, "emb.weight"), (2, "emb_weight")]}
    assert "shift" in package.PARAM_NAMES[1].values()  # a buffer, loaded by name
    assert_equivalent(t, package, torch.float64, 1e-10)
    sub = package.build_submodels()[1]
    assert "shift" in dict(sub.named_buffers()) and "gain" in dict(sub.named_parameters())


def test_model_only_torch_export_can_trace(tmp_path):
    t = traced(MODELS / "export_only.py", batch_size=3)
    assert t.graph.frontend == "export"
    _, package = build_package(t, cuts_at(t, "sub", "relu"), tmp_path / "pkg")
    text = (tmp_path / "pkg" / "submodel_0.py").read_text()
    assert "self.l1 = nn.Linear(5, 10)" in text and "h = self.l1(x)" in text  # a layer again
    assert "torch.ops" not in text
    assert_equivalent(t, package, torch.float64, 1e-10)
    assert_equivalent(t, package, torch.float32, 1e-6)


def test_gpt_through_torch_export(tmp_path):
    t = traced(GPT, "tiny", frontend="export")
    assert t.graph.frontend == "export"
    _, package = build_package(t, cuts_at(t, "linear", "layer_norm_2"), tmp_path / "pkg")
    # export traced the layers through: they are layers again (dropout follows the mode)
    assert "self.resid_dropout = nn.Dropout(p=0.0)" in (tmp_path / "pkg" / "submodel_1.py"
                                                        ).read_text()
    assert package.TIED["wte.weight"] == [(0, "wte.weight"), (2, "lm_head.weight")]
    assert_equivalent(t, package, torch.float64, 1e-10)


@pytest.mark.parametrize(("frontend", "cuts"), [("fx", ("h_0_attn_c_attn", "h_1_ln_1")),
                                                 ("export", ("linear", "layer_norm_2"))])
def test_dropout_follows_the_training_mode(tmp_path, frontend, cuts):
    """Same seed, same random numbers in training mode (operators run in the traced order);
    no dropout in eval mode, although the trace (in training mode) baked dropout_p=0.1."""
    t = traced(GPT, "tiny-dropout", frontend=frontend)
    _, package = build_package(t, cuts_at(t, *cuts), tmp_path / "pkg")
    model = copy.deepcopy(t.model).double()
    submodels = [s.double() for s in package.build_submodels()]
    package.load_original_state_dict(submodels, model.state_dict())
    for training in (True, False):
        model.train(training)
        for sub in submodels:
            sub.train(training)
        torch.manual_seed(7)
        expected = model(*t.inputs)
        torch.manual_seed(7)
        got = run_chain(package, submodels, t.inputs)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert "if self.training else 0.0" in (tmp_path / "pkg" / "submodel_1.py").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize(("frontend", "cuts"), [("fx", ("h_0_attn_c_attn", "h_1_ln_1")),
                                                 ("export", ("linear", "layer_norm_2"))])
def test_runs_on_cuda(tmp_path, frontend, cuts):
    """Traced on meta (as `atomc profile` does), run on the GPU: devices follow the inputs."""
    t = trace_model(GPT, "tiny", 2, frontend=frontend)
    _, package = build_package(t, cuts_at(t, *cuts), tmp_path / "pkg")
    model = t.module.build_model("tiny").cuda()
    submodels = [s.cuda() for s in package.build_submodels()]
    package.load_original_state_dict(submodels, model.state_dict())
    package.tie_parameters(submodels)
    idx = torch.randint(0, 256, (2, 16), device="cuda")
    torch.testing.assert_close(run_chain(package, submodels, (idx,)), model(idx),
                               rtol=1e-5, atol=1e-5)


def test_helpers_are_copied(tmp_path):
    t = traced(MODELS / "helper.py", batch_size=3)
    _, package = build_package(t, cuts_at(t, "mix"), tmp_path / "pkg")
    helpers = (tmp_path / "pkg" / "_helpers.py").read_text()
    for name in ("def new_gelu", "def cube", "class Mixer", "class MixerConfig", "SQRT_2_OVER_PI =",
                 "import math"):
        assert name in helpers
    assert "def build_model" not in helpers and "class HelperNet" not in helpers
    sub1 = (tmp_path / "pkg" / "submodel_1.py").read_text()
    assert "Mixer(MixerConfig(width=16, scale=0.25))" in sub1
    assert "new_gelu_2 = new_gelu(" in sub1  # a value named like the helper is renamed
    assert_equivalent(t, package, torch.float64, 1e-10)


def test_runtime_style_detached_boundaries(tmp_path):
    """Each sub-model run alone on detached inputs, gradients handed back by name as the
    package's flags say (the runtimes' view: helpers.detached), gives the same parameter
    gradients as one autograd graph over the sub-models."""
    t = traced(MODELS / "skip.py", batch_size=3)
    _, package = build_package(t, cuts_at(t, "a_1", "c"), tmp_path / "pkg")
    inputs = tuple(x.double() for x in t.inputs)
    grads = []
    for detached in (False, True):
        submodels = [s.double() for s in package.build_submodels()]
        package.load_original_state_dict(submodels, copy.deepcopy(t.model).double().state_dict())
        if detached:
            run_detached(package, submodels, inputs, t.module.loss_fn)
        else:
            t.module.loss_fn(run_chain(package, submodels, inputs), inputs).backward()
        grads.append([p.grad for s in submodels for p in s.parameters()])
    assert len(grads[0]) == len(grads[1]) > 0
    for one_graph, detached in zip(*grads):
        torch.testing.assert_close(detached, one_graph, rtol=1e-10, atol=1e-10)


def test_inputs_written_in_place_are_copied(tmp_path):
    """A sub-model whose first operator adds a residual in place into one of its inputs (Hugging
    Face's ResNet, Falcon) writes a copy: the swap runtime's inputs are leaves that take
    gradients, which autograd refuses to write, and a recomputation needs them as they were."""
    t = traced(MODELS / "moe.py")
    _, package = build_package(t, cuts_at(t, "add_"), tmp_path / "pkg")
    second = (tmp_path / "pkg" / "submodel_1.py").read_text()
    assert ".clone()  # written in place below" in second
    assert_equivalent(t, package, torch.float64, 1e-10)
    first, last = (s.double() for s in package.build_submodels())
    package.load_original_state_dict([first, last], copy.deepcopy(t.model).double().state_dict())
    middle = tuple(v.detach().requires_grad_(v.is_floating_point())
                   for v in first(*t.inputs))
    kept = [v.detach().clone() for v in middle]
    t.module.loss_fn(last(*middle), t.inputs).backward()
    for leaf, before in zip(middle, kept):
        assert torch.equal(leaf.detach(), before)
        assert leaf.grad is not None


@pytest.mark.parametrize("model, cuts", [
    ("moe.py", ("cumsum", "blocks_1_moe_experts_1_weight_1")),  # a router's float counts
    ("vq_ema.py", ("sum_4", "dec1")),  # a no_grad region's product crosses a cut
], ids=["router-counts", "no-grad-region"])
def test_boundaries_say_which_values_take_gradients_as_the_model_does(tmp_path, model, cuts):
    """BOUNDARIES' "grad" of every value crossing a cut is whether it requires gradients in the
    model: the chained sub-models, run as one autograd graph, agree value by value (and the
    float values a router computes from indices, or a no_grad region, take none)."""
    t = traced(MODELS / model)
    _, package = build_package(t, cuts_at(t, *cuts), tmp_path / "pkg")
    source = "".join((tmp_path / "pkg" / f"submodel_{i}.py").read_text() for i in range(3))
    assert (model != "vq_ema.py") or "with torch.no_grad():" in source  # fx's regions kept
    subs = package.build_submodels()
    package.load_original_state_dict(subs, t.model.state_dict())
    flags, seen = {}, {}
    values = t.inputs
    for sub, boundary in zip(subs[:-1], package.BOUNDARIES):
        values = sub(*values)
        for name, value in zip(type(sub).OUTPUTS, values):
            if isinstance(value, torch.Tensor):
                flags[name], seen[name] = boundary["outputs"][name]["grad"], value.requires_grad
    assert flags == seen
    assert any(flags.values()) and not all(flags.values())


def test_weight_cast_twice_is_the_same_graph_in_float64(tmp_path):
    """A weight cast with `.float()` in two places and read as it is (Mamba's A_log): traced in
    float32 the casts are no-ops and export records the later reads as reads of the first cast;
    the float64 trace reads the weight each time. The graphs agree modulo those casts, the
    reads are repaired, and the package computes the model in float64 and float32."""
    path = MODELS / "cast_twice.py"
    meta = trace_model(path, None, 2, device="meta")
    assert meta.graph.frontend == "export"
    _, package = build_package(meta, cuts_at(meta, "exp", "to_1", "select_6", "to_3"),
                               tmp_path / "pkg")
    reads = {n.name: [a.op for a in n.all_input_nodes] for n in meta.gm.graph.nodes}
    assert reads["to_1"] == reads["select_6"] == ["get_attr"]  # the weight, not the first cast
    assert "u * self.mixers_0_A_log[..., 0]" in (tmp_path / "pkg" / "submodel_3.py").read_text()
    cpu = traced(path)
    assert_equivalent(cpu, package, torch.float64, 1e-10)
    assert_equivalent(cpu, package, torch.float32, 1e-6)


def test_a_weightless_sub_model_takes_its_dtype_from_a_value_that_follows_the_weights(tmp_path):
    """The residual stream kept in float32 by the model (`.to(torch.float32)`, as Mamba keeps
    it) is the first floating input of a sub-model that holds only the scan: its `dtype` is
    read from an input that follows the weights, so the package computes the model in float64
    and float32 (with the residual's, the float64 run met a float32 operand in a matmul)."""
    path = MODELS / "upcast_scan.py"
    meta = trace_model(path, None, 2, device="meta", frontend="export")
    _, package = build_package(meta, cuts_at(meta, "zeros", "blocks_0_out_proj_weight_1"),
                               tmp_path / "pkg")
    scan = (tmp_path / "pkg" / "submodel_1.py").read_text()
    inputs = type(package.build_submodels()[1]).INPUTS
    assert inputs[0] == "residual" and "state.to(dtype)" in scan
    assert "dtype = residual.dtype" not in scan and "dtype = z.dtype" in scan
    cpu = traced(path)
    assert_equivalent(cpu, package, torch.float64, 1e-10)
    assert_equivalent(cpu, package, torch.float32, 1e-6)


def test_a_branch_on_the_dtype_is_still_refused(tmp_path):
    path = tmp_path / "branchy.py"
    path.write_text((MODELS / "cast_twice.py").read_text().replace(
        "        return self.out_proj(y)",
        "        if self.A_log.dtype == torch.float32:\n            y = y * 2\n"
        "        return self.out_proj(y)"))
    meta = trace_model(path, None, 2, device="meta")
    with pytest.raises(TraceError, match=r"traces to a different graph in torch\.float64"):
        generate(plan_from_cuts(meta, []), tmp_path / "pkg", traced=meta)


def test_buffer_built_on_a_weights_device_is_stored_with_its_values(tmp_path):
    """A constructor that computes a buffer on the device of a weight (a shifted-window
    attention mask, `device=self.qkv.weight.device`) makes it on meta when atomc builds the
    model on meta, and again when it rebuilds the model with meta weights to read buffers: its
    values come from a CPU build, and the package computes what the model computes."""
    path = MODELS / "window_mask.py"
    meta = trace_model(path, None, 2, device="meta")  # as `atomc codegen` retraces the model
    assert meta.model.attn.mask.device.type == "meta"
    _, package = build_package(meta, cuts_at(meta, "view_1", "norm"), tmp_path / "pkg")
    stored = torch.load(tmp_path / "pkg" / "constants.pt")
    assert torch.equal(stored["attn.mask"], traced(path).model.attn.mask)
    assert_equivalent(traced(path), package, torch.float64, 1e-10)


def test_buffer_without_values_on_any_build_is_one_line(tmp_path):
    path = tmp_path / "fixed_meta.py"
    path.write_text((MODELS / "window_mask.py").read_text().replace(
        "device=self.qkv.weight.device", 'device="meta"'))
    meta = trace_model(path, None, 2, device="meta")
    plan = plan_from_cuts(meta, cuts_at(meta, "view_1"))
    with pytest.raises(TraceError) as e:
        generate(plan, tmp_path / "pkg", traced=meta)
    message = str(e.value)
    assert "\n" not in message and "buffer attn.mask" in message and "CPU" in message
    assert not (tmp_path / "pkg").exists()


def test_inputs_written_through_modules_that_return_them_are_copied(tmp_path):
    """An activation built with inplace=True behind a module that returns its input (nn.Identity,
    Dropout(0.0)) or a view of it (nn.Flatten) writes the sub-model's input through it: the
    input is copied first, so the runtime's leaves that take gradients stay as they were."""
    t = traced(MODELS / "identity_inplace.py")
    _, package = build_package(t, cuts_at(t, "attn", "drop"), tmp_path / "pkg")
    for i in (1, 2):
        assert ".clone()  # written in place below" in (
            tmp_path / "pkg" / f"submodel_{i}.py").read_text()
    assert_equivalent(t, package, torch.float64, 1e-10)
    subs = [s.double() for s in package.build_submodels()]
    package.load_original_state_dict(subs, copy.deepcopy(t.model).double().state_dict())
    values, leaves = tuple(x.double() for x in t.inputs), []
    for sub in subs:
        values = tuple(v.detach().requires_grad_(True) for v in values) if leaves else values
        leaves.append((values, [v.detach().clone() for v in values]))
        values = sub(*values)
    t.module.loss_fn(values, t.inputs).backward()  # autograd refused a write of a leaf
    for given, before in leaves[1:]:
        assert all(torch.equal(v.detach(), b) for v, b in zip(given, before))


# ---------------------------------------------------------------------------------------------
# the package contract


def test_contract_chain_boundaries_and_state_dict(tmp_path):
    t = traced(GPT, "tiny")
    _, package = build_package(t, cuts_at(t, "h_0_attn_c_attn", "h_1_ln_1"), tmp_path / "pkg")
    subs = package.SUBMODELS
    assert package.MODEL_INPUTS == ("idx",) == subs[0].INPUTS
    for a, b in itertools.pairwise(subs):
        assert b.INPUTS == a.OUTPUTS
    for i, cls in enumerate(subs):
        assert tuple(package.BOUNDARIES[i]["inputs"]) == cls.INPUTS
        assert tuple(package.BOUNDARIES[i]["outputs"]) == cls.OUTPUTS
    assert subs[1].INPUTS == ("x", "ln_1", "batch", "seq", "width")  # as the model's code
    assert package.BOUNDARIES[1]["inputs"]["ln_1"] == {"shape": [2, 16, 32], "dtype": "float32",
                                                       "grad": True}
    assert package.BOUNDARIES[1]["inputs"]["batch"] == {"kind": "int"}  # a size, not a tensor
    plan_info = package.PLAN
    for key in ("plan_hash", "graph_hash", "profile_hash", "model_path", "config", "batch_size",
                "options", "accum", "activations", "atomc_version"):
        assert key in plan_info
    assert Plan.load(tmp_path / "pkg" / "plan.json").content_hash() == plan_info["plan_hash"]

    # state dict round trip, aliases of tied weights included
    model = copy.deepcopy(t.model)
    submodels = package.build_submodels()
    package.load_original_state_dict(submodels, model.state_dict())
    exported = package.export_state_dict(submodels)
    assert list(exported) == list(model.state_dict())
    fresh = copy.deepcopy(t.model)
    torch.nn.init.zeros_(fresh.wte.weight)
    fresh.load_state_dict(exported, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    # holders of a tied weight that disagree are reported
    with torch.no_grad():
        submodels[2].lm_head.weight.add_(1.0)
    with pytest.raises(ValueError, match=r"tied weight wte\.weight"):
        package.export_state_dict(submodels)
    # a state dict with only the alias name of a tied weight loads too
    state = model.state_dict()
    del state["wte.weight"]
    assert package.load_original_state_dict(package.build_submodels(), state) == []


def test_generated_code_reads_like_code(tmp_path):
    t = traced(GPT, "tiny")
    build_package(t, cuts_at(t, "h_0_attn_c_attn"), tmp_path / "pkg")
    text = (tmp_path / "pkg" / "submodel_1.py").read_text()
    assert "self.h_0_c_attn = nn.Linear(32, 96)  # h.0.attn.c_attn" in text
    assert "self.lm_head = nn.Linear(32, 256, bias=False)" in text
    # named as the model's code names them, written as it writes them
    assert "q, k, v = self.h_0_c_attn(ln_1).split(32, dim=2)  # 3 x [2, 16, 32] float32" in text
    assert "q = q.view(batch, seq, 4, head_dim).transpose(1, 2)  # [2, 4, 16, 8] float32" in text
    assert "y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)" in text
    assert "getattr_" not in text and "getitem_" not in text
    assert 'getattr(self' not in text and ";  " not in text and " = None" not in text
    assert "from plan " in text and "atomc 0.1.0" in text
    for line in text.splitlines():
        assert line == line.rstrip()


def test_identical_blocks_are_one_class(tmp_path):
    """A sub-model holding both of GPT tiny's blocks defines the block once and calls it per
    block; the parameters keep their path through the instance, mapped to the original
    names."""
    t = traced(GPT, "tiny")
    _, package = build_package(t, cuts_at(t, "h_0_ln_1"), tmp_path / "pkg")
    text = (tmp_path / "pkg" / "submodel_1.py").read_text()
    assert text.count("class Block(nn.Module):") == 1
    assert "self.h_0 = Block()  # h.0" in text and "self.h_1 = Block()  # h.1" in text
    assert "x = self.h_0(x)" in text and "x = self.h_1(x)" in text
    assert package.PARAM_NAMES[1]["h_1.c_attn.weight"] == "h.1.attn.c_attn.weight"
    assert_equivalent(t, package, torch.float64, 1e-10)


def _source_names(files: set[str]) -> set[str]:
    """Every name the model's own code binds: assignment and loop targets, parameters, and
    the attributes its modules set (`self.q_proj = ...`)."""
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(Path(file).read_text())):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def reader_counts(package_dir: Path, t) -> dict[str, list]:
    """What in a generated package a reader would not write: ATen calls (none is one a reader
    writes), lines over the project's 100 columns, and names made by fx's counters."""
    files = {f for n in t.gm.graph.nodes
             for f in re.findall(r'File "([^"<]+)"', n.meta.get("stack_trace") or "")}
    known = _source_names(files) | {"device", "dtype"}
    aten, long_lines, counters = [], [], []
    for path in sorted(package_dir.glob("submodel_*.py")):
        text = path.read_text()
        aten += re.findall(r"torch\.ops\.aten\.[\w.]+", text)
        long_lines += [line for line in text.splitlines() if len(line) > 100]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == "forward":
                for inner in ast.walk(node):
                    name = (inner.id if isinstance(inner, ast.Name)
                            and isinstance(inner.ctx, ast.Store)
                            else inner.arg if isinstance(inner, ast.arg) else None)
                    if name and name != "self" and re.sub(r"_\d+$", "", name) not in known:
                        counters.append(name)
    return {"aten": aten, "long_lines": long_lines, "counter_names": sorted(set(counters))}


def test_export_code_reads_like_the_models_code(tmp_path):
    """The tiny Llama through torch.export, cut in three as examples/hf.py's user would: no
    ATen call, no line over 100 columns, and every local named by the model's code
    (`hidden_states`, `query_states`; `hidden_states_2` beside it), layers as layers."""
    pytest.importorskip("transformers")
    t = traced(REPO / "examples" / "hf.py", "tiny-llama")
    n = len(t.graph.nodes)
    _, package = build_package(t, [n // 3, 2 * n // 3], tmp_path / "pkg")
    assert reader_counts(tmp_path / "pkg", t) == {"aten": [], "long_lines": [],
                                                  "counter_names": []}
    text = "".join((tmp_path / "pkg" / f"submodel_{i}.py").read_text() for i in range(3))
    assert "self.embed_tokens = nn.Embedding(128, 32)  # model.model.embed_tokens" in text
    assert "variance = hidden_states.pow(2).mean(-1, keepdim=True)" in text
    assert "hidden_states * torch.rsqrt(variance + 1e-06)" in text
    assert package.SUBMODELS[0].OUTPUTS[:4] == ("inputs_embeds", "causal_mask", "cos", "sin")
    assert_equivalent(t, package, torch.float64, 1e-10)
    assert_equivalent(t, package, torch.float32, 1e-5)


def test_deterministic_bytes(tmp_path):
    t = traced(MODELS / "helper.py", batch_size=3)
    plan = plan_from_cuts(t, cuts_at(t, "mix"))
    first = generate(plan, tmp_path / "a", traced=t)
    second = generate(plan, tmp_path / "b", traced=t)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    generate(plan, first, traced=t)  # regenerating over its own package replaces it
    assert sorted(p.name for p in first.iterdir()) == names


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "bert_tiny"])
def test_golden_files(monkeypatch, tmp_path, name):
    """`make golden` regenerates tests/golden/ (tests/make_golden.py): one package traced by
    symbolic tracing (GPT), two by torch.export (a Llama, a BERT)."""
    if name != "gpt_tiny":
        pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)
    golden = GOLDEN / name
    plan = Plan.load(golden / "plan.json")
    out = generate(plan, tmp_path / name)
    files = sorted(p.name for p in golden.iterdir() if p.is_file())
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == files
    for file in files:
        if file.endswith(".pt"):
            continue  # constants' values: pickled tensors, compared as values below
        assert (out / file).read_text() == (golden / file).read_text(), (
            f"{file} differs from tests/golden/{name}/{file}; if the change is intended, "
            f"run `make golden` and review the diff")
    if (golden / "constants.pt").exists():
        want = torch.load(golden / "constants.pt", weights_only=True)
        got = torch.load(out / "constants.pt", weights_only=True)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def _ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(found).exists():
        pytest.skip("ruff is not installed")
    return found


def test_ruff_passes_on_generated_packages(tmp_path):
    for name, t, cuts in [
        ("gpt", traced(GPT, "tiny"), ("h_0_attn_c_attn", "ln_f")),
        ("helper", traced(MODELS / "helper.py", batch_size=3), ("mix",)),
        ("export", traced(MODELS / "export_only.py", batch_size=3), ("relu",)),
        ("multi", traced(MODELS / "multi_out.py", batch_size=4), ("mid",)),
    ]:
        build_package(t, cuts_at(t, *cuts), tmp_path / name)
    result = subprocess.run([_ruff(), "check", "--no-cache", "--config",
                             str(REPO / "pyproject.toml"), str(tmp_path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_imports_in_fresh_interpreter_without_model_file(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model_file = work / "helper_model.py"
    shutil.copy(MODELS / "helper.py", model_file)
    t = trace_model(model_file, None, 3, device="cpu")
    plan = plan_from_cuts(t, cuts_at(t, "mix"))
    generate(plan, tmp_path / "helper_pkg", traced=t)
    model_file.unlink()
    shutil.rmtree(work)
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import helper_pkg as pkg\n"
        "assert not any('helper_model' in name for name in sys.modules)\n"
        "subs = pkg.build_submodels()\n"
        "values = (torch.randn(3, 8),)\n"
        "for sub in subs[:-1]:\n"
        "    values = sub(*values)\n"
        "print(tuple(subs[-1](*values).shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(3, 4)"


# ---------------------------------------------------------------------------------------------
# bad input


def test_plan_for_another_model_is_refused(tmp_path, monkeypatch):
    model_file = tmp_path / "gpt.py"
    shutil.copy(GPT, model_file)
    t = trace_model(model_file, "tiny", 2)
    plan = plan_from_cuts(t, cuts_at(t, "h_1_ln_1"))
    plan.save(tmp_path / "plan.json")
    # the model file changes after profiling: d_model 32 -> 48
    text = model_file.read_text().replace('"tiny": GPTConfig(2, 32, 4',
                                          '"tiny": GPTConfig(2, 48, 4')
    model_file.write_text(text)
    with pytest.raises(CodegenError, match="changed since it was profiled"):
        generate(Plan.load(tmp_path / "plan.json"), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()
    # a profile that is not the plan's
    other = traced(MODELS / "skip.py", batch_size=3)
    profile = profile_model(other, device="cpu", repeats=1, progress=False)
    with pytest.raises(CodegenError, match="made from profile"):
        generate(plan, tmp_path / "pkg", profile=profile, traced=t)


def test_plan_graph_hash_mismatch_with_given_trace(tmp_path):
    t = traced(GPT, "tiny")
    plan = plan_from_cuts(traced(MODELS / "skip.py", batch_size=3), [3])
    with pytest.raises(CodegenError, match="plan was made for graph"):
        generate(plan, tmp_path / "pkg", traced=t)


def test_output_directory_that_is_a_file(tmp_path):
    t = traced(MODELS / "skip.py", batch_size=3)
    plan = plan_from_cuts(t, [3])
    target = tmp_path / "pkg"
    target.write_text("not a directory")
    with pytest.raises(CodegenError, match="is a file"):
        generate(plan, target, traced=t)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(CodegenError, match="not a package atomc generated"):
        generate(plan, foreign, traced=t)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_failed_run_leaves_no_half_package(tmp_path, monkeypatch):
    from atomc import codegen

    t = traced(MODELS / "skip.py", batch_size=3)
    plan = plan_from_cuts(t, [3])

    def broken(*args, **kwargs):
        raise CodegenError("forced failure after the files were written")

    monkeypatch.setattr(codegen, "_self_check", broken)
    with pytest.raises(CodegenError, match="forced failure"):
        generate(plan, tmp_path / "pkg", traced=t)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    generate(plan, tmp_path / "pkg", traced=t)
    before = {p.name: p.read_bytes() for p in (tmp_path / "pkg").iterdir()}
    monkeypatch.setattr(codegen, "_self_check", broken)
    with pytest.raises(CodegenError):
        generate(plan_from_cuts(t, [5]), tmp_path / "pkg", traced=t)
    assert {p.name: p.read_bytes() for p in (tmp_path / "pkg").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


BAD_HELPERS = {
    "lambda": (
        ("act = lambda x: x * torch.sigmoid(x)\n"
         "torch.fx.wrap('act')\n"),
        "h = act(self.inp(x))",
        "a lambda",
    ),
    "local-class": (
        ("def _make():\n"
         "    class Local(nn.Module):\n"
         "        def forward(self, x):\n"
         "            return x * 2\n"
         "    return Local\n"
         "Local = _make()\n"
         "LEAF_MODULES = (Local,)\n"),
        "h = self.local(self.inp(x))",
        "defined inside another function",
    ),
    "uninstalled-module": (
        ("import sys, os\n"
         "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
         "from mylayers import swish\n"
         "torch.fx.wrap('swish')\n"),
        "h = swish(self.inp(x))",
        "neither the model file nor an installed package",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HELPERS))
def test_helper_that_cannot_be_copied(tmp_path, case):
    prelude, body, message = BAD_HELPERS[case]
    (tmp_path / "mylayers.py").write_text("import torch\n\n\n"
                                          "def swish(x):\n    return x * torch.sigmoid(x)\n")
    model_file = tmp_path / f"bad_{case.replace('-', '_')}.py"
    local = "        self.local = Local()\n" if case == "local-class" else ""
    model_file.write_text(
        "import torch\nfrom torch import nn\n\n" + prelude +
        "\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.inp = nn.Linear(4, 4)\n" + local + "        self.out = nn.Linear(4, 2)\n\n"
        f"    def forward(self, x):\n        {body}\n        return self.out(h)\n\n\n"
        "def build_model(config=None):\n    return Net()\n\n\n"
        "def example_inputs(model, batch_size):\n    return (torch.randn(batch_size, 4),)\n")
    try:
        t = trace_model(model_file, None, 2)
        plan = plan_from_cuts(t, [2])
        with pytest.raises(CodegenError, match=message) as info:
            generate(plan, tmp_path / "pkg", traced=t)
        assert "sub-model" in str(info.value) or "module" in str(info.value)
        assert not (tmp_path / "pkg").exists()
    finally:
        sys.modules.pop("mylayers", None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))


def test_manual_plan_rejects_bad_cuts():
    t = traced(MODELS / "skip.py", batch_size=3)
    with pytest.raises(UsageError, match="strictly increasing"):
        plan_from_cuts(t, [5, 3])
    with pytest.raises(UsageError, match="inputs"):
        plan_from_cuts(t, [0])
    with pytest.raises(UsageError, match="outside"):
        plan_from_cuts(t, [len(t.graph.nodes)])


# ---------------------------------------------------------------------------------------------
# command line


def test_emit_plan_as_partition_calls_it(tmp_path, capsys):
    """`atomc partition ... --emit DIR` calls emit_plan(plan, profile, DIR) after planning."""
    t = traced(MODELS / "skip.py", batch_size=3)
    profile = profile_model(t, target="v100-32gb", progress=False)
    plan = plan_from_cuts(profile, [5])
    emit_plan(plan, profile, tmp_path / "pkg")  # retraces the model file on meta tensors
    assert "wrote 2 sub-models" in capsys.readouterr().out
    assert load_package(tmp_path / "pkg").PLAN["profile_hash"] == profile.content_hash()


def test_cli_codegen(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    t = trace_model(GPT, "tiny", 2)  # meta, as `atomc profile` traces
    plan_path = tmp_path / "plan.json"
    plan_from_cuts(t, cuts_at(t, "h_1_ln_1")).save(plan_path)
    assert atomc_main(["codegen", str(plan_path), "-o", str(tmp_path / "out")]) == 0
    assert "wrote 2 sub-models" in capsys.readouterr().out
    assert (tmp_path / "out" / "submodel_1.py").is_file()
    (tmp_path / "file").write_text("x")
    assert atomc_main(["codegen", str(plan_path), "-o", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and len(err.strip().splitlines()) == 1


def test_example_trains_a_generated_package():
    spec = importlib.util.spec_from_file_location("train_generated_example",
                                                  REPO / "examples" / "train_generated.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--steps", "8"])
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3


def test_names_a_function_whose_package_binds_its_module_name_to_it(tmp_path, monkeypatch):
    """A package that imports a function over the submodule of the same name (torchvision.ops
    with stochastic_depth: torchvision's ConvNeXt) is named where generated code finds it,
    `shadowed.scale`, not by its module path `shadowed.scale.scale`, which evaluates attribute
    by attribute to the function's attribute `scale`."""
    from atomc.codegen import resolve

    package = tmp_path / "shadowed"
    package.mkdir()
    (package / "__init__.py").write_text("from .scale import Scale, scale\n")
    (package / "scale.py").write_text(
        "import torch\n\n\ndef scale(x):\n    return 2 * x\n\n\n"
        "class Scale(torch.nn.Module):\n    def forward(self, x):\n        return scale(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = resolve.is_installed
    monkeypatch.setattr(resolve, "is_installed",
                        lambda name: name.split(".")[0] == "shadowed" or installed(name))
    shadowed = importlib.import_module("shadowed")
    resolver = resolve.Resolver.__new__(resolve.Resolver)
    resolver.model_module = sys.modules[__name__]
    for obj, name in ((shadowed.scale, resolver.function), (shadowed.Scale, resolver.cls)):
        imports: set[str] = set()
        expression = name(obj, imports, "test")
        scope: dict = {}
        exec("\n".join(sorted(imports)), scope)
        assert eval(expression, scope) is obj, expression
