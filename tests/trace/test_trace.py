"""Tracing: the example GPT, residual branches, tied weights, an export-only model, bad files."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from atomc.cli import main
from atomc.errors import ModelFileError, TraceError
from atomc.trace import dynamic, trace_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import gpt  # noqa: E402

HEADER = "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"


def write_model(tmp_path: Path, body: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return path


RESIDUAL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(self.b(h) + x)   # skip over two layers

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""

EXPORT_ONLY = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 1:          # Python control flow on a shape: symbolic tracing fails
            x = self.a(x)
        return self.b(x).sum(dim=-1)

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""

UNTRACEABLE = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:             # control flow on a tensor value: neither frontend can trace
            return self.a(x)
        return x

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_gpt_tiny_graph():
    traced = trace_model(EXAMPLES / "gpt.py", "tiny", 2)
    g = traced.graph
    assert g.frontend == "fx"
    assert g.blocks == ("h.0", "h.1")
    assert g.aliases == {"lm_head.weight": "wte.weight"}
    assert g.nodes[0].op == "placeholder" and g.nodes[-1].op == "output"
    names = [n.name for n in g.nodes]
    assert len(set(names)) == len(names)
    index = g.node_index()
    for i, n in enumerate(g.nodes):  # topological order
        assert all(index[x] < i for x in n.inputs)
    # each block's nodes carry its FQN, and equal blocks have equal signature sequences
    sigs = {b: [n.signature for n in g.nodes if n.block == b] for b in g.blocks}
    assert sigs["h.0"] == sigs["h.1"] and len(sigs["h.0"]) > 10
    # the tied weight is read by two nodes but is one parameter
    readers = [n.name for n in g.nodes if "wte.weight" in n.param_fqns]
    assert readers == ["wte", "lm_head"]
    assert "lm_head.weight" not in g.params


def test_output_shapes_equal_eager():
    traced = trace_model(EXAMPLES / "gpt.py", "tiny", 3, device="cpu")
    model = traced.model
    seen: dict[str, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name:
                                     seen.__setitem__(name, tuple(out.shape)))
             for name, m in model.named_modules() if name and not list(m.children())]
    with torch.no_grad():
        out = model(*traced.inputs)
    for h in hooks:
        h.remove()
    by_module = {n.target: n for n in traced.graph.nodes if n.op == "call_module"}
    assert set(by_module) == set(seen)
    for name, shape in seen.items():
        assert by_module[name].outputs[0].shape == shape, name
    last = next(n for n in traced.graph.nodes if n.name == "lm_head")
    assert last.outputs[0].shape == tuple(out.shape)


def test_meta_trace_allocates_no_weights():
    traced = trace_model(EXAMPLES / "gpt.py", "gpt3-xl", 1)
    assert all(p.is_meta for p in traced.model.parameters())
    assert abs(traced.graph.num_params() / gpt.NOMINAL_PARAMS["gpt3-xl"] - 1) < 0.03


@pytest.mark.parametrize("config", sorted(gpt.NOMINAL_PARAMS))
def test_gpt3_parameter_counts(config):
    with torch.device("meta"):
        model = gpt.build_model(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / gpt.NOMINAL_PARAMS[config] - 1) < 0.03


def test_seq_len_option():
    traced = trace_model(EXAMPLES / "gpt.py", "tiny", 2, {"seq_len": 8})
    assert traced.graph.nodes[0].outputs[0].shape == (2, 8)
    assert traced.graph.params["wpe.weight"].shape == (8, 32)


def test_residual_branches(tmp_path):
    g = trace_model(write_model(tmp_path, RESIDUAL), batch_size=4).graph
    add = next(n for n in g.nodes if n.target.endswith("add"))
    assert set(add.inputs) == {"b", "x"}  # the skip reads the model input directly


def test_export_only_model(tmp_path):
    path = write_model(tmp_path, EXPORT_ONLY)
    traced = trace_model(path, batch_size=4)
    assert traced.graph.frontend == "export"
    assert any("aten.linear" in n.target for n in traced.graph.nodes)
    # parameters are read next to their users, not hoisted to the top of the graph
    g = traced.graph
    for i, n in enumerate(g.nodes):
        if n.op == "get_attr":
            user = next(m for m in g.nodes if n.name in m.inputs)
            assert g.node_index()[user.name] == i + 1 or g.nodes[i + 1].op == "get_attr"
    assert set(g.params) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    with pytest.raises(TraceError, match="symbolic_trace"):
        trace_model(path, batch_size=4, frontend="fx")


def test_untraceable_names_both_frontends(tmp_path):
    path = write_model(tmp_path, UNTRACEABLE)
    with pytest.raises(TraceError) as info:
        trace_model(path, batch_size=2)
    text = str(info.value)
    assert "torch.fx.symbolic_trace" in text and "torch.export" in text
    assert "model.py:" in text  # the source line


GATED = """
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return x

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gate(x))

LEAF_MODULES = (LEAVES)

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


@pytest.mark.parametrize("runs_on", ["cpu", None], ids=["fake-cpu", "meta"])
def test_leaf_advice_does_not_loop(tmp_path, runs_on):
    """A forward that branches on a tensor's value is untraceable; marking its module as a leaf
    does not help (atomc runs leaves on meta tensors too), so neither error advises it: the
    second names the leaf module and the line, in one line, and says what would work."""
    path = write_model(tmp_path, GATED.replace("(LEAVES)", "()"))
    with pytest.raises(TraceError) as untraceable:
        trace_model(path, batch_size=2, runs_on=runs_on)
    first = str(untraceable.value)
    assert "model.py:11: if x.sum() > 0:" in first and "torch.where" in first
    assert "LEAF_MODULES" not in first and "\n" not in first
    path = write_model(tmp_path, GATED.replace("(LEAVES)", "(Gate,)"))
    with pytest.raises(TraceError) as as_leaf:
        trace_model(path, batch_size=2, runs_on=runs_on)
    second = str(as_leaf.value)
    assert "\n" not in second, second
    assert "at graph node gate (Gate, a leaf module)" in second
    assert "(at model.py:11: if x.sum() > 0:)" in second and "torch.where" in second
    assert "mark" not in second and "LEAF_MODULES" not in second


def test_untraceable_code_of_a_library_is_named_beside_the_model_files_call(tmp_path):
    """A model that fails inside a library's code (a Hugging Face forward): the error names
    the model file's line that calls it and the library's line that failed."""
    (tmp_path / "mylib.py").write_text("def gate(x):\n    if x.sum() > 0:\n"
                                      "        return x\n    return -x\n")
    path = write_model(tmp_path, "import mylib\n" + RESIDUAL.replace(
        "return self.c(self.b(h) + x)", "return mylib.gate(self.c(self.b(h) + x))"))
    with pytest.raises(TraceError) as info:
        trace_model(path, batch_size=2)
    text = str(info.value)
    assert "(at model.py:" in text and "mylib.gate" in text, text
    assert "mylib.py:2: if x.sum() > 0:" in text, text


def test_a_refusal_on_the_export_path_names_the_model_files_line(tmp_path):
    """torch.export traces a value-dependent shape (nonzero) that atomc's run on meta tensors
    then refuses: the operator failed inside the interpreter, whose traceback holds no line of
    the model, so the line comes from the failing node's recorded stack."""
    path = write_model(tmp_path, """
        class Keep(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)

            def forward(self, x):
                if x.shape[0] > 0:  # symbolic tracing cannot branch on a shape
                    x = self.a(x)
                keep = torch.nonzero(x[:, 0] > 0)
                return x[keep[:, 0]].sum()

        def build_model(config=None):
            return Keep()

        def example_inputs(model, batch_size):
            return (torch.randn(batch_size, 8),)
        """)
    with pytest.raises(TraceError) as info:
        trace_model(path, batch_size=4)
    text = str(info.value)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "nonzero" in t)
    assert f"(at model.py:{line}: keep = torch.nonzero(x[:, 0] > 0))" in text, text
    assert "\n" not in text


def test_a_forward_that_differentiates_itself_is_refused_with_a_reason(tmp_path):
    """A gradient penalty (torch.autograd.grad inside forward) cannot be cut into sub-models;
    the error says so, not that the graph failed on meta tensors."""
    path = write_model(tmp_path, RESIDUAL.replace(
        "return self.c(self.b(h) + x)",
        "(g,) = torch.autograd.grad(h.sum(), x, create_graph=True)\n"
        "        return self.c(self.b(h) + g)"))
    with pytest.raises(TraceError, match=r"computes a gradient itself \(grad at graph node"):
        trace_model(path, batch_size=2)


MAX_NORM = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8, max_norm=1.0)
        self.out = nn.Linear(8, 16)

    def forward(self, ids):
        return self.out(self.embed(ids))

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randint(0, 16, (batch_size, 4)),)

def loss_fn(out, batch):
    return F.cross_entropy(out.reshape(-1, 16), batch[0].reshape(-1))
"""


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_forward_that_writes_a_weight_is_refused_with_a_reason(tmp_path, device):
    """nn.Embedding(max_norm=...) renormalises weight rows in place in forward; the swap runtime
    updates host masters, so the write would be lost: refused, naming the weight."""
    path = write_model(tmp_path, MAX_NORM)
    with pytest.raises(TraceError, match=r"changes parameter\(s\) embed.weight in place"):
        trace_model(path, batch_size=2, device=device)
    trace_model(write_model(tmp_path, MAX_NORM.replace(", max_norm=1.0", ""), "plain.py"),
                batch_size=2, device=device)


LAYERDROP = """
class Net(nn.Module):
    def __init__(self, layerdrop):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training:            # Hugging Face's LayerDrop
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = layer(x)
        return x

def build_model(config=None):
    return Net(float(config or 0))

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_layerdrop_of_zero_keeps_every_layer_and_any_other_is_refused(tmp_path, frontend):
    path = write_model(tmp_path, LAYERDROP)
    g = trace_model(path, batch_size=2, frontend=frontend).graph
    linears = [n for n in g.nodes if n.target in ("layers.0", "layers.1", "layers.2")
               or n.target.endswith("linear.default")]
    assert len(linears) == 3  # every layer, with no branch left (export keeps the unused draws)
    with pytest.raises(TraceError, match=r"model\.py:\d+ `if dropout_probability < "
                                         r"self\.layerdrop:` compares a random draw .* with 0\.2"):
        trace_model(path, "0.2", batch_size=2, frontend=frontend)
    # at 1, every draw skips: a fixed graph again (the identity)
    g = trace_model(path, "1.0", batch_size=2, frontend=frontend).graph
    assert not any(n.op == "call_module" or "linear" in n.target for n in g.nodes)


OPTIONAL_INPUT = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 2.0):
        h = self.a(x)
        if mask is None:                 # traced as a Proxy, mask would take the other branch
            mask = torch.ones(x.shape[0], x.shape[1], device=x.device)  # sizes as arguments
        return self.b(h * mask) * scale

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_inputs_the_model_file_does_not_give_take_their_defaults(tmp_path):
    path = write_model(tmp_path, OPTIONAL_INPUT)
    traced = trace_model(path, batch_size=2, device="cpu", frontend="fx")
    assert [n.target for n in traced.graph.nodes if n.op == "placeholder"] == ["x"]
    x = traced.inputs[0]
    torch.testing.assert_close(traced.gm(x), traced.model(x))
    needed = write_model(tmp_path, OPTIONAL_INPUT.replace("mask=None", "mask"), "needed.py")
    with pytest.raises(TraceError, match=r"Net\.forward takes 'mask', which the model file's "
                                         r"example_inputs\(\) does not give"):
        trace_model(needed, batch_size=2)


CUSTOM_BACKWARD = """
class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return Reverse.apply(self.a(x))

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_custom_autograd_functions_keep_their_backward(tmp_path):
    path = write_model(tmp_path, CUSTOM_BACKWARD)
    traced = trace_model(path, batch_size=2, device="cpu")
    (call,) = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert call.target.endswith(".Reverse.apply") and call.name == "reverse"
    x = traced.inputs[0]
    traced.gm(x).sum().backward()
    assert (traced.model.a.bias.grad == -2).all()  # the Function's backward, not the identity's
    # torch.export records the forward's operations only: refused, not trained with +2
    with pytest.raises(TraceError, match=r"custom autograd\.Function \S+\.Reverse \(called at "
                                         r"model\.py:\d+ .*whose backward is not autograd's"):
        trace_model(path, batch_size=2, frontend="export")
    # a backward that is only the forward's derivative written by hand (BLOOM's GeLU) loses
    # nothing: exported as its forward's operations
    square = CUSTOM_BACKWARD.replace("return x.view_as(x)", "ctx.save_for_backward(x)\n"
                                     "        return x * x").replace(
        "return -grad", "(x,) = ctx.saved_tensors\n        return 2 * x * grad")
    traced = trace_model(write_model(tmp_path, square, "square.py"), batch_size=2,
                         frontend="export", device="cpu")
    assert not any("Reverse" in n.target for n in traced.graph.nodes)


def test_custom_functions_trace_where_torch_defines_apply_in_c(tmp_path, monkeypatch):
    """torch 2.14's `Function.apply` is torch._C._FunctionBase's, a C classmethod without
    `__func__`, and atomc.trace failed to import there (the torchvision survey's
    torch). Loaded afresh with torch's apply as 2.14 has it, atomc.trace.dynamic keeps the
    Function whole and runs its own backward."""
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        torch._C._FunctionBase.__dict__["apply"])
    assert not hasattr(torch.autograd.Function.__dict__["apply"], "__func__")
    spec = importlib.util.spec_from_file_location("fresh_dynamic", dynamic.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    monkeypatch.setattr("atomc.trace.frontends.functions_kept_whole", fresh.functions_kept_whole)
    traced = trace_model(write_model(tmp_path, CUSTOM_BACKWARD), batch_size=2, device="cpu")
    (call,) = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert call.target.endswith(".Reverse.apply")
    traced.gm(traced.inputs[0]).sum().backward()
    assert (traced.model.a.bias.grad == -2).all()


CONVERTS_ITSELF = """
class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(8, 4)
        self.dtype = torch.float32

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)  # SwitchTransformers' router
        return self.classifier(x.to(self.dtype))

def build_model(config=None):
    return Router()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_a_module_that_converts_itself_to_what_it_is_exports(tmp_path):
    """`self.classifier = self.classifier.to(self.dtype)` in a forward changes nothing, yet
    torch.export refused it (`Couldn't swap Linear.weight`); a conversion that changes the
    weights is still refused."""
    path = write_model(tmp_path, CONVERTS_ITSELF)
    traced = trace_model(path, batch_size=2, frontend="export", device="cpu")
    x = traced.inputs[0]
    torch.testing.assert_close(traced.gm(x), traced.model(x))
    changes = write_model(tmp_path, CONVERTS_ITSELF.replace("self.dtype = torch.float32",
                                                            "self.dtype = torch.float64"), "m2.py")
    with pytest.raises(TraceError, match="swap"):
        trace_model(changes, batch_size=2, frontend="export", device="cpu")


LEAFY = """
class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.inner(x))

LEAF_MODULES = (Inner,)

def build_model(config=None):
    return Net()

def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_user_leaf_modules(tmp_path):
    g = trace_model(write_model(tmp_path, LEAFY), batch_size=2).graph
    assert [(n.op, n.target) for n in g.nodes] == [
        ("placeholder", "x"), ("call_module", "inner"), ("call_module", "head"),
        ("output", "output")]
    inner = g.nodes[1]
    assert inner.module_type == "Inner"
    assert inner.param_fqns == ("inner.a.weight", "inner.a.bias", "inner.b.weight", "inner.b.bias")


def test_bad_model_files(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        trace_model(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n")
    with pytest.raises(ModelFileError, match=r"broken.py:1: syntax error"):
        trace_model(broken)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ModelFileError,
                       match=r"does not define build_model\(\) and example_inputs\(\)"):
        trace_model(empty)
    raising = write_model(tmp_path,
                          RESIDUAL.replace("return Net()", "raise RuntimeError('no GPU here')"),
                          "raising.py")
    with pytest.raises(ModelFileError,
                       match=r"raising.py:\d+: build_model\(\) raised RuntimeError"):
        trace_model(raising)
    with pytest.raises(ModelFileError, match="takes no option 'seq_len'"):
        trace_model(write_model(tmp_path, RESIDUAL, "r.py"), options={"seq_len": 4})


def test_cli_errors_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    untraceable = write_model(tmp_path, UNTRACEABLE, "u.py")
    cases = [
        (["profile", str(tmp_path / "missing.py")], "does not exist"),
        (["profile", str(empty)], "does not define build_model"),
        (["profile", str(untraceable), "--target", "t4"], "torch.export"),
        (["profile", str(EXAMPLES / "gpt.py"), "--target", "gtx-9999"], "valid names: a100-40gb"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_buffers_are_read_when_the_forward_runs_not_when_it_is_traced():
    """fx, by default, runs what a forward does with a buffer at trace time: a value computed
    from it became a constant of the trace-time buffer, and an in-place update chain lost its
    first step. The traced graph must update and read the buffer as the model does."""
    from torch import nn

    from atomc.trace.frontends import trace

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("ema", torch.ones(4))

        def forward(self, x):
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0), alpha=0.5)
            return self.lin(x) * self.ema.pow(2).sum()

    torch.manual_seed(0)
    model, x = Ema(), torch.randn(3, 4)
    gm, frontend = trace(model, (x,), (), Path("ema.py"))
    assert frontend == "fx"
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "constant" in str(n.target)]
    twin = Ema()
    twin.load_state_dict(model.state_dict())
    for _ in range(3):
        assert torch.equal(gm(x), twin(x))
    assert torch.equal(gm.ema, twin.ema)


def test_a_buffer_the_forward_assigns_is_written_and_read_back():
    """`self.steps += 1` and `self.mean = ...` in a forward: the graph writes the buffer, later
    reads in the same forward see the new value, and the module keeps its tensor."""
    from torch import nn

    from atomc.trace.frontends import trace

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, x):
            self.steps += 1
            self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
            return self.lin(x) * self.steps + self.mean

    torch.manual_seed(0)
    model, x = Counter(), torch.randn(3, 4)
    twin = Counter()
    twin.load_state_dict(model.state_dict())
    gm, frontend = trace(model, (x,), (), Path("counter.py"))
    assert frontend == "fx" and isinstance(model.steps, torch.Tensor)
    for _ in range(3):
        assert torch.allclose(gm(x), twin(x))
    assert int(gm.steps) == int(twin.steps) == 3
    assert torch.allclose(gm.mean, twin.mean)


def test_named_results_of_operators_survive_the_autograd_run(tmp_path):
    """`x.max(dim=...)` returns torch.return_types.max, whose `.values` the graph reads with
    getattr: the run that asks autograd which values take gradients must hand it on as it is,
    not as a plain tuple (Hugging Face's Hiera pools so)."""
    from atomc.trace import grad_values

    path = write_model(tmp_path, """
        class Pool(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)

            def forward(self, x):
                h = self.a(x).view(x.shape[0], 2, 4)
                return h.max(dim=1).values.sum(-1)

        def build_model(config=None):
            return Pool()

        def example_inputs(model, batch_size):
            return (torch.randn(batch_size, 8),)
        """)
    traced = trace_model(path, None, 2, device="meta")
    values = grad_values(traced)
    assert values and any(values.values())


def test_a_library_beside_torch_is_the_models_code_not_torchs() -> None:
    """A refusal names the line of a library the model calls (torchvision's box matching,
    transformers' attention), and a frame of torch, atomc or the standard library is not one:
    torchvision's folder begins with torch's name, and a Python built from source keeps its
    site-packages inside the standard library's folder."""
    import contextlib
    import os

    import atomc
    from atomc.trace.dynamic import is_internal

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    stdlib = os.path.dirname(os.path.realpath(contextlib.__file__))
    assert is_internal(os.path.join(torch_dir, "nn", "functional.py"))
    assert is_internal(os.path.join(os.path.dirname(atomc.__file__), "trace", "dynamic.py"))
    assert is_internal(os.path.join(stdlib, "contextlib.py"))
    assert is_internal("<string>")
    assert not is_internal(torch_dir + "vision/models/detection/transform.py")
    assert not is_internal(os.path.dirname(atomc.__file__) + "_zoo/model.py")
    assert not is_internal(os.path.join(stdlib, "site-packages", "transformers", "x.py"))


def test_a_model_file_edited_within_its_second_loads_as_edited(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Python trusts cached bytecode whose source has the same size and modification second:
    a model file is compiled from its source every time it is loaded."""
    import os

    from atomc.trace.load import load_model_file

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = tmp_path / "width.py"
    path.write_text(HEADER + "WIDTH = 32\ndef build_model(config=None):\n    return nn.Linear("
                    "WIDTH, 2)\ndef example_inputs(model, batch_size):\n    return (torch.randn("
                    "batch_size, WIDTH),)\n")
    stat = path.stat()
    assert load_model_file(path).WIDTH == 32
    path.write_text(path.read_text().replace("WIDTH = 32", "WIDTH = 48"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_model_file(path).WIDTH == 48
    assert not (tmp_path / "__pycache__").exists()
