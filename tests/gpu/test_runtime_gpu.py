"""Swap runtime on CUDA: the streamed executor equals the CPU path and plain training on the GPU.

CUDA and CPU kernels round differently, so comparisons across devices run in float64 (1e-9);
dropout draws from the CUDA generator on the GPU, so runs with dropout are compared with the
plain model on the same GPU under the same RNG rule.
"""

from __future__ import annotations

import functools
import gc
import math
import sys
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import RuntimeMismatchError
from atomc.runtime import SwapTrainer, micro_batch_rng
from atomc.runtime.trace import replay_residency
from atomc.trace import trace_model

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
GPT_PATH = REPO / "examples" / "gpt.py"
sys.path.insert(0, str(REPO / "examples"))
import gpt

MICRO, SEQ = 2, 16


def make_package(tmp_path: Path, config: str, cut_names: tuple[str, ...], accum: int) -> Path:
    traced = trace_model(GPT_PATH, config, MICRO, device="cpu")
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    plan = plan_from_cuts(traced, [index[n] for n in cut_names], accum)
    out = tmp_path / f"{config}_pkg"
    generate(plan, out, traced=traced)
    return out


def batches(steps: int, C: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (C * MICRO, SEQ), generator=g) for _ in range(steps)]


def close(a: dict, b: dict, atol: float) -> None:
    for k, x in a.items():
        diff = (x.cpu() - b[k].cpu()).abs().max().item()
        assert diff <= atol, f"{k}: {diff}"


def test_cuda_executor_equals_cpu_path(tmp_path):
    pkg = make_package(tmp_path, "tiny", ("add_1", "h_1_ln_1"), 2)
    torch.manual_seed(0)
    state = {k: v.double() for k, v in gpt.build_model("tiny").state_dict().items()}
    opt = {"lr": 1e-3, "max_grad_norm": 1.0}
    runs = {}
    for device in ("cpu", "cuda"):
        trainer = SwapTrainer.from_package(pkg, device=device, state_dict=state, optimizer=opt,
                                           offload_activations=True, trace=True)
        losses = [trainer.step(b) for b in batches(3, 2)]
        runs[device] = (losses, trainer.export_state_dict(), trainer)
    assert runs["cuda"][0] == pytest.approx(runs["cpu"][0], rel=1e-10)
    close(runs["cuda"][1], runs["cpu"][1], 1e-9)
    cuda = runs["cuda"][2]
    assert cuda.store.image[0].is_pinned() and cuda.store.grad[0].is_pinned()
    assert cuda.executor.slots.max_resident <= 2
    trace = cuda.last_trace()
    assert replay_residency(trace, cuda.executor.slots.resident()) <= 2
    lanes = {e.lane for e in trace.events}
    assert {"compute", "prefetch", "offload", "optimizer"} <= lanes
    # pinned host memory: one arena per kind (images, gradients, activation stash)
    stash = cuda.executor.stash.arena
    assert (cuda.store.image_arena.storage.is_pinned() and stash is not None
            and stash.storage.is_pinned())
    assert all(b.is_pinned() for b in cuda.executor.stash.host.values())
    assert cuda.store.pinned_bytes() >= cuda.store.image_arena.nbytes + cuda.store.grad_arena.nbytes
    # a batch already on the device (made on the caller's stream, freed right after the step)
    on_device = SwapTrainer.from_package(pkg, device="cuda", state_dict=state, optimizer=opt,
                                         offload_activations=True)
    losses = [on_device.step(b.cuda()) for b in batches(3, 2)]
    assert losses == pytest.approx(runs["cuda"][0], rel=1e-10)
    close(on_device.export_state_dict(), runs["cuda"][1], 1e-9)
    on_device.close()
    for _, _, t in runs.values():
        t.close()


def test_cuda_dropout_equals_plain_training_on_the_gpu(tmp_path):
    pkg = make_package(tmp_path, "tiny-dropout", ("add_1", "h_1_ln_1"), 2)
    torch.manual_seed(0)
    ref = gpt.build_model("tiny-dropout").double().cuda()
    trainer = SwapTrainer.from_package(pkg, device="cuda", state_dict=ref.state_dict(),
                                       tied_grads="exact", optimizer={"lr": 1e-3})
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for step, batch in enumerate(batches(3, 2)):
        loss = trainer.step(batch)
        opt.zero_grad()
        total = 0.0
        for m, mb in enumerate(batch.cuda().chunk(2)):
            with micro_batch_rng(0, step, m, device="cuda"):
                out = gpt.loss_fn(ref(mb), (mb,))
            (out / 2).backward()
            total += out.item()
        opt.step()
        assert loss == pytest.approx(total / 2, rel=1e-10)
    close(trainer.export_state_dict(), ref.state_dict(), 1e-9)
    trainer.close()


def test_cuda_bf16_transfer_and_resume(tmp_path):
    pkg = make_package(tmp_path, "tiny", ("add_1", "h_1_ln_1"), 2)
    # one batch, repeated: the loss must fall (fresh random tokens need not)
    data = batches(1, 2) * 4
    full = SwapTrainer.from_package(pkg, device="cuda", transfer_dtype="bfloat16",
                                    optimizer={"lr": 1e-2})
    assert (full.store.image[0].dtype == torch.bfloat16
            and full.store.master[0].dtype == torch.float32)
    ckpt = tmp_path / "c.pt"
    losses = []
    for i, b in enumerate(data):
        losses.append(full.step(b))
        if i == 1:
            full.save_checkpoint(ckpt)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    resumed = SwapTrainer.from_package(pkg, device="cuda", transfer_dtype="bfloat16",
                                       optimizer={"lr": 1e-2}, checkpoint=ckpt)
    for b in data[2:]:
        resumed.step(b)
    a, b = full.export_state_dict(), resumed.export_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    full.close()
    resumed.close()


def test_device_smaller_than_the_budget_is_refused(tmp_path):
    pkg = make_package(tmp_path, "tiny", ("add_1",), 2)
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(RuntimeMismatchError, match=r"sub-model \d+ needs .* will not fit"):
        SwapTrainer.from_package(pkg, device="cuda", gpu_mem=total + (1 << 30))


@functools.cache
def _small_gpt(seq: int):
    """gpt3-small at `seq` tokens, traced and profiled on this GPU (once per test run)."""
    from atomc.profile import profile_model

    traced = trace_model(GPT_PATH, "gpt3-small", 1, options={"seq_len": seq}, device="cpu")
    return traced, profile_model(traced, device="cuda", repeats=1, progress=False)


@pytest.mark.parametrize("activations", ["recompute", "keep"])
def test_plans_fit_the_memory_they_were_made_for(tmp_path, activations):
    """The plan's memory model against the CUDA allocator: the package of the smallest budget
    that plans trains under a cap at that budget (set_per_process_memory_fraction), and the
    allocator's peak stays within it. A keep plan that counted one sub-model's saved
    activations, not every graph the runtime holds at the turn, ran out on an H200."""
    from atomc.errors import InfeasiblePlanError
    from atomc.partition import partition

    seq, C, reserve = 512, 4, 512 << 20
    traced, profile = _small_gpt(seq)
    weights = sum(s.num_bytes for s in traced.graph.params.values())
    plan = None
    for scale in (1.5, 2, 3, 4, 6, 8, 12):
        try:
            plan = partition(profile, reserve + int(scale * weights), reserve_bytes=reserve,
                             accum=C, activations=activations, cpu_adam_gbps=8.0)
            break
        except InfeasiblePlanError:
            continue
    assert plan is not None and len(plan.submodels) >= 3, plan
    pkg = generate(plan, tmp_path / "pkg", traced=traced)
    torch.manual_seed(0)
    state = gpt.build_model("gpt3-small", seq_len=seq).state_dict()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier tests of this process still hold
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (before + plan.capacity_bytes) / total))
    try:
        trainer = SwapTrainer.from_package(pkg, device="cuda", state_dict=state,
                                           optimizer={"lr": 1e-4})
        g = torch.Generator().manual_seed(0)
        vocab = gpt.CONFIGS["gpt3-small"].vocab_size
        for _ in range(2):
            assert math.isfinite(trainer.step(torch.randint(0, vocab, (C, seq), generator=g)))
        peak = torch.cuda.max_memory_allocated() - before
        trainer.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    print(f"{activations}: {len(plan.submodels)} sub-models at C = {C}, budget "
          f"{plan.capacity_bytes / 2**20:.0f} MiB (reserve {reserve >> 20}), allocator peak "
          f"{peak / 2**20:.0f} MiB")
    assert peak <= plan.capacity_bytes, (peak, plan.capacity_bytes)


def test_arenas_are_page_locked_where_they_lie_with_no_rounding():
    """A host arena page-locked with cudaHostRegister: its buffers are pinned, take exactly
    their bytes (PyTorch's pinned allocator would round 3 MiB + 1 up to 4 MiB), copy to the
    GPU and back without blocking, and the registration ends with the arena."""
    from atomc.runtime.pinned import HostArena

    arena = HostArena([((3 << 18,), torch.float32), ((1,), torch.uint8)], pin=True)
    assert all(b.is_pinned() for b in arena.buffers)
    assert arena.pinned_bytes() == arena.nbytes < 4 << 20
    src = arena.buffers[0]
    src.copy_(torch.arange(src.numel(), dtype=torch.float32))
    dev = src.to("cuda", non_blocking=True)
    back = HostArena([((src.numel(),), torch.float32)], pin=True).buffers[0]
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del arena, src
    gc.collect()
