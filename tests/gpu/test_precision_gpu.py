"""The planner's autocast dtypes against CUDA autocast itself. Runs where CUDA exists.

Each model is traced on the GPU, its weights cast as the runtime holds them (half, norms in
float32), and the graph run under torch.autocast("cuda"); every node's output dtypes must be
the ones atomc.partition.autocast predicts, for the planner sizes activations from them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from atomc.partition.autocast import device_dtypes
from atomc.trace import trace_model

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
CASES = [
    (REPO / "examples" / "gpt.py", "mini"),
    (REPO / "examples" / "hf.py", "tiny-llama"),
    (REPO / "tests" / "models" / "resnet.py", None),
    (REPO / "tests" / "models" / "torch_transformer.py", None),
]


@pytest.mark.parametrize("path, config", CASES, ids=lambda v: getattr(v, "stem", v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("half_weights", [True, False])
def test_predicted_dtypes_are_cuda_autocasts(path, config, dtype, half_weights):
    if path.name == "hf.py":
        pytest.importorskip("transformers")
    traced = trace_model(path, config, 2, device="cuda")
    graph = traced.graph
    wide = set(graph.full_precision)
    name = str(dtype).removeprefix("torch.")
    params = {f: (name if half_weights and f not in wide else s.dtype)
              for f, s in graph.params.items()}
    gm = traced.gm
    with torch.no_grad():
        for fqn, p in gm.named_parameters():
            p.data = p.data.to(getattr(torch, params.get(fqn, "float32")))
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            seen[n.name] = tuple(str(t.dtype).removeprefix("torch.") for t in tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
            return out

    with torch.autocast("cuda", dtype=dtype):
        Recorder(gm).run(*traced.inputs)
    predicted = device_dtypes(graph, params, name)
    wrong = [(n.name, n.target, p, seen.get(n.name)) for n, p in zip(graph.nodes, predicted)
             if n.op != "output" and p != seen.get(n.name)]
    assert not wrong
