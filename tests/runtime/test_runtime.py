"""Swap runtime: swapped training equals plain training of the original model; bad input is refused.

The reference is the unpartitioned model trained the plain way: for each micro-batch m of step
s, forward and loss under micro_batch_rng(seed, s, m) (the runtime's RNG rule), (loss / C)
.backward(); then clip_grad_norm_ and torch.optim.AdamW with the same settings. With
tied_grads="exact" (or C = 1, or no tie across sub-models) the swapped run gives the same bits;
with the default "fast" tie summation it is one rounding away per step.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from atomc.cli import main as atomc_main
from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import ModelFileError, RuntimeMismatchError, UsageError
from atomc.partition.hostmem import ARENA_ALIGN
from atomc.runtime import (
    SwapTrainer,
    TrainerConfig,
    check_device_memory,
    micro_batch_seed,
)
from atomc.runtime.checkpoint import load_checkpoint
from atomc.runtime.package import load_swap_package
from atomc.runtime.pinned import HostArena
from atomc.runtime.trace import replay_residency, to_timeline
from atomc.simulate import render_timeline_svg
from atomc.trace import load_model_file, trace_model

from helpers.plain import plain_run

REPO = Path(__file__).resolve().parents[2]
GPT_PATH = REPO / "examples" / "gpt.py"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SKIP_MLP = FIXTURES / "skip_mlp"
GPT_SPLIT = FIXTURES / "gpt_split"
sys.path.insert(0, str(REPO / "examples"))
import gpt  # noqa: E402 - importable once examples/ is on sys.path

MICRO = 2  # micro-batch size of the generated GPT packages
SEQ = 16


# ---------------------------------------------------------------------------------------------
# packages and runs


@pytest.fixture(scope="module")
def gpt_traced():
    return trace_model(GPT_PATH, "tiny-dropout", MICRO, device="cpu")


_PACKAGES: dict = {}


def gpt_package(traced, tmp_root: Path, cut_names: tuple[str, ...], accum: int) -> Path:
    """A generated package of tiny-dropout GPT cut before the named nodes (cached per test run)."""
    key = (cut_names, accum)
    if key not in _PACKAGES:
        index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
        plan = plan_from_cuts(traced, [index[n] for n in cut_names], accum)
        out = tmp_root / f"gpt_{'_'.join(cut_names) or 'whole'}_{accum}"
        generate(plan, out, traced=traced)
        _PACKAGES[key] = out
    return _PACKAGES[key]


@pytest.fixture(scope="module")
def pkg_root(tmp_path_factory):
    return tmp_path_factory.mktemp("packages")


def gpt_batches(steps: int, C: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (C * MICRO, SEQ), generator=g) for _ in range(steps)]


def swap_run(trainer, batches):
    return [trainer.step(b) for b in batches]


def fixture_package(tmp_path, name, cuts, C):
    """(package, model file) of tests/fixtures/NAME.py traced at batch 4, cut at `cuts`."""
    path = FIXTURES / f"{name}.py"
    traced = trace_model(path, None, 4, device="cpu")
    return (generate(plan_from_cuts(traced, cuts, C), tmp_path / name, traced=traced),
            load_model_file(path))


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert set(a) == set(b)
    for k, x in a.items():
        y = b[k]
        if atol == 0.0:
            assert torch.equal(x, y), f"{k}: max difference {(x - y).abs().max().item()}"
        else:
            assert torch.allclose(x, y, rtol=0, atol=atol), f"{k}: {(x - y).abs().max().item()}"


def gpt_model(dtype=torch.float32):
    torch.manual_seed(0)
    return gpt.build_model("tiny-dropout").to(dtype)


# ---------------------------------------------------------------------------------------------
# equivalence


CASES = [
    # cut before these nodes, C, dtype, options. On the CPU the updates run on the runtime's
    # thread unless threaded_optimizer=True (the CUDA default): some cases run them threaded
    pytest.param(("add_1", "h_1_ln_1"), 2, torch.float32, {}, id="3sub-C2-fp32"),
    pytest.param(("add_1", "h_1_ln_1"), 2, torch.float32, {"threaded_optimizer": True},
                 id="3sub-C2-fp32-threaded"),
    pytest.param(("h_1_ln_1",), 3, torch.float64, {"activations": "keep"}, id="2sub-C3-fp64-keep"),
    pytest.param((), 2, torch.float32, {}, id="1sub-C2-fp32"),
    pytest.param(("add", "add_1", "add_3"), 3, torch.float32,
                 {"offload_activations": True, "threaded_optimizer": True},
                 id="4sub-C3-fp32-offload-threaded"),
    pytest.param(("add_1", "ln_f"), 2, torch.float64, {"clip": 0.5}, id="3sub-C2-fp64-clip"),
    pytest.param(("add_1", "ln_f"), 2, torch.float64, {"clip": 0.5, "threaded_optimizer": True},
                 id="3sub-C2-fp64-clip-threaded"),
    # with 3+ sub-models a slot is loaded with another sub-model between a kept forward graph
    # and its backward, and again with the sub-model's own weights before that backward
    pytest.param(("add_1", "h_1_ln_1"), 2, torch.float32, {"activations": "keep"},
                 id="3sub-C2-fp32-keep"),
    pytest.param(("add", "add_1", "add_3"), 3, torch.float32, {"activations": "keep"},
                 id="4sub-C3-fp32-keep"),
]


@pytest.mark.parametrize("cuts, C, dtype, options", CASES)
def test_swapped_equals_plain_training_bitwise(gpt_traced, pkg_root, cuts, C, dtype, options):
    """Dropout on, tied embeddings across sub-models, several plans and C: the same bits."""
    options = dict(options)
    clip = options.pop("clip", None)
    pkg = gpt_package(gpt_traced, pkg_root, cuts, C)
    ref = gpt_model(dtype)
    trainer = SwapTrainer.from_package(pkg, device="cpu", state_dict=ref.state_dict(),
                                       tied_grads="exact",
                                       optimizer={"lr": 1e-2, "max_grad_norm": clip}, trace=True,
                                       **options)
    assert trainer.accum == C and len(trainer.store.layouts) == len(cuts) + 1
    batches = gpt_batches(3, C)
    swapped = swap_run(trainer, batches)
    plain = plain_run(ref, gpt.loss_fn, batches, C, clip=clip)
    assert swapped == plain
    assert_same(trainer.export_state_dict(), ref.state_dict())
    # never more than two sub-models' weights on the "device", every compute on a resident one
    assert trainer.executor.slots.max_resident <= 2
    for trace in trainer.traces.values():
        assert replay_residency(trace, trainer.executor.slots.resident()) <= 2
    trainer.close()


def test_keep_plans_count_every_graph_the_runtime_holds(gpt_traced, pkg_root):
    """With activations="keep" the runtime holds the autograd graphs of every sub-model from its
    forward to its backward, so at the turn all C micro-batches' saved activations of the whole
    model are on the device at once. The cost model must count them (a plan that counted one
    sub-model's ran out of memory on an H200: bench/RESULTS.md, 2026-11-26)."""
    import weakref

    from atomc.partition.cost import CostParams, plan_costs
    from atomc.partition.tables import build_tables, node_facts
    from atomc.profile import profile_model

    cut_names, C = ("add", "add_1", "add_3"), 3
    profile = profile_model(gpt_traced, target="v100-32gb", progress=False)
    index = {n.name: i for i, n in enumerate(profile.graph.nodes)}
    facts = node_facts(profile)
    tables = build_tables(facts, facts.num_nodes)
    costs = plan_costs(tables, CostParams(C, 1 << 40, 10.0, 10.0, activations="keep"),
                       [index[n] for n in cut_names])

    trainer = SwapTrainer.from_package(gpt_package(gpt_traced, pkg_root, cut_names, C),
                                       device="cpu", activations="keep",
                                       state_dict=gpt_model().state_dict())
    slots = {t.untyped_storage().data_ptr()
             for t in trainer.executor.slots.params + trainer.executor.slots.grads}
    live = peak = 0

    class Held:  # a saved tensor; its finaliser runs when autograd frees the graph holding it
        def __init__(self, t):
            nonlocal live, peak
            self.t = t
            if t.untyped_storage().data_ptr() in slots:  # a weight: a view of a slot
                return
            size = t.numel() * t.element_size()
            live += size
            peak = max(peak, live)

            def freed():
                nonlocal live
                live -= size
            weakref.finalize(self, freed)

    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        trainer.step(gpt_batches(1, C)[0])
    trainer.close()
    per_range = [C * int(tables.saved_bytes[c.start, c.stop - c.start]) for c in costs]
    everything = C * int(tables.saved_prefix[-1])
    # the runtime held more than any one sub-model's C micro-batches: every graph at the turn
    assert peak > 1.5 * max(per_range)
    assert peak == pytest.approx(everything, rel=0.25)
    # and the plan's memory of the last sub-model counts them all
    last = costs[-1]
    assert last.mem_fwd_bytes - last.param_bytes >= peak
    assert [c.checkpoint_ns for c in costs] == [0] * len(costs)  # nothing streams back in


def test_fast_tie_summation_is_one_rounding_away(gpt_traced, pkg_root):
    """Default tie summation (per holder): float64 within 1e-12, float32 within 1e-6."""
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    for dtype, atol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        ref = gpt_model(dtype)
        trainer = SwapTrainer.from_package(pkg, device="cpu", accum=3, state_dict=ref.state_dict(),
                                           optimizer={"lr": 1e-3})
        batches = gpt_batches(3, 3)
        swapped = swap_run(trainer, batches)
        plain = plain_run(ref, gpt.loss_fn, batches, 3, lr=1e-3)
        assert swapped == pytest.approx(plain, abs=atol * 10)
        assert_same(trainer.export_state_dict(), ref.state_dict(), atol=atol)
        trainer.close()


def test_hand_written_package_skip_connections_ints_and_middle_tie():
    """A value read two sub-models later, an int, the model input read by the last sub-model,
    a weight tied between sub-models 1 and 2, dropout; recompute/keep, offload, clipping."""
    mf = load_model_file(SKIP_MLP.parent / "skip_mlp_model.py")
    C = 3
    for acts, offload, clip, dtype in (("recompute", False, None, torch.float64),
                                       ("recompute", True, 0.05, torch.float32),
                                       ("keep", False, 0.05, torch.float64)):
        torch.manual_seed(0)
        ref = mf.build_model().to(dtype)
        trainer = SwapTrainer.from_package(SKIP_MLP, device="cpu", seed=5,
                                           state_dict=ref.state_dict(), activations=acts,
                                           offload_activations=offload, tied_grads="exact",
                                           optimizer={"lr": 1e-2, "max_grad_norm": clip})
        g = torch.Generator().manual_seed(3)
        batches = [torch.randn(C * 4, 8, generator=g, dtype=dtype) for _ in range(3)]
        swapped = swap_run(trainer, batches)
        plain = plain_run(ref, mf.loss_fn, batches, C, seed=5, clip=clip)
        assert swapped == plain
        assert_same(trainer.export_state_dict(), ref.state_dict())
        trainer.close()


def test_buffers_updated_once_and_recomputed_as_in_the_forward(tmp_path):
    """BatchNorm running statistics (buffers) in two sub-models, with dropout between."""
    pkg, mf = fixture_package(tmp_path, "bn_mlp_model", [3, 6], 3)
    for offload in (False, True):
        torch.manual_seed(0)
        ref = mf.build_model()
        trainer = SwapTrainer.from_package(pkg, device="cpu", seed=2, state_dict=ref.state_dict(),
                                           offload_activations=offload, optimizer={"lr": 1e-2})
        g = torch.Generator().manual_seed(4)
        batches = [torch.randn(12, 6, generator=g) for _ in range(3)]
        assert swap_run(trainer, batches) == plain_run(ref, mf.loss_fn, batches, 3, seed=2)
        exported = trainer.export_state_dict()
        assert "bn.running_mean" in exported and "bn2.num_batches_tracked" in exported
        assert_same(exported, ref.state_dict())
        trainer.close()


def test_a_stashed_value_keeps_its_memory_order_for_the_recomputation(tmp_path):
    """A transposed view crosses a cut and dropout reads it (WavLM): with the boundary values
    stashed on the host, the recomputation draws the forward's mask only if the stashed copy
    is laid out as the value was (dropout draws in memory order), in the first step (buffers
    made as values arrive) and after it (buffers in one arena)."""
    pkg, mf = fixture_package(tmp_path, "transposed_dropout_model", [4, 7], 2)
    torch.manual_seed(0)
    ref = mf.build_model()
    trainer = SwapTrainer.from_package(pkg, device="cpu", seed=2, state_dict=ref.state_dict(),
                                       offload_activations=True, optimizer={"lr": 1e-2})
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(8, 5, 6, generator=g) for _ in range(3)]
    assert swap_run(trainer, batches) == plain_run(ref, mf.loss_fn, batches, 2, seed=2)
    assert_same(trainer.export_state_dict(), ref.state_dict())
    assert any(not b.is_contiguous() for b in trainer.executor.stash.host.values())
    trainer.close()


def test_weights_the_graph_never_reads_survive_checkpoints_and_export(tmp_path):
    """An unused layer, parameter and buffer of the original model, and a layer whose result
    is unused: not trained, but carried through a checkpoint and back into
    export_state_dict(), which loads with strict=True into modules that require their
    state-dict format versions."""
    pkg, mf = fixture_package(tmp_path, "unread_weights_model", [2, 4], 2)
    torch.manual_seed(0)
    ref = mf.build_model()
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(8, 6, generator=g) for _ in range(4)]
    trainer = SwapTrainer.from_package(pkg, device="cpu", seed=2, state_dict=ref.state_dict(),
                                       optimizer={"lr": 1e-2})
    swap_run(trainer, batches[:2])
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    trainer.close()
    resumed = SwapTrainer.from_package(pkg, device="cpu", checkpoint=tmp_path / "ckpt.pt",
                                       optimizer={"lr": 1e-2})
    assert swap_run(resumed, batches[2:]) == plain_run(ref, mf.loss_fn, batches, 2, seed=2)[2:]
    exported = resumed.export_state_dict()
    assert_same(exported, ref.state_dict())  # the spares as they were, the rest as trained
    assert torch.equal(exported["spare_stats"], torch.arange(4.0))
    mf.build_model().load_state_dict(exported)  # strict, with the modules' format versions
    with pytest.raises(ValueError, match="format 2, not None"):
        mf.build_model().load_state_dict(dict(exported))  # which a plain dict lacks
    # the unused head's weights: held, not trained (a gradient of zeros would decay them)
    assert not any(p.requires_grad for sub in resumed.host_modules
                   for n, p in sub.named_parameters() if "side" in n)
    assert torch.equal(exported["side.weight"], ref.side.weight)
    assert not torch.equal(exported["shift"], torch.zeros(12))  # written in place: trained
    resumed.close()


def test_lr_schedule_weight_decay_groups_and_bf16_autocast(gpt_traced, pkg_root):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    ref = gpt_model()

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / 2) * 0.5 ** step

    def decays(fqn: str, shape: tuple) -> bool:
        return len(shape) >= 2

    trainer = SwapTrainer.from_package(
        pkg, device="cpu", state_dict=ref.state_dict(), tied_grads="exact", autocast="bfloat16",
        optimizer={"lr": 1e-2, "weight_decay": 0.1, "lr_schedule": schedule,
                   "decay_filter": decays})
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    batches = gpt_batches(3, 2)
    swapped = swap_run(trainer, batches)
    plain = plain_run(ref, gpt.loss_fn, batches, 2, groups=groups, schedule=schedule,
                      autocast=torch.bfloat16)
    assert swapped == plain
    assert_same(trainer.export_state_dict(), ref.state_dict())
    trainer.close()


def test_loss_scaling_is_exact_and_skips_overflowing_steps():
    mf = load_model_file(SKIP_MLP.parent / "skip_mlp_model.py")
    torch.manual_seed(0)
    ref = mf.build_model()
    trainer = SwapTrainer.from_package(SKIP_MLP, device="cpu", seed=5, state_dict=ref.state_dict(),
                                       loss_scale=True, tied_grads="exact", optimizer={"lr": 1e-2},
                                       threaded_optimizer=True)  # the scaler's wait, threaded
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(12, 8, generator=g) for _ in range(2)]
    assert swap_run(trainer, batches) == plain_run(ref, mf.loss_fn, batches, 3, seed=5)
    assert_same(trainer.export_state_dict(), ref.state_dict())  # a power-of-two scale is exact
    scale = trainer.optimizer.scaler.scale
    before = trainer.export_state_dict()
    bad = batches[0].clone()
    bad[0, 0] = float("inf")
    trainer.step(bad)
    trainer.wait()
    assert trainer.optimizer.last_skipped and trainer.optimizer.scaler.scale == scale / 2
    assert_same(trainer.export_state_dict(), before)
    trainer.close()


def test_micro_batch_list_equals_whole_batch_and_rng_is_restored(gpt_traced, pkg_root):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    state = gpt_model().state_dict()
    a = SwapTrainer.from_package(pkg, device="cpu", state_dict=state, optimizer={"lr": 1e-2})
    b = SwapTrainer.from_package(pkg, device="cpu", state_dict=state, optimizer={"lr": 1e-2})
    batch = gpt_batches(1, 2)[0]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    la = a.step(batch)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is untouched
    lb = b.step(list(batch.chunk(2)))
    assert la == lb
    assert_same(a.export_state_dict(), b.export_state_dict())
    assert micro_batch_seed(0, 1, 2) != micro_batch_seed(0, 2, 1)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------
# schedule, trace, residency


def test_schedule_trace_and_timeline(gpt_traced, pkg_root):
    pkg = gpt_package(gpt_traced, pkg_root, ("add", "add_1", "add_3"), 3)
    trainer = SwapTrainer.from_package(pkg, device="cpu", offload_activations=True, trace=True,
                                       optimizer={"lr": 1e-2})
    for batch in gpt_batches(3, 3):
        trainer.step(batch)
    traces = trainer.traces
    last = traces[max(traces)]
    k = 4
    compute = []
    for e in sorted(last.events, key=lambda e: e.start_ms):
        # a phase's span is cut between micro-batches while a load waits for its update (the
        # interpreter retries the load there): consecutive spans of one phase are one phase
        if e.lane == "compute" and (not compute or compute[-1] != (e.submodel, e.kind)):
            compute.append((e.submodel, e.kind))
    # forward P0..P2 once each (C micro-batches inside), P3 forward/backward per micro-batch,
    # then backward P2..P0
    assert compute[:3] == [(0, "forward"), (1, "forward"), (2, "forward")]
    assert compute[3:9] == [(3, "forward"), (3, "backward")] * 3
    assert compute[9:] == [(2, "backward"), (1, "backward"), (0, "backward")]
    loads = [(e.submodel, e.kind) for e in sorted(last.events, key=lambda e: e.start_ms)
             if e.lane == "prefetch" and e.kind in ("load", "refresh")]
    # P0 refreshed in place (it stayed resident), P1 refreshed, P2 and P3 loaded for the forward;
    # P3 and P2 stay for the backward; P1 and P0 loaded again. P1's refresh may go first while
    # P0's load waits for P0's update (the optimizer thread takes P0 last).
    assert sorted(loads[:2]) == [(0, "refresh"), (1, "refresh")]
    assert loads[2:] == [(2, "load"), (3, "load"), (1, "load"), (0, "load")]
    kinds = {(e.lane, e.kind) for e in last.events}
    assert {("offload", "offload"), ("optimizer", "optimizer"), ("offload", "checkpoint_out"),
            ("prefetch", "checkpoint")} <= kinds
    assert sum(1 for e in last.events if e.kind == "optimizer") == k
    assert 0 < last.busy_fraction() <= 1
    # after the first step every activation stash is a view into one arena (not pinned on the CPU)
    stash = trainer.executor.stash.host
    assert stash and {b.untyped_storage().data_ptr() for b in stash.values()} == {
        trainer.executor.stash.arena.storage.untyped_storage().data_ptr()}
    assert trainer.executor.pinned_bytes() == 0
    timeline = to_timeline(list(traces.values()), k, 3, label="measured")
    assert timeline.source == "measured" and timeline.num_steps == len(traces)
    svg = render_timeline_svg(timeline)
    assert "<svg" in svg and 'data-kind="forward"' in svg
    trainer.close()


def test_check_device_memory_names_the_submodel():
    check_device_memory(10 << 30, 16 << 30, [1 << 30] * 3, "cuda:0")  # fits: no error
    check_device_memory(10 << 30, 16 << 30, [1 << 30] * 3, "cuda:0", free_bytes=2 << 30)
    with pytest.raises(RuntimeMismatchError, match=r"sub-model 1 needs 9\.00 GiB"):
        check_device_memory(12 << 30, 8 << 30, [2 << 30, 9 << 30, 10 << 30], "cuda:0 (small)")
    # within the device, but not within what other processes left free
    with pytest.raises(RuntimeMismatchError, match=r"16.00 GiB in total, 2.00 GiB of it free; "
                                                   r"sub-model 1 needs 3.00 GiB .* free memory"):
        check_device_memory(10 << 30, 16 << 30, [1 << 30, 3 << 30, 3 << 30], "cuda:0",
                            free_bytes=2 << 30)


def test_host_buffers_are_views_of_one_arena_per_kind(gpt_traced, pkg_root):
    """One allocation per kind (page-locked once on CUDA, exactly its bytes)."""
    arena = HostArena([((3,), torch.float32), ((2, 5), torch.bfloat16), ((0,), torch.float64),
                       ((7,), torch.int64)], pin=False)
    starts = [b.storage_offset() * b.element_size() for b in arena.buffers]  # bytes into the arena
    assert starts == [0, ARENA_ALIGN, 2 * ARENA_ALIGN, 2 * ARENA_ALIGN]
    assert [b.shape for b in arena.buffers] == [(3,), (2, 5), (0,), (7,)]
    assert arena.nbytes == 2 * ARENA_ALIGN + 56 and arena.pinned_bytes() == 0
    pkg = gpt_package(gpt_traced, pkg_root, ("add", "add_1", "add_3"), 3)
    trainer = SwapTrainer.from_package(pkg, device="cpu", transfer_dtype="bfloat16")
    store = trainer.store
    for bufs, kind in ((store.image, store.image_arena),
                       (store.grads.arena.buffers, store.grads.arena)):
        base = kind.storage.data_ptr()
        assert len(bufs) == 4 and all(b.dtype == torch.bfloat16 and b.dim() == 1 for b in bufs)
        assert all(b.untyped_storage().data_ptr() == base and
                   b.storage_offset() * b.element_size() % ARENA_ALIGN == 0 for b in bufs)
    assert [b.numel() for b in store.image] == [L.numel for L in store.layouts]
    assert store.pinned_bytes() == 0  # nothing is pinned on the CPU
    assert store.host_bytes() >= 2 * sum(store.param_bytes(i) for i in range(4))
    trainer.close()


def test_fp16_autocast_turns_loss_scaling_on_by_default():
    def scaler(**kw):
        trainer = SwapTrainer.from_package(SKIP_MLP, device="cpu", **kw)
        on = trainer.optimizer.scaler is not None
        trainer.close()
        return on

    assert scaler(autocast="float16")  # fp32 weights, fp16 compute: fp16 gradients inside
    assert scaler(transfer_dtype="float16")
    assert not scaler(autocast="float16", loss_scale=False)
    assert not scaler(autocast="bfloat16") and not scaler()


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_resume_from_checkpoint_equals_uninterrupted_run(gpt_traced, pkg_root, tmp_path):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    opt = {"lr": 1e-2, "max_grad_norm": 1.0}
    batches = gpt_batches(6, 2)
    full = SwapTrainer.from_package(pkg, device="cpu", seed=3, optimizer=opt)
    ckpt = tmp_path / "ckpt.pt"
    for i, batch in enumerate(batches):
        full.step(batch)
        if i == 2:
            full.save_checkpoint(ckpt)
    resumed = SwapTrainer.from_package(pkg, device="cpu", optimizer=opt, checkpoint=ckpt)
    assert resumed.step_count == 3 and resumed.seed == 3
    for batch in batches[3:]:
        resumed.step(batch)
    assert_same(resumed.export_state_dict(), full.export_state_dict())
    # state_dict()/load_state_dict() round trip into a running trainer
    state = full.state_dict()
    resumed.load_state_dict(state)
    assert resumed.step_count == 6
    full.close()
    resumed.close()


def test_corrupt_or_foreign_checkpoints_are_refused_and_nothing_changes(gpt_traced, pkg_root,
                                                                        tmp_path, monkeypatch):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    trainer = SwapTrainer.from_package(pkg, device="cpu", optimizer={"lr": 1e-2})
    trainer.step(gpt_batches(1, 2)[0])
    good = tmp_path / "good.pt"
    trainer.save_checkpoint(good)
    good_bytes = good.read_bytes()
    trainer.step(gpt_batches(2, 2)[1])
    before = trainer.export_state_dict()

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good_bytes[: len(good_bytes) // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint" * 100)
    flipped = tmp_path / "flipped.pt"  # one byte of tensor data changed: the checksum catches it
    state = load_checkpoint(good)
    state["masters"][0][0] += 1.0
    torch.save({"format": "atomc.swap-checkpoint", "version": 1,
                "checksum": torch.load(good, weights_only=True)["checksum"], "state": state},
               flipped)
    for bad in (truncated, garbage, flipped, tmp_path / "missing.pt"):
        with pytest.raises(RuntimeMismatchError, match=r"nothing was loaded|does not exist"):
            trainer.load_checkpoint(bad)
        assert trainer.step_count == 2
        assert_same(trainer.export_state_dict(), before)

    other = SwapTrainer.from_package(SKIP_MLP, device="cpu")
    with pytest.raises(RuntimeMismatchError, match="belongs to plan"):
        other.load_checkpoint(good)
    with pytest.raises(RuntimeMismatchError, match="corrupt"):
        SwapTrainer.from_package(pkg, device="cpu", checkpoint=truncated)

    # a save that fails half way leaves the previous checkpoint whole
    def broken_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(good)
    monkeypatch.undo()
    assert good.read_bytes() == good_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    trainer.close()
    other.close()


# ---------------------------------------------------------------------------------------------
# bad input


def test_batch_of_another_shape_is_refused(gpt_traced, pkg_root):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    trainer = SwapTrainer.from_package(pkg, device="cpu")
    with pytest.raises(RuntimeMismatchError,
                       match=r"leading dimension of C x micro-batch = 2 x 2 = 4"):
        trainer.step(torch.randint(0, 256, (6, SEQ)))
    with pytest.raises(RuntimeMismatchError,
                       match=r"shape \[2, 8\], but the plan was made for \[2, 16\]"):
        trainer.step(torch.randint(0, 256, (4, 8)))
    with pytest.raises(RuntimeMismatchError, match="list of 3 micro-batches, expected C = 2"):
        trainer.step([torch.randint(0, 256, (2, SEQ))] * 3)
    with pytest.raises(RuntimeMismatchError, match=r"dtype torch\.float32, the plan expects int64"):
        trainer.step(torch.rand(4, SEQ))
    assert trainer.step_count == 0
    trainer.close()


def test_package_generated_for_another_plan_is_refused(gpt_traced, pkg_root, tmp_path):
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    other_plan = plan_from_cuts(gpt_traced, [20], 2)
    with pytest.raises(RuntimeMismatchError, match="was generated for plan"):
        SwapTrainer.from_package(pkg, device="cpu", plan=other_plan)
    own = plan_from_cuts(gpt_traced, [{n.name: i for i, n in enumerate(gpt_traced.graph.nodes)}[x]
                                      for x in ("add_1", "h_1_ln_1")], 2)
    SwapTrainer.from_package(pkg, device="cpu", plan=own).close()  # its own plan is accepted
    # a package whose plan.json was swapped for another plan's
    import shutil
    copy = tmp_path / "mixed"
    shutil.copytree(pkg, copy)
    other_plan.save(copy / "plan.json")
    with pytest.raises(RuntimeMismatchError, match="edited or mixed up"):
        SwapTrainer.from_package(copy, device="cpu")


def test_bad_settings_and_missing_model_file(tmp_path):
    with pytest.raises(UsageError, match="choose one of auto, recompute, keep"):
        SwapTrainer.from_package(SKIP_MLP, device="cpu", activations="sometimes")
    with pytest.raises(UsageError, match="needs activations 'auto' or 'recompute'"):
        SwapTrainer.from_package(SKIP_MLP, device="cpu", activations="keep",
                                 offload_activations=True)
    with pytest.raises(UsageError, match="optimizer implementation"):
        SwapTrainer.from_package(SKIP_MLP, device="cpu", optimizer={"impl": "magic"})
    with pytest.raises(UsageError, match="unknown"):
        SwapTrainer.from_package(SKIP_MLP, device="cpu", optimizer={"learning_rate": 1})
    with pytest.raises(RuntimeMismatchError, match=r"no __init__\.py"):
        SwapTrainer.from_package(tmp_path, device="cpu")
    with pytest.raises(UsageError, match=r"unknown trainer option acum; the options are .*accum"):
        SwapTrainer.from_package(SKIP_MLP, device="cpu", acum=2)
    with pytest.raises(UsageError, match="not a training dtype; choose one of float32"):
        SwapTrainer.from_package(SKIP_MLP, TrainerConfig(device="cpu", transfer_dtype="fp8"))
    # a config and keyword options over it; resolve fills the rest from the package's plan
    pkg = load_swap_package(SKIP_MLP)
    cfg = TrainerConfig.of({"device": "cpu", "accum": 5}, {"accum": 2, "transfer_dtype": "bf16"})
    run = cfg.resolve(pkg, None)
    assert (run.accum, run.transfer_dtype, run.autocast, run.loss_scale) == \
        (2, torch.bfloat16, torch.bfloat16, False)
    assert (run.activations, run.micro_batch, run.master_dtype) == \
        (pkg.plan.activations, pkg.plan.batch_size, torch.float32)
    assert TrainerConfig(dtype="float64").resolve(pkg, None).master_dtype == torch.float64
    assert TrainerConfig(transfer_dtype="half").resolve(pkg, None).loss_scale
    # a package whose model file is gone trains only with loss_fn= (and state_dict=)
    import shutil
    moved = tmp_path / "skip"
    shutil.copytree(SKIP_MLP, moved)
    init = moved / "__init__.py"
    init.write_text(init.read_text().replace('"skip_mlp_model.py"', '"nowhere/skip_mlp_model.py"'))
    with pytest.raises(ModelFileError, match="pass loss_fn="):
        SwapTrainer.from_package(moved, device="cpu")
    mf = load_model_file(SKIP_MLP.parent / "skip_mlp_model.py")
    trainer = SwapTrainer.from_package(moved, device="cpu", loss_fn=mf.loss_fn,
                                       state_dict=mf.build_model().state_dict())
    assert math.isfinite(trainer.step(torch.randn(12, 8)))
    trainer.close()


def test_fixture_package_and_train_cli(tmp_path, capsys):
    """The hand-written GPT split (contract fixture) trains through `atomc train` and resumes."""
    ckpt = tmp_path / "c.pt"
    timeline = tmp_path / "t.svg"
    text = tmp_path / "text.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 50)
    args = ["train", str(GPT_SPLIT), "--steps", "2", "--device", "cpu", "--data", str(text),
            "--checkpoint", str(ckpt), "--timeline", str(timeline)]
    assert atomc_main(args) == 0
    assert ckpt.is_file() and "<svg" in timeline.read_text()
    assert atomc_main(["train", str(GPT_SPLIT), "--steps", "3", "--data", str(text),
                       "--resume", str(ckpt), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "step 3: loss" in out
    assert atomc_main(["train", str(SKIP_MLP), "--steps", "1", "--device", "cpu"]) == 2
    assert "byte-level text" in capsys.readouterr().err


MOE = REPO / "tests" / "models" / "moe.py"


def moe_package(tmp_path: Path, C: int) -> tuple[Path, object]:
    """The mixture-of-experts model cut right after each router's `histc`: its expert counts
    (float, computed from the chosen experts' indices, no gradient in the model) cross the
    cuts, and the next sub-model takes an int32 `cumsum` of them."""
    traced = trace_model(MOE, None, MICRO, device="cpu")
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    plan = plan_from_cuts(traced, [index["cumsum"], index["cumsum_1"]], C)
    return generate(plan, tmp_path / "moe", traced=traced), traced


def test_boundary_values_take_gradients_exactly_when_the_model_gives_them_one(tmp_path):
    """A floating value without a gradient in the model crossing a cut stays without one: made
    a leaf that requires grad, the recomputation's integer cumsum of it failed ("Autograd not
    support dtype: Int"). Training equals plain AdamW's, bit for bit."""
    C = 2
    pkg, traced = moe_package(tmp_path, C)
    torch.manual_seed(0)
    ref = load_model_file(MOE).build_model()
    trainer = SwapTrainer.from_package(pkg, device="cpu", state_dict=ref.state_dict(),
                                       tied_grads="exact", optimizer={"lr": 1e-2})
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (C * MICRO, 8), generator=g) for _ in range(2)]
    swapped = swap_run(trainer, batches)
    plain = plain_run(ref, traced.module.loss_fn, batches, C)
    assert swapped == plain
    assert_same(trainer.export_state_dict(), ref.state_dict())
    package = load_swap_package(pkg)
    # the router's histc counts (named `counts` as the model's code does) carry none
    grads = [package.grads_at(i) for i in range(package.num_submodels)]
    assert not any(g & {"counts", "counts_2"} for g in grads)
    assert any("h" in g for g in grads)  # the residual stream does
    assert all(g.isdisjoint({"counts", "counts_2"}) for g in trainer.executor.grad_inputs)
    trainer.close()


def test_train_cli_names_a_vocabulary_smaller_than_bytes(tmp_path, capsys):
    """`atomc train` feeds byte values; a model with 64 token ids says so, not a traceback
    (before the step: on a GPU an out-of-range id is a device-side assertion)."""
    path = REPO / "tests" / "models" / "moe.py"
    traced = trace_model(path, None, 2, device="cpu")
    pkg = generate(plan_from_cuts(traced, []), tmp_path / "pkg", traced=traced)
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(128, 256)) * 4)
    assert atomc_main(["train", str(pkg), "--steps", "2", "--device", "cpu",
                       "--data", str(text)]) == 2
    err = capsys.readouterr().err
    assert "is not a token id of" in err and "(0-63)" in err and "0-255" in err


def test_norm_weights_stay_float32_in_a_bfloat16_image(gpt_traced, pkg_root):
    """Half-precision images keep the package's FULL_PRECISION weights (LayerNorms) in float32:
    wide entries at even offsets, bound on the device as float32, refreshed without rounding."""
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    ref = gpt_model()
    trainer = SwapTrainer.from_package(pkg, device="cpu", state_dict=ref.state_dict(),
                                       transfer_dtype="bfloat16")
    full = set(trainer.package.full_precision)
    assert full and all(".ln_" in k or k.startswith("ln_f.") for k in full)
    trainer.step(gpt_batches(1, 2)[0])
    trainer.wait()  # step() returns with the last sub-models' updates still running on their thread
    store = trainer.store
    for i, L in enumerate(store.layouts):
        assert store.image[i].dtype == torch.bfloat16
        device_params = dict(trainer.executor.modules[i].named_parameters())
        for e in L.entries:
            assert e.wide == (e.key in full)
            want = torch.float32 if e.wide else torch.bfloat16
            assert device_params[e.local].dtype == want
            if e.wide:
                assert e.offset % 2 == 0 and e.span == 2 * e.numel
                master = store.read_entry(i, e).view(-1)
                assert torch.equal(e.image_view(store.image[i]).view(-1), master)
    trainer.close()


def test_runtime_executes_the_schedule_the_simulator_times(gpt_traced, pkg_root):
    """The recorded trace, lane by lane and mapped to actions, is the plan's action list: the
    list atomc.simulate times (no reload of P_{k-2} before its backward, for one)."""
    from atomc.actions import atom_order, runs

    pkg = gpt_package(gpt_traced, pkg_root, ("add", "add_1", "add_3"), 3)
    # updates on the caller's thread: each ends before the next action is issued, so no load
    # waits for its weights' update and the lanes keep the list's order exactly (a threaded
    # update may let 1L go ahead of a 0L still waiting for P_0's update)
    trainer = SwapTrainer.from_package(pkg, device="cpu", trace=True, optimizer={"lr": 1e-2},
                                       threaded_optimizer=False)
    for batch in gpt_batches(2, 3):
        trainer.step(batch)
    last = trainer.traces[max(trainer.traces)]
    kind_of = {"forward": "F", "backward": "B", "load": "L", "refresh": "L", "offload": "O",
               "optimizer": "U"}
    measured = {lane: [(kind_of[e.kind], e.submodel)
                       for e in sorted(last.events, key=lambda e: e.start_ms)
                       if e.lane == lane and e.kind in kind_of]
                for lane in ("compute", "prefetch", "offload", "optimizer")}
    planned = [(kind, i) for kind, i, _ in runs(atom_order(4, 3))]
    assert measured["compute"] == [x for x in planned if x[0] in "FB"]
    assert measured["prefetch"] == [x for x in planned if x[0] == "L"]
    assert measured["offload"] == [x for x in planned if x[0] == "O"]
    assert sorted(measured["optimizer"]) == sorted(x for x in planned if x[0] == "U")
    assert ("L", 2) not in measured["prefetch"][3:]  # P_2 stays in its slot into its backward
    trainer.close()


def test_cpu_updates_run_on_the_runtime_thread_unless_asked(gpt_traced, pkg_root):
    """On a CPU device the update runs at its place in the schedule on the runtime's thread:
    a thread of its own took a core from the compute (bench/RESULTS.md, 2026-11-26). Asked
    for (the CUDA default), the updates run on their thread and a step returns before they
    end."""
    pkg = gpt_package(gpt_traced, pkg_root, ("add_1", "h_1_ln_1"), 2)
    inline = SwapTrainer.from_package(pkg, device="cpu", optimizer={"lr": 1e-2})
    threaded = SwapTrainer.from_package(pkg, device="cpu", optimizer={"lr": 1e-2},
                                        threaded_optimizer=True)
    try:
        assert inline.optimizer._pool is None and threaded.optimizer._pool is not None
        for batch in gpt_batches(2, 2):
            inline.step(batch)
            threaded.step(batch)
            assert all(f is None or f.done() for f in inline.optimizer.update_future)
        threaded.wait()
        assert_same(inline.export_state_dict(), threaded.export_state_dict())
    finally:
        inline.close()
        threaded.close()


@pytest.mark.parametrize("transfer, threaded", [("float64", False), ("bfloat16", True)],
                         ids=["direct-fp64", "split-bf16-threaded"])
def test_a_ring_of_gradient_buffers_trains_as_one_buffer_per_sub_model(gpt_traced, tmp_path,
                                                                       transfer, threaded):
    """The plan's ring (its simulated steps hold at most one sub-model's gradients at once on
    a CPU: two buffers) for four sub-models whose tied output layer's gradient comes back
    first: the same losses and weights, bit for bit, as a buffer per sub-model; the updates
    on a thread of their own wait for buffers to come back. In float64 it is plain AdamW's."""
    import dataclasses

    from atomc.partition.hostmem import plan_host_memory

    index = {n.name: i for i, n in enumerate(gpt_traced.graph.nodes)}
    plan = plan_from_cuts(gpt_traced, [index[n] for n in ("add", "add_1", "add_3")], 2)
    host = plan_host_memory(plan, gpt_traced.graph)
    assert host.grad_slots == 2
    ring = generate(dataclasses.replace(plan, host=host), tmp_path / "ring", traced=gpt_traced)
    whole = generate(plan, tmp_path / "whole", traced=gpt_traced)
    dtype = torch.float64 if transfer == "float64" else torch.float32
    ref = gpt_model(dtype)
    options = {"device": "cpu", "state_dict": ref.state_dict(), "threaded_optimizer": threaded,
               "optimizer": {"lr": 1e-2}, "transfer_dtype": transfer}
    a = SwapTrainer.from_package(ring, **options)
    b = SwapTrainer.from_package(whole, **options)
    assert a.store.grads.ring and a.store.grads.num_slots == 2 and not b.store.grads.ring
    assert a.store.tied_sums  # the tied weight's holder gives its buffer back first
    batches = gpt_batches(3, 2)
    assert swap_run(a, batches) == swap_run(b, batches)
    assert_same(a.export_state_dict(), b.export_state_dict())
    assert a.optimizer.step_grad_norm() == b.optimizer.step_grad_norm()
    if transfer == "float64":
        losses = plain_run(ref, gpt.loss_fn, batches, 2)
        assert len(losses) == 3
        assert_same(a.export_state_dict(), ref.state_dict(), atol=1e-12)
    a.close()
    b.close()
