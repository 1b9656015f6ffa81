"""Models nobody here wrote, through the whole chain: profile, partition, codegen, training.

Each model is profiled on the CPU from a meta-device trace (as `atomc profile --device cpu`
does), partitioned for a budget that needs three or more sub-models, generated from the plan
alone (codegen traces the model again, as `atomc codegen` does), and then:

- the chained sub-models give the original model's outputs and every parameter's gradient:
  float64 to 1e-10, float32 to 1e-5;
- SwapTrainer gives plain torch.optim.AdamW's weights and buffers after 3 steps;
- a plan made for bfloat16 weights (half-precision device copies, autocast) trains by default
  in bfloat16, refuses float32, and starts within 1% of the float32 plan's loss (or within
  1.5 times what bfloat16 rounding moves that model's eager loss, measured on the same batch).

The families: eight Hugging Face causal LMs (examples/hf.py's tiny presets), Hugging Face BERT
and DeBERTa-v2 encoders returning their own ModelOutput, a ResNet-style CNN with BatchNorm
(traced by symbolic tracing, and by torch.export behind a shape check), an encoder of
torch.nn's composite layers (TransformerEncoder, MultiheadAttention), a nanoGPT-style model.py
imported from the model file beside it (training and last-position inference), a model.py in
the style of Meta's llama (complex rotary frequencies), a Hugging Face T5 (two inputs, one
embedding tied three ways), and a mixture-of-experts model written as Hugging Face's MoE
families are (device-type branches, router statistics without gradients, `finfo(dtype).min`
masks, residuals added in place), layers whose weight torch computes (weight norm and
spectral norm, as parametrizations and as the older hooks, and parametrizations of the model's
own), custom autograd Functions whose backward is not their forward's derivative, and
Hugging Face's BART (LayerDrop) and Wav2Vec2 (raw audio), a VQ-VAE whose forward updates
its codebook buffer in place (an EMA), and hand-written running statistics and a step counter
that the forward assigns to its buffers, and a VAE that samples with torch.distributions.
From timm's zoo (timm.create_model, tiny configurations): an EfficientNet (BatchNorm,
squeeze-excitation), a ConvNeXt, a Swin transformer (shifted windows) and a ViT; from
diffusers: the conditional UNet of Stable Diffusion and the diffusion transformer DiT. From
the coverage surveys (bench/survey.py), PyTorch's Hugging Face benchmark list's ALBERT with a
question-answering head, from a tiny configuration. torchvision's models, the third survey,
do not import beside this CPU torch (tests/shims/README.md) and run in the survey alone.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from atomc.cli import main as atomc_main
from atomc.codegen import generate, load_package
from atomc.partition import partition
from atomc.profile import profile_model
from atomc.profile.ops import grad_flow
from atomc.runtime import SwapTrainer
from atomc.trace import trace_model
from atomc.trace.graph import tensors_in

from helpers.model_chain import (
    ADAM,
    CASES,
    HF,
    MICRO,
    MODELS,
    batch_of,
    chain,
    check_bfloat16_plan_trains_within_one_percent,
    check_chained_submodels_equal_the_model,
    check_swap_trainer_equals_adamw,
    on_the_worker_of,
    original,
    plain_steps,
)

pytest.importorskip("transformers")

MODEL_CASES = [pytest.param(name, marks=on_the_worker_of(name)) for name in sorted(CASES)]


# ---------------------------------------------------------------------------------------------
# outputs and gradients


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("name", MODEL_CASES)
def test_chained_submodels_equal_the_model(models_root, name, dtype, tol):
    check_chained_submodels_equal_the_model(models_root, name, dtype, tol)


# ---------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("name", MODEL_CASES)
def test_swap_trainer_equals_adamw(models_root, name):
    check_swap_trainer_equals_adamw(models_root, name)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_bfloat16_plan_trains_within_one_percent(models_root, name):
    check_bfloat16_plan_trains_within_one_percent(models_root, name)


# ---------------------------------------------------------------------------------------------
# each failure class, looked at directly


def test_modes_become_with_blocks_and_dtypes_stay_generic(models_root, tmp_path):
    """no_grad/autocast regions (export's higher-order operators) come back as `with` blocks;
    no assertion pins the traced dtype; `x.to(x.dtype)` follows the weights, `.float()` stays."""
    path = MODELS / "modes.py"
    t = trace_model(path, None, MICRO, device="meta")
    assert t.graph.frontend == "export"
    assert not any("higher_order" in str(n.target) for n in t.gm.graph.nodes)
    profile = profile_model(t, device="cpu", repeats=1, progress=False)
    plan = partition(profile, 1 << 30, reserve_bytes=0, cpu_adam_gbps=8.0)
    out = generate(plan, tmp_path / "pkg", profile=profile)
    source = "".join(p.read_text() for p in sorted(out.glob("submodel_*.py")))
    assert "with torch.no_grad():" in source
    assert "with torch.autocast(device.type, enabled=False" in source
    assert "_assert_tensor_metadata" not in source
    assert "h.tanh().to(dtype)" in source  # .to(x.dtype): generic
    assert "h.to(torch.float32)" in source  # .float(): the model's own
    package = load_package(out)
    reference = trace_model(path, None, MICRO, device="cpu")
    for dtype in (torch.float64, torch.bfloat16):
        model = original(reference, dtype)
        subs = [s.to(dtype) for s in package.build_submodels()]
        package.load_original_state_dict(subs, model.state_dict())
        x = reference.inputs[0].to(dtype)
        values = (x,)
        for sub in subs[:-1]:
            values = sub(*values)
        got = subs[-1](*values)
        assert got.dtype == dtype
        torch.testing.assert_close(got, model(x))


@on_the_worker_of("resnet-bn-export")
def test_batch_norm_in_export_graphs_follows_the_mode(models_root):
    """export resolves `self.training` when it traces; BatchNorm in generated code follows the
    sub-model's mode again: running statistics in evaluation, batch statistics in training."""
    out, _, reference = chain("resnet-bn-export", models_root)
    assert reference.frontend == "export"
    package = load_package(out)
    model = original(reference, torch.float64)
    subs = [s.to(torch.float64) for s in package.build_submodels()]
    package.load_original_state_dict(subs, model.state_dict())
    x = reference.inputs[0].to(torch.float64)
    for mode in (True, False, True):
        model.train(mode)
        values = (x,)
        for sub in subs:
            sub.train(mode)
        for sub in subs[:-1]:
            values = sub(*values)
        torch.testing.assert_close(subs[-1](*values), model(x), rtol=1e-10, atol=1e-10)
    state = package.export_state_dict(subs)
    assert int(state["bn.num_batches_tracked"]) == int(model.bn.num_batches_tracked) == 2
    torch.testing.assert_close(state["bn.running_mean"], model.bn.running_mean)


@on_the_worker_of("moe")
def test_meta_trace_takes_the_branch_of_the_device_it_runs_on(models_root):
    """Model code that branches on the device type (a router's histc counts in float32 on a
    CPU, int32 elsewhere) is traced on the meta device as if on the device it will run on:
    the CPU's branch for a CPU profile; the meta device alone takes the other one. The router
    statistics carry no gradient, and the profile times no backward for them."""
    path = MODELS / "moe.py"

    def histc_input_dtype(t):
        histc = next(n for n in t.gm.graph.nodes if n.target is torch.ops.aten.histc.default)
        return histc.args[0].args[1]

    assert histc_input_dtype(trace_model(path, None, MICRO, device="meta")) == torch.float32
    assert histc_input_dtype(trace_model(path, None, MICRO, device="meta",
                                         runs_on=None)) == torch.int32
    t = trace_model(path, None, MICRO, device="meta")
    assert all(p.device.type == "meta" for p in t.model.parameters())
    assert all(v.device.type == "meta" for v in tensors_in(list(t.values.values())))
    flows = grad_flow(t.gm, t.values)
    assert flows["linear"] and not flows["histc"] and not flows["cumsum"]
    profile = profile_model(t, device="cpu", repeats=1, progress=False)
    cost = {n.name: c for n, c in zip(profile.graph.nodes, profile.costs)}
    assert cost["cumsum"].bwd_ms == 0 and cost["histc"].bwd_ms == 0
    out, _, _ = chain("moe", models_root)
    source = "".join(p.read_text() for p in sorted(out.glob("submodel_*.py")))
    assert "torch.finfo(" in source and "3.4028" not in source


@on_the_worker_of("t5")
def test_weight_tied_three_ways_sums_its_gradients_exactly(models_root):
    """T5's one embedding is read by three sub-models; tied_grads="exact" adds the three
    holders' gradients per micro-batch in the order the plain model's backward does: one step
    gives plain AdamW's weights in float64 (to rounding: the export graph's kernels are not
    the eager model's)."""
    out, plan, reference = chain("t5", models_root)
    model = original(reference, torch.float64)
    trainer = SwapTrainer.from_package(out, device="cpu", state_dict=model.state_dict(),
                                       tied_grads="exact", optimizer=ADAM, dtype="float64")
    assert [len(h) for h in trainer.executor.ties.ties.values()] == [3]
    batch = tuple(x.to(torch.float64) if x.is_floating_point() else x
                  for x in batch_of(reference, plan.accum, 0))
    trainer.step(batch)
    plain_steps(model, reference.module.loss_fn, [batch], plan.accum)
    state = trainer.export_state_dict()
    for k, v in state.items():  # export's kernels round a little differently from eager ones
        torch.testing.assert_close(v, model.state_dict()[k], rtol=1e-12, atol=1e-14, msg=k)
    trainer.close()


@on_the_worker_of("bert")
def test_constants_ship_with_the_package(models_root):
    """Non-persistent buffers (BERT's position_ids) and lifted constants (nanoGPT's `[-1]`
    index, below) are package constants: stored with their values, never asked of a state
    dict."""
    out, _, _ = chain("bert", models_root)
    package = load_package(out)
    names = {fqn for names in package.PARAM_NAMES for fqn in names.values()}
    assert not any(n.endswith("position_ids") for n in names)
    assert (out / "constants.pt").is_file() and (out / "_constants.py").is_file()
    constants = package._constants.NAMES
    assert "embeddings.position_ids" in constants


@on_the_worker_of("nanogpt-last")
def test_lifted_constants_ship_with_the_package(models_root):
    out, _, _ = chain("nanogpt-last", models_root)
    package = load_package(out)
    assert any("constant" in n or "lifted" in n for n in package._constants.NAMES)


@on_the_worker_of("param-norms")
def test_reparametrized_layers_are_written_as_their_author_wrote_them(models_root):
    """A weight-normalised or spectral-normalised layer stays one module (its weight is
    computed, and spectral norm updates buffers every forward), rebuilt by the same calls;
    a parametrized module of the model's own is traced through."""
    out, _, _ = chain("param-norms", models_root)
    source = "\n".join(p.read_text() for p in sorted(out.glob("submodel_*.py")))
    source = re.sub(r"\s+", " ", source).replace("( ", "(")  # calls broken over lines, joined
    for call in ("parametrizations.weight_norm(nn.Conv1d(4, 8, (3,)",
                 "parametrizations.spectral_norm(nn.Linear(128, 48), dim=0)",
                 "nn.utils.weight_norm(nn.Linear(48, 48))",
                 "nn.utils.spectral_norm(nn.Linear(48, 48), dim=0)",
                 "parametrize.register_parametrization(nn.Linear(48, 48), 'weight', Symmetric())",
                 "n_power_iterations=2"):
        assert call in source, call
    assert "F.softplus(" in source and "Gain(" not in source


def test_model_file_imports_the_module_beside_it(tmp_path, capsys):
    """`from model import GPT` in a model file works in every command, not only in tests that
    already put the folder on sys.path: run the CLI in a fresh interpreter."""
    model = MODELS / "nanogpt" / "train_model.py"
    profile = tmp_path / "m.profile.json"
    args = ["profile", str(model), "--target", "a100-80gb", "-o", str(profile)]
    code = f"import sys; from atomc.cli import main; sys.exit(main({args!r}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=False, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert profile.is_file()


def test_hf_config_files_and_bad_ones(tmp_path, capsys):
    good = tmp_path / "config.json"
    good.write_text('{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, '
                    '"num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64}')
    assert atomc_main(["profile", str(HF), "--config", str(good), "--target", "a100-80gb",
                       "--seq-len", "8", "-o", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",')
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "no-such-architecture"}')
    for path, expected in ((broken, "not valid JSON"), (unknown, "is not an architecture")):
        assert atomc_main(["profile", str(HF), "--config", str(path), "--target", "a100-80gb"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and expected in err, err


def test_timm_imports_through_the_torchvision_stand_in():
    """timm, imported through tests/shims where no torchvision is installed, builds and freezes
    BatchNorm with torchvision's FrozenBatchNorm2d; afterwards no torchvision is found (so
    transformers and diffusers do not take one for installed), and what the stand-in does not
    provide says so."""
    timm = pytest.importorskip("timm")
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        pytest.skip("a torchvision is installed: timm imports it, not the stand-in")
    from timm.data.transforms import MaybeToTensor
    from transformers.utils.import_utils import is_torchvision_available

    assert not is_torchvision_available()
    bn = torch.nn.BatchNorm2d(4).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    frozen = timm.layers.freeze_batch_norm_2d(bn)
    assert type(frozen).__name__ == "FrozenBatchNorm2d"
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(frozen(x), bn(x))
    with pytest.raises(ImportError, match="tests/shims"):
        MaybeToTensor()
    with pytest.raises(AttributeError, match=r"torchvision\.transforms\.Resize is not available"):
        timm.data.create_transform(32)


def test_hf_without_transformers_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; from atomc.cli import main; "
            f"sys.exit(main(['profile', {str(HF)!r}, '--target', 'a100-80gb']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False, cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'atomc[hf]'" in lines[0], run.stderr


def test_untraceable_model_names_both_frontends_and_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Bad(nn.Module):\n"
        "    def forward(self, x):\n"
        "        if x.sum() > 0:\n"
        "            return x.nonzero().float().sum() * torch.ones(int(x.sum().item()))\n"
        "        return x\n\n"
        "def build_model(config=None):\n    return Bad()\n\n"
        "def example_inputs(model, batch_size):\n    return (torch.ones(batch_size, 3),)\n")
    assert atomc_main(["profile", str(bad), "--target", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "torch.fx.symbolic_trace" in err and "torch.export" in err and "bad.py:6" in err
