"""activations="auto" on CUDA: kept outputs on the device, sent ones through pinned host buffers
on the offload stream and back on the prefetch stream; the same result as the CPU path (float64,
1e-9: CUDA and CPU kernels round differently)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.runtime import SwapTrainer
from atomc.trace import trace_model

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import gpt

MICRO, SEQ, C, BIG = 2, 16, 3, 1 << 30


def test_kept_and_sent_outputs_on_cuda_equal_the_cpu_path(tmp_path):
    traced = trace_model(REPO / "examples" / "gpt.py", "tiny", MICRO, device="cpu")
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    plan = plan_from_cuts(traced, [index[n] for n in ("add", "add_1", "add_3")], C)
    quotas = [(BIG, 0), (0, BIG), (3000, BIG), (0, 0)]
    plan = dataclasses.replace(plan, activations="auto", submodels=tuple(
        dataclasses.replace(s, kept_bytes=k, sent_bytes=q)
        for s, (k, q) in zip(plan.submodels, quotas)))
    pkg = generate(plan, tmp_path / "pkg", traced=traced)
    torch.manual_seed(0)
    state = {k: v.double() for k, v in gpt.build_model("tiny").state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (C * MICRO, SEQ), generator=g) for _ in range(3)]
    runs = {}
    for device in ("cpu", "cuda"):
        trainer = SwapTrainer.from_package(pkg, device=device, state_dict=state,
                                           optimizer={"lr": 1e-3}, offload_activations=True,
                                           trace=True)
        runs[device] = ([trainer.step(b) for b in batches], trainer.export_state_dict(), trainer)
    assert runs["cuda"][0] == pytest.approx(runs["cpu"][0], rel=1e-10)
    for k, v in runs["cpu"][1].items():
        assert (runs["cuda"][1][k].cpu() - v).abs().max().item() <= 1e-9, k
    cache = runs["cuda"][2].executor.opcache
    assert {x for c in cache.choices.values() for x in c.values()} == {"k", "s"}
    assert cache.arena is not None and cache.arena.storage.is_pinned()
    kinds = {(e.lane, e.kind) for e in runs["cuda"][2].last_trace().events}
    assert ("offload", "activation_out") in kinds and ("prefetch", "checkpoint") in kinds
    for _, _, t in runs.values():
        t.close()
