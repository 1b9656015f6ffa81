"""Host memory in the plan (atomc.partition.hostmem): the plan's figure is what the runtime
allocates, a plan over --host-mem is refused with the numbers, bfloat16 moments halve the
optimizer's bytes and train like float32 ones, frozen weights cost no moments."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import UsageError
from atomc.partition import hostmem
from atomc.profile import hardware_names
from atomc.runtime import SwapTrainer
from atomc.trace import trace_model

from processes import child_env

REPO = Path(__file__).resolve().parents[2]
GPT_PATH = REPO / "examples" / "gpt.py"
MICRO, SEQ = 2, 16


@pytest.fixture(scope="module")
def traced():
    return trace_model(GPT_PATH, "tiny", MICRO, device="cpu")


@pytest.fixture(scope="module")
def package(traced, tmp_path_factory):
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    # three sub-models; the output layer's weight (tied to the embedding) in the last
    plan = plan_from_cuts(traced, [index["h_1_ln_1"], index["ln_f"]], 2)
    out = generate(plan, tmp_path_factory.mktemp("pkg") / "gpt", traced=traced)
    return plan, out


def batches(steps, C, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (C * MICRO, SEQ), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("transfer, states, slots", [
    ("float32", "float32", None), ("float32", "bfloat16", 2), ("bfloat16", "float32", None),
    ("bfloat16", "bfloat16", 2)], ids=["direct", "direct-bf16-moments-ring", "split",
                                       "split-bf16-moments-ring"])
def test_plan_host_bytes_are_what_the_store_and_optimizer_allocate(traced, package, transfer,
                                                                   states, slots):
    """Kind by kind, the formula's bytes are what the store and the optimizer allocate: images,
    gradient buffers (a ring of two, the tied weights' sums), masters beyond the images (a
    split store's residuals), moments and the update's scratch."""
    plan, out = package
    trainer = SwapTrainer.from_package(out, device="cpu", transfer_dtype=transfer,
                                       optimizer={"lr": 1e-3, "states": states})
    trainer.close()
    if slots is not None:  # the same run with a ring of gradient buffers
        from atomc.runtime.executor import SwapExecutor
        from atomc.runtime.optim import AdamWConfig
        from atomc.runtime.steprun import StepOptions
        from atomc.runtime.trace import Tracer

        modules = trainer.package.build_submodels()
        ex = SwapExecutor.assemble(
            trainer.package, modules, AdamWConfig(lr=1e-3, states=states), device=torch.device(
                "cpu"), master_dtype=torch.float32, transfer_dtype=getattr(torch, transfer),
            tracer=Tracer(torch.device("cpu"), enabled=False), threaded=False, grad_slots=slots,
            step=StepOptions(accum=plan.accum, activations="recompute",
                             offload_activations=False, autocast_dtype=None,
                             loss_fn=trainer.executor.loss_fn, seed=0))
        store, opt = ex.store, ex.opt
        assert store.grads.ring and store.grads.num_slots == slots
    else:
        store, opt = trainer.store, trainer.optimizer
    planned = store.planned_bytes(states)
    scratch = sum(t.numel() * t.element_size() for t in opt.scratch)
    moments = sum(m.numel() * m.element_size() for pair in store.moments for m in pair)
    tied = sum(t.numel() * t.element_size() for t in store.tied_sums.values())
    assert planned["transfer_copies"] == store.image_arena.nbytes
    assert planned["gradient_buffers"] == store.grads.arena.nbytes + tied
    assert planned["optimizer_states"] == moments + scratch
    assert planned["masters"] == (
        sum(r.numel() * 2 for r in store.residual) if transfer == "bfloat16" else 0)
    assert sum(planned.values()) == store.host_bytes() + scratch
    if slots is not None:
        assert tied > 0  # the tiny GPT ties its output layer to its embedding
    if (transfer, states) == ("float32", "float32"):  # the plan's own figure
        # one gradient buffer per sub-model, as a clipping run holds
        host = hostmem.plan_host_memory(plan, traced.graph, clipping=True)
        assert host.by_kind == {**planned, "activation_stash": 0} and host.grad_slots == 0


def test_split_masters_are_exact_and_their_images_round_to_nearest():
    """A float32 master kept as its bfloat16 image and an int16 residual comes back exactly;
    the image is round-to-nearest (ties away from zero, where .to(bfloat16) breaks them to
    even), over the float32 range and its specials."""
    from atomc.runtime.masters import join_master, split_master

    g = torch.Generator().manual_seed(0)
    values = torch.randn(1 << 16, generator=g) * torch.logspace(-38, 38, 1 << 16)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45,
                             3.4028235e38, -3.4028235e38, 1.0, -1.0])
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x407F8000], dtype=torch.int32)
    master = torch.cat([values, specials, ties.view(torch.float32)])
    image = torch.empty(master.numel(), dtype=torch.int16)
    residual = torch.empty_like(image)
    split_master(master, image, residual)
    back = torch.empty_like(master)
    join_master(image, residual, back)
    assert torch.equal(back.view(torch.int32), master.view(torch.int32))
    rne = master.to(torch.bfloat16).view(torch.int16)
    ties = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert ((rne != image) <= ties).all() and (rne != image)[-3:].tolist() == [True, False, True]
    finite = master.isfinite()
    error = (image.view(torch.bfloat16).float() - master).abs()[finite]
    assert (error <= (rne.view(torch.bfloat16).float() - master).abs()[finite]).all()


def test_plan_over_host_mem_is_refused_with_the_numbers_and_bf16_moments_fit(traced,
                                                                             monkeypatch):
    # bfloat16 moments save what their update's float32 scratch does not take back: a chunk
    # of 16 MiB beside a real model's gigabytes, here a chunk of 4096 elements
    monkeypatch.setattr(hostmem, "UPDATE_CHUNK", 4096)
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
                moments = trainer.store.moments
                assert all(m.dtype == torch.bfloat16 for ms in moments for m in ms)
                state = trainer.optimizer.state_dict()
                assert any(s is not None for s in state)
        finally:
            trainer.close()
    a, b = losses["float32"], losses["bfloat16"]
    assert b[-1] < b[0] - 0.5  # it learns
    # within 2% of the float32 run's loss over the last five steps
    assert abs(sum(a[-5:]) - sum(b[-5:])) / sum(a[-5:]) < 0.02


def bf16_run(out, accum, steps, chunk, monkeypatch, impl="fused"):
    """A bfloat16-moment trainer whose updates go in chunks of `chunk` elements, after
    `steps` steps (the caller closes it)."""
    monkeypatch.setattr(hostmem, "UPDATE_CHUNK", chunk)
    trainer = SwapTrainer.from_package(out, device="cpu", optimizer={
        "lr": 3e-3, "states": "bfloat16", "impl": impl})
    for b in batches(steps, accum):
        trainer.step(b)
    trainer.wait()
    return trainer


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_bf16_moments_update_in_chunks_with_the_bits_of_one_update(package, monkeypatch, impl):
    """Chunks of 1600 elements (weights of 8192 split in five, small ones packed together) give
    the masters and moments of one update per sub-model, bit for bit."""
    plan, out = package
    whole = bf16_run(out, plan.accum, 3, 1 << 30, monkeypatch, impl)
    chunked = bf16_run(out, plan.accum, 3, 1600, monkeypatch, impl)
    try:
        opt = chunked.optimizer
        assert all(len(o.chunks) == 1 for o in whole.optimizer.optims if o is not None)
        assert sum(len(o.chunks) for o in opt.optims if o is not None) > 2 * len(opt.optims)
        assert any(len(pieces) > 1 for o in opt.optims if o is not None for pieces in o.steps)
        assert [s.numel() for s in opt.scratch] == [1600] * 4
        for i in range(len(opt.optims)):
            assert torch.equal(chunked.store.read_master(i), whole.store.read_master(i))
            for a, b in zip(chunked.store.moments[i], whole.store.moments[i]):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b)
        assert chunked.store.read_master(0).abs().sum() > 0
    finally:
        whole.close()
        chunked.close()


def test_bf16_moment_bytes_are_the_plans_and_survive_a_state_dict(traced, package, monkeypatch):
    """What the chunked update allocates (bfloat16 moments and a chunk of float32 scratch) is
    the plan's figure; its state dict loads back into bfloat16 and into float32 moments."""
    plan, out = package
    trainer = bf16_run(out, plan.accum, 2, 1600, monkeypatch)
    fresh = bf16_run(out, plan.accum, 0, 1600, monkeypatch)
    wide = SwapTrainer.from_package(out, device="cpu", optimizer={"lr": 3e-3})
    try:
        opt = trainer.optimizer
        allocated = (sum(m.nbytes for ms in trainer.store.moments for m in ms)
                     + sum(s.nbytes for s in opt.scratch))
        planned = hostmem.plan_host_memory(plan, traced.graph, "bfloat16", clipping=True)
        assert planned.by_kind["optimizer_states"] == allocated
        assert trainer.store.planned_bytes("bfloat16")["optimizer_states"] == allocated
        state = opt.state_dict()
        fresh.optimizer.load_state_dict(state)
        wide.optimizer.load_state_dict(state)
        for i, o in enumerate(opt.optims):
            if o is None:
                continue
            for a, b in zip(fresh.store.moments[i], trainer.store.moments[i]):
                assert torch.equal(a, b)
            assert all(float(t) == 2.0 for pieces in fresh.optimizer.optims[i].steps
                       for t in pieces)
            direct = wide.optimizer.optims[i]
            for p, where in zip(direct.params, o.wheres):
                assert direct.opt.state[p]["exp_avg"].dtype == torch.float32
                assert torch.equal(direct.opt.state[p]["exp_avg_sq"].view(-1),
                                   trainer.store.moments[i][1][where].float())
    finally:
        for t in (trainer, fresh, wide):
            t.close()


def test_frozen_weights_have_no_optimizer_bytes(traced):
    frozen = tuple(traced.graph.params)
    graph = traced.graph.__class__(**{**traced.graph.__dict__, "frozen": frozen})
    plan = plan_from_cuts(traced, [], 1)
    host = hostmem.plan_host_memory(plan, graph)
    assert host.by_kind["optimizer_states"] == 0
    assert host.trainable_params == 0 and host.frozen_params == graph.num_params()


def test_train_cli_refuses_a_run_over_the_available_memory_before_pinning(package, tmp_path,
                                                                           monkeypatch, capsys):
    """`atomc train` checks the plan's host bytes against MemAvailable (plus the weights it
    already read) before the host store exists: exit 2, one line naming the bytes and the
    remedies; nothing allocated or pinned."""
    import numpy as np

    from atomc.cli import main
    from atomc.runtime.executor import SwapExecutor

    _, out = package
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(4096, dtype=np.int32) % 256)
    assembled = []
    monkeypatch.setattr(SwapExecutor, "assemble",
                        classmethod(lambda cls, *a, **k: assembled.append(a)))
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 0)
    rc = main(["train", str(out), "--steps", "1", "--device", "cpu", "--data", str(tokens)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and not assembled
    assert "atomc train: host memory (MemAvailable plus the weights already read)" in err[0]
    assert "optimizer moments" in err[0] and "--optimizer-states bfloat16" in err[0]


@pytest.fixture(scope="module")
def estimated(tmp_path_factory):
    """An estimated profile of the tiny GPT for --target rtx-3090."""
    from atomc.cli import main

    prof = tmp_path_factory.mktemp("estimated") / "gpt.profile.json"
    assert main(["profile", str(GPT_PATH), "--config", "tiny", "--batch-size", "2",
                 "--target", "rtx-3090", "-o", str(prof)]) == 0
    return prof


def with_hardware(profile_path, out, **changes):
    """The profile at `profile_path` with its hardware profile changed, saved to `out`."""
    from dataclasses import replace

    from atomc.ir import Profile
    from atomc.profile import load_hardware

    profile = Profile.load(profile_path)
    name = changes.pop("name", profile.hardware.name)
    replace(profile, hardware=replace(load_hardware(name), **changes)).save(out)
    return out


def test_a_target_plan_is_checked_against_the_host_its_hardware_profile_states(
        estimated, tmp_path, capsys):
    from atomc.cli import main
    from atomc.ir import Plan

    plan_path = tmp_path / "gpt.plan.json"
    assert main(["partition", str(estimated), "--gpu-mem", "20GiB", "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    host = Plan.load(plan_path).host
    assert host.limit_bytes == 128 << 30 and "hardware profile rtx-3090" in host.limit_source
    assert "fits 128.00 GiB (the host hardware profile rtx-3090 states" in out
    # a stated host the run does not fit in: refused in one line, --host-mem named
    small = with_hardware(estimated, tmp_path / "small.profile.json", host_memory_bytes=4096)
    assert main(["partition", str(small), "--gpu-mem", "20GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hardware profile rtx-3090" in err[0] and "--host-mem" in err[0]
    assert "more than the 4.00 KiB there" in err[0]
    # --host-mem wins over the stated host
    assert main(["partition", str(small), "--gpu-mem", "20GiB", "--host-mem", "1GiB"]) == 0


def test_a_target_plan_without_a_stated_host_says_it_was_not_checked(estimated, tmp_path,
                                                                       capsys):
    from atomc.cli import main
    from atomc.ir import Plan
    from atomc.profile import load_hardware

    assert load_hardware("t4").host_memory_bytes is None
    t4 = with_hardware(estimated, tmp_path / "t4.profile.json", name="t4")
    plan_path = tmp_path / "t4.plan.json"
    assert main(["partition", str(t4), "--gpu-mem", "14GiB", "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    host = Plan.load(plan_path).host
    assert host.limit_bytes == 0
    line = next(x for x in out.splitlines() if x.startswith("host "))
    assert "not checked: hardware profile t4 states no host memory" in line
    assert "give --host-mem SIZE" in line


@pytest.mark.parametrize("name", hardware_names())
def test_every_shipped_host_memory_figure_is_sourced(name):
    from atomc.profile import load_hardware

    hw = load_hardware(name)
    [sentence] = [x for x in hw.sources if x.startswith("Host memory")]
    if hw.host_memory_bytes is None:
        assert sentence.startswith("Host memory not stated") and "--host-mem" in sentence
    else:
        assert sentence.startswith(f"Host memory {hw.host_memory_bytes / 2**30:g} GiB: ")


def test_partition_cli_refuses_host_mem_below_the_need(estimated, capsys):
    from atomc.cli import main

    prof = estimated
    rc = main(["partition", str(prof), "--gpu-mem", "20GiB", "--host-mem", "1KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "host memory (--host-mem)" in err[0]
    assert main(["partition", str(prof), "--gpu-mem", "20GiB", "--host-mem", "64GiB"]) == 0
    assert "host      " in capsys.readouterr().out


def test_frozen_weights_cost_the_plan_no_gradient_offload_or_update(traced):
    """The partitioner charges a frozen weight (a LoRA model's base) what the runtime spends on
    it: its load, but no gradient slot, offload or CPU update; the checker agrees."""
    from atomc.partition import partition
    from atomc.partition.check import check_plan
    from atomc.profile import profile_model

    profile = profile_model(traced, target="v100-32gb", progress=False)
    frozen = tuple(traced.graph.params)
    graph = dataclasses.replace(profile.graph, frozen=frozen)
    still = dataclasses.replace(profile, graph=graph)
    trains = partition(profile, 1 << 20, reserve_bytes=0, accum=2, activations="recompute")
    plan = partition(still, 1 << 20, reserve_bytes=0, accum=2, activations="recompute")
    assert any(s.optimizer_ms > 0 and s.offload_ms > 0 for s in trains.submodels)
    assert all(s.optimizer_ms == 0 and s.offload_ms == 0 for s in plan.submodels)
    assert check_plan(still, plan) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


HELD_PROBE = '''
import sys, torch
from atomc.runtime.hostalloc import return_freed_blocks


def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024


if sys.argv[1] == "fixed":
    assert return_freed_blocks()
first = torch.ones(4 << 20)
del first  # a freed 16 MiB block raises glibc's mmap threshold to its size
before = rss()
blocks = [torch.ones(4 << 20) for _ in range(8)]
kept = blocks[-1]
del blocks
print((rss() - before) >> 20)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_blocks_go_back_to_the_system_with_the_threshold_fixed():
    """glibc keeps freed blocks of a size it saw freed before in its heap: seven freed 16 MiB
    tensors stay in the process's memory, where the plan counts none; with the runtime's
    fixed threshold (atomc.runtime.hostalloc) only the one still held does."""
    held = {}
    env = {k: v for k, v in child_env().items() if k != "MALLOC_MMAP_THRESHOLD_"}
    for mode in ("default", "fixed"):
        done = subprocess.run([sys.executable, "-c", HELD_PROBE, mode], capture_output=True,
                              text=True, env=env,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        held[mode] = int(done.stdout.strip().splitlines()[-1])
    assert held["fixed"] <= 17 and held["default"] >= 64, held
