"""Host memory in the plan (atomc.partition.hostmem): the plan's figure is what the runtime
allocates, a plan over --host-mem is refused with the numbers, bfloat16 moments halve the
optimizer's bytes and train like float32 ones, frozen weights cost no moments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import UsageError
from atomc.partition import hostmem
from atomc.runtime import SwapTrainer
from atomc.trace import trace_model

REPO = Path(__file__).resolve().parent.parent
GPT_PATH = REPO / "examples" / "gpt.py"
MICRO, SEQ = 2, 16


@pytest.fixture(scope="module")
def traced():
    return trace_model(GPT_PATH, "tiny", MICRO, device="cpu")


@pytest.fixture(scope="module")
def package(traced, tmp_path_factory):
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    cuts = [i for n, i in index.items() if n.startswith("blocks_1")][:1]
    plan = plan_from_cuts(traced, cuts, 2)
    out = generate(plan, tmp_path_factory.mktemp("pkg") / "gpt", traced=traced)
    return plan, out


def batches(steps, C, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (C * MICRO, SEQ), generator=g) for _ in range(steps)]


def test_plan_host_bytes_are_what_the_store_and_optimizer_allocate(traced, package):
    plan, out = package
    host = hostmem.plan_host_memory(plan, traced.graph, pin=False)  # a CPU run pins nothing
    trainer = SwapTrainer.from_package(out, device="cpu", optimizer={"lr": 1e-3})
    try:
        trainer.step(batches(1, plan.accum)[0])
        store = trainer.store
        real_states = sum(t.numel() * t.element_size() for o in trainer.optimizer.optims
                          if o is not None for s in o.state.values()
                          for k, t in s.items() if k != "step")
        planned = host.by_kind
        # exactly the store's arenas and the optimizer's moments (ties: replicas in the image)
        assert planned["transfer_copies"] == store.image_arena.nbytes
        assert planned["gradient_buffers"] == store.grad_arena.nbytes
        assert planned["optimizer_states"] == real_states
        assert sum(planned.values()) == store.host_bytes() + real_states
        assert store.planned_bytes() == {**planned, "activation_stash": 0}
    finally:
        trainer.close()


def test_plan_over_host_mem_is_refused_with_the_numbers_and_bf16_moments_fit(traced):
    # a cut before every block: bfloat16 moments save when no one sub-model holds most weights
    # (the update's float32 scratch is the largest sub-model's)
    starts = [i for i, n in enumerate(traced.graph.nodes)
              if n.block and (i == 0 or traced.graph.nodes[i - 1].block != n.block)]
    plan = plan_from_cuts(traced, starts + [starts[-1] + 3], 2)
    need32 = sum(hostmem.plan_host_memory(plan, traced.graph).by_kind.values())
    host16 = hostmem.plan_host_memory(plan, traced.graph, "bfloat16")
    need16 = sum(host16.by_kind.values())
    assert need16 < need32
    limit = (need16 + need32) // 2
    with pytest.raises(UsageError) as e:
        hostmem.check_plan_host(hostmem.plan_host_memory(plan, traced.graph, "float32", limit,
                                                         "--host-mem"), frozen=False)
    message = str(e.value)
    assert "\n" not in message and "--optimizer-states bfloat16" in message
    assert "optimizer moments" in message and "more than the" in message
    hostmem.check_plan_host(hostmem.plan_host_memory(plan, traced.graph, "bfloat16", limit,
                                                     "--host-mem"), frozen=False)


def test_bf16_moments_train_like_fp32_moments(package):
    plan, out = package
    data = batches(1, plan.accum) * 12  # one batch again and again: a loss that falls
    losses = {}
    for states in ("float32", "bfloat16"):
        trainer = SwapTrainer.from_package(out, device="cpu",
                                           optimizer={"lr": 3e-3, "states": states})
        try:
            losses[states] = [trainer.step(b) for b in data]
            if states == "bfloat16":
                moments = trainer.optimizer.moments
                assert all(m.dtype == torch.bfloat16 for ms in moments for m in ms)
                state = trainer.optimizer.state_dict()
                assert any(s is not None for s in state)
        finally:
            trainer.close()
    a, b = losses["float32"], losses["bfloat16"]
    assert b[-1] < b[0] - 0.5  # it learns
    # within 2% of the float32 run's loss over the last five steps
    assert abs(sum(a[-5:]) - sum(b[-5:])) / sum(a[-5:]) < 0.02


def test_frozen_weights_have_no_optimizer_bytes(traced):
    frozen = tuple(traced.graph.params)
    graph = traced.graph.__class__(**{**traced.graph.__dict__, "frozen": frozen})
    plan = plan_from_cuts(traced, [], 1)
    host = hostmem.plan_host_memory(plan, graph)
    assert host.by_kind["optimizer_states"] == 0
    assert host.trainable_params == 0 and host.frozen_params == graph.num_params()


def test_partition_cli_refuses_host_mem_below_the_need(tmp_path, capsys):
    from atomc.cli import main

    prof = tmp_path / "gpt.profile.json"
    assert main(["profile", str(GPT_PATH), "--config", "tiny", "--batch-size", "2",
                 "--target", "rtx-3090", "-o", str(prof)]) == 0
    capsys.readouterr()
    rc = main(["partition", str(prof), "--gpu-mem", "20GiB", "--host-mem", "1KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "host memory (--host-mem)" in err[0]
    assert main(["partition", str(prof), "--gpu-mem", "20GiB", "--host-mem", "64GiB"]) == 0
    assert "host      " in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
