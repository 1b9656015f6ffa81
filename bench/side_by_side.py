"""Side-by-side benchmark (issue 32): atomc against what a user would run instead, on one device,
one model, one dtype and the same tokens per weight pass, all in one run.

For each Llama-shaped preset of examples/hf.py (`llama-1.3b`, `llama-2.7b`, `llama-6.7b`:
random weights, nothing downloaded), every contender trains the same initial weights on the
same token batches: C micro-batches of `--micro-batch` rows of `--seq-len` tokens per step.

- **atomc**, one row per activation policy of `--policies` (default auto,recompute,keep):
  traced and profiled on this device, planned for `--gpu-mem` at one C (the first policy that
  plans chooses it, unless `--accum` does; the others are planned at the same C), generated and
  trained by the swap runtime, on CUDA under an allocator cap of the budget. A policy the
  installed atomc does not accept, or whose plan does not fit the budget, is printed with the
  reason. `--calibrate-steps N` first calibrates the profile on N traced steps of the first
  plan (as `atomc calibrate` does) and plans every policy from the calibrated profile; the
  measured profile is timed in float32, so for a bfloat16 run only a calibrated prediction
  reflects bfloat16 compute.
- **resident**: the plain model on the device, AdamW on the device (fused on CUDA).
- **resident-ckpt**: the same with every decoder layer checkpointed (transformers'
  `gradient_checkpointing_enable`: `torch.utils.checkpoint` per block, non-reentrant).
- **fsdp2**, **fsdp2-ckpt**: `fully_shard(..., offload_policy=CPUOffloadPolicy())` on every
  decoder layer and the root, one process (world size 1): parameters, gradients and the
  optimizer on the host; bfloat16 through `MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`. Without and with checkpointing.
- **megatrain**: github DLYuanGod/MegaTrain from the checkout at `--megatrain DIR`, driven by
  bench/megatrain_driver.py (read it for what is set and why): one batch of C x micro-batch
  rows per step, which is one weight pass for it.
- **deepspeed**: ZeRO-3 with parameters and optimizer offloaded to the host
  (`offload_param`/`offload_optimizer` device cpu, bf16), when `import deepspeed` works; its CPU
  Adam is compiled at first use (ninja and the host compiler). Otherwise the row says why.

Precision (`--dtype`, default bfloat16): float32 master weights and optimizer state (on the host
for atomc, FSDP2 and DeepSpeed; on the device for resident), bfloat16 device copies and
autocast for atomc (the plan's transfer dtype), autocast for resident, MixedPrecisionPolicy for
FSDP2. MegaTrain keeps bfloat16 masters on the host, as its own training script loads the
model (bench/megatrain_driver.py says why it cannot do otherwise). `--dtype float32`: TF32
matmuls for every contender. atomc's profile is timed in float32 with TF32 in either case.

Reported per contender: tokens/s; model TFLOPS = 6 x parameters x tokens / step time; MFU
against the device's peak for the dtype (bfloat16, or TF32 for float32) from atomc's hardware
profiles (`--hardware NAME`, or the profile whose name's model, e.g. h100, is in the device's
name); the fraction of the resident run; the link's busy share in each direction (the union of
the host-to-device, and of the device-to-host, copies on the device's timeline in one extra step
recorded by torch.profiler, over that step's wall time); the peak device memory; the first
step's loss (the same weights and batch for all: a contender that trains another function
shows it there). For atomc also the plan's predicted step as tokens/s and predicted/measured.
Then the ratios of each atomc policy to resident, MegaTrain and FSDP2 (the faster FSDP2 row),
measured in this run, and the markdown rows of bench/RESULTS.md's side-by-side table.

`--smoke` runs everything that runs on a CPU at `tiny-llama` in a few seconds (resident,
resident-ckpt and the atomc policies; the CUDA-only contenders print why they are skipped);
tests/test_bench_side_by_side.py runs it. Without CUDA and without `--smoke` or `--device cpu`
the script says so and exits 0.

    python bench/side_by_side.py [--configs llama-1.3b,llama-2.7b] [--gpu-mem 8GiB]
        [--seq-len 2048] [--micro-batch 1] [--accum C] [--dtype bfloat16|float32]
        [--policies auto,recompute,keep] [--contenders atomc,resident,...] [--megatrain DIR]
        [--steps 3] [--warmup 2] [--calibrate-steps 0] [--hardware h100-80gb] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples", ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench._provenance import commit

HF_PATH = ROOT / "examples" / "hf.py"
# in the order they run: the ones the targets compare against first, so that a run cut short
# by its time limit keeps them
CONTENDERS = ("atomc", "resident", "megatrain", "fsdp2", "resident-ckpt", "fsdp2-ckpt",
              "deepspeed")
POLICIES = ("auto", "recompute", "keep")
SMOKE = {"configs": "tiny-llama", "seq_len": 16, "micro_batch": 1, "accum": 2,
         "gpu_mem": "1350KiB", "reserve": "1MiB", "steps": 1, "warmup": 1,
         "cpu_adam_gbps": "8"}

DEEPSPEED_MISSING = (
    "deepspeed does not import here ({why}). PyPI has deepspeed 0.19.8 only as a source "
    "archive; a py3-none-any wheel built from it (DS_BUILD_OPS=0, ops compiled at first use) "
    "and its missing needs (hjson, pydantic, pydantic-core, annotated-types, "
    "typing-inspection) can be carried in .whl: see bench/gpu_check.sh")


class Skip(Exception):
    """A contender that cannot run here; the message says why (one line)."""


# ---------------------------------------------------------------------------------------------
# measuring one contender


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy_share(intervals: list[tuple[float, float]], span: float) -> float:
    """The fraction of `span` covered by the union of `intervals` (start, end)."""
    if span <= 0:
        return 0.0
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return covered / span


def link_busy(step: Callable, batch: torch.Tensor, device: torch.device) -> dict[str, float]:
    """One step under torch.profiler: the share of its wall time that host-to-device and
    device-to-host copies kept the link busy (union of the copies on the device's timeline)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(batch)
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    h2d, d2h = [], []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA:
            continue
        name = e.name()
        span = (e.start_ns() / 1e6, (e.start_ns() + e.duration_ns()) / 1e6)
        if "HtoD" in name:
            h2d.append(span)
        elif "DtoH" in name:
            d2h.append(span)
    return {"h2d_busy": busy_share(h2d, wall_ms), "d2h_busy": busy_share(d2h, wall_ms),
            "profiled_step_ms": wall_ms}


def measure(step: Callable, batches: list[torch.Tensor], device: torch.device, warmup: int,
            profile_link: bool) -> dict[str, Any]:
    """Median wall ms of the steps after `warmup`, every step's loss, the peak device memory
    and (CUDA, `profile_link`) the link's busy shares in one more step."""
    losses, times = [], []
    for n, b in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        loss = step(b)
        sync(device)
        if n >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
    out: dict[str, Any] = {"step_ms": statistics.median(times), "losses": losses}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if profile_link:
            out.update(link_busy(step, batches[0], device))
    return out


def free(device: torch.device) -> None:
    """Return the last contender's device memory (a CPU run holds nothing worth a collection)."""
    import gc

    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def run_contender(name: str, fn: Callable[[], dict], device: torch.device) -> dict:
    """`fn()`'s result; a skip, an out-of-memory or a failure as the row's reason (printed)."""
    free(device)
    t0 = time.perf_counter()
    try:
        result = fn()
    except Skip as e:
        result = {"skipped": str(e)}
    except torch.cuda.OutOfMemoryError as e:
        result = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
    except Exception as e:  # noqa: BLE001 - the row records it; the others still run
        result = {"error": first_line(e)}
    result["wall_s"] = time.perf_counter() - t0
    free(device)
    if "step_ms" in result:
        print(f"   {name:22s} {result['step_ms']:10.1f} ms/step, first loss "
              f"{result['losses'][0]:.4f} ({result['wall_s']:.0f} s)", flush=True)
    else:
        print(f"   {name:22s} {'skipped' if 'skipped' in result else 'FAILED'}: "
              f"{result.get('skipped') or result.get('error')}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------
# contenders


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_hf(config: str, state_dict: dict, args, device: torch.device, ckpt: bool):
    import hf

    with torch.device(device):
        model = hf.build_model(config, args.seq_len)
    model.load_state_dict(state_dict)
    model.train()
    if ckpt:  # torch.utils.checkpoint around every decoder layer
        hf_model = model.model
        if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            hf_model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def resident(config: str, state_dict: dict, batches, C: int, args, device, ckpt: bool) -> dict:
    import hf

    model = build_hf(config, state_dict, args, device, ckpt)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fast)

    def step(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in batch.to(device, non_blocking=True).chunk(C):
            with autocast(device, args.torch_dtype):
                loss = hf.loss_fn(model(mb), (mb,)) / C
            loss.backward()
            total += loss.detach().float()
        opt.step()
        return total

    return measure(step, batches, device, args.warmup, args.profile_link)


def process_group(device: torch.device) -> None:
    """A one-process NCCL group on loopback (FSDP2 and DeepSpeed need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)


def fsdp2(config: str, state_dict: dict, batches, C: int, args, device, ckpt: bool) -> dict:
    import hf

    if device.type != "cuda":
        raise Skip("FSDP2 with CPU offload needs CUDA (NCCL process group, pinned copies)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    process_group(device)
    mesh = init_device_mesh("cuda", (1,))
    model = build_hf(config, state_dict, args, device, ckpt)
    options: dict[str, Any] = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=True)}
    if args.torch_dtype != torch.float32:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=args.torch_dtype,
                                                    reduce_dtype=torch.float32)
    for layer in model.model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)  # moves the sharded parameters to pinned host memory
    note = ""
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError) as e:
        note = f"fused CPU AdamW unavailable on DTensors ({type(e).__name__}); foreach used"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    torch.cuda.reset_peak_memory_stats(device)

    def step(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        parts = batch.to(device, non_blocking=True).chunk(C)
        for m, mb in enumerate(parts):
            model.set_requires_gradient_sync(m == C - 1)
            loss = hf.loss_fn(model(mb), (mb,)) / C
            loss.backward()
            total += loss.detach().float()
        opt.step()
        return total

    result = measure(step, batches, device, args.warmup, args.profile_link)
    if note:
        result["note"] = note
    return result


def megatrain(config: str, state_dict: dict, batches, C: int, args, device) -> dict:
    import megatrain_driver

    why = megatrain_driver.unavailable(args.megatrain, device)
    if why:
        raise Skip(why)
    rows = C * args.micro_batch
    try:
        if args.verify_megatrain:  # a contender that trains another function is no comparison
            check = megatrain_driver.verify_against_hf(args.megatrain)
            print(f"   megatrain against transformers (tiny-llama, float32): loss "
                  f"{check['loss_megatrain']:.6f} vs {check['loss_transformers']:.6f}, "
                  f"largest gradient difference {check['max_grad_diff_over_max_grad']:.2e} of "
                  f"the largest gradient", flush=True)
            if not megatrain_driver.agrees(check):
                raise RuntimeError(f"MegaTrain as driven here does not train the transformers "
                                   f"model: {check}")
            free(device)
        run = megatrain_driver.MegaTrainRun(args.megatrain, config, state_dict, batch_size=rows,
                                            seq_len=args.seq_len, dtype=args.torch_dtype)
    except megatrain_driver.MegaTrainUnavailable as e:
        raise Skip(str(e)) from None
    try:
        torch.cuda.reset_peak_memory_stats(device)
        result = measure(run.step, batches, device, args.warmup, args.profile_link)
    finally:
        run.close()
    result["note"] = (f"{rows} rows per weight pass, {str(args.torch_dtype)[6:]} host masters, "
                      f"{run.optimizer_name}")
    if args.verify_megatrain:
        result["verify"] = check
    return result


def deepspeed_zero3(config: str, state_dict: dict, batches, C: int, args, device) -> dict:
    import hf

    if device.type != "cuda":
        raise Skip("DeepSpeed ZeRO-3 offload runs on CUDA here")
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - ImportError, or a need of its import failing
        raise Skip(DEEPSPEED_MISSING.format(why=first_line(e))) from None
    process_group(device)
    model = build_hf(config, state_dict, args, torch.device("cpu"), ckpt=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": C,
        "bf16": {"enabled": args.torch_dtype == torch.bfloat16},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    torch.cuda.reset_peak_memory_stats(device)

    def step(batch: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for mb in batch.to(device, non_blocking=True).chunk(C):
            loss = hf.loss_fn(engine(mb), (mb,))
            engine.backward(loss)
            engine.step()  # applies the update at the C-th micro-batch
            total += loss.detach().float() / C
        return total

    try:
        return measure(step, batches, device, args.warmup, args.profile_link)
    finally:
        engine.destroy()


# ---------------------------------------------------------------------------------------------
# atomc


def accepted_policies() -> tuple[str, ...] | None:
    """The activation policies the installed atomc plans (None: it does not say)."""
    try:
        from atomc.partition import POLICIES
    except ImportError:
        return None
    return tuple(POLICIES)


class AtomcPlans:
    """The model traced and profiled once, one plan per policy at one C, and each plan's
    package generated on demand."""

    def __init__(self, config: str, args, device: torch.device, workdir: Path):
        from atomc.calibrate import measure_runtime_costs
        from atomc.profile import profile_model
        from atomc.trace import trace_model

        self.config, self.args, self.device, self.workdir = config, args, device, workdir
        t0 = time.perf_counter()
        self.traced = trace_model(HF_PATH, config, args.micro_batch, {"seq_len": args.seq_len},
                                  runs_on=device.type)
        repeats = {"repeats": 5} if device.type == "cuda" else {"repeats": 1, "rounds": 1}
        self.profile = profile_model(self.traced, device=str(device), progress=False,
                                     runtime_costs=measure_runtime_costs, **repeats)
        self.prep_s = time.perf_counter() - t0
        self.plans: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}

    def plan(self, policy: str, accum: int | None, profile=None):
        from atomc.calibrate.host import resolve_cpu_adam
        from atomc.partition import partition

        profile = profile or self.profile
        rate, source = resolve_cpu_adam(self.args.cpu_adam_gbps, profile)
        half = self.args.dtype != "float32"
        return partition(profile, self.args.gpu_mem_bytes, reserve_bytes=self.args.reserve_bytes,
                         accum=accum, activations=policy, cpu_adam_gbps=rate,
                         cpu_adam_source=source,
                         transfer_dtype=self.args.dtype if half else None,
                         autocast=None if half else "none")

    def make_plans(self, policies: list[str]) -> int | None:
        """Plan every policy at one C; returns C (None: no policy plans)."""
        from atomc.errors import AtomcError

        accepted = accepted_policies()
        runnable = []
        for p in policies:
            if accepted is not None and p not in accepted:
                self.reasons[p] = (f"the installed atomc plans activations "
                                   f"{', '.join(accepted)} only, not {p!r}")
            else:
                runnable.append(p)
        C = self.args.accum
        for p in runnable:  # the first policy that plans chooses C
            try:
                self.plans[p] = self.plan(p, C)
            except AtomcError as e:
                self.reasons[p] = first_line(e)
                continue
            C = self.plans[p].accum
            break
        if C is None:
            return None
        for p in runnable:
            if p in self.plans or p in self.reasons:
                continue
            try:
                self.plans[p] = self.plan(p, C)
            except AtomcError as e:
                self.reasons[p] = first_line(e)
        if self.args.calibrate_steps and self.plans and self.device.type == "cuda":
            self.calibrate(C)
        return C

    def calibrate(self, C: int) -> None:
        """`atomc calibrate` on the first plan, then every policy re-planned at C."""
        import swap_bench

        from atomc.codegen import generate
        from atomc.errors import AtomcError

        first_policy, first = next(iter(self.plans.items()))
        pkg = generate(first, self.workdir / f"{self.config}_calibrate", traced=self.traced)
        vocab = self.traced_vocab()
        batches = swap_bench.token_batches(vocab, C * self.args.micro_batch, self.args.seq_len,
                                           self.args.warmup + self.args.calibrate_steps + 1)
        free(self.device)
        calibrated, info = swap_bench.run_calibration(pkg, self.profile, first, batches,
                                                      self.args)
        print(f"   calibrated on {first_policy}: {info['measured_step_ms']:.1f} ms measured, "
              f"{info['predicted_step_ms']:.1f} predicted from the profile alone, "
              f"{info['calibrated_step_ms']:.1f} after calibration", flush=True)
        self.calibration = info
        for p in list(self.plans):
            try:
                self.plans[p] = self.plan(p, C, calibrated)
            except AtomcError as e:
                del self.plans[p]
                self.reasons[p] = first_line(e)

    def traced_vocab(self) -> int:
        import hf

        cfg, _ = hf.load_config(self.config)
        return int(cfg.vocab_size)

    def run(self, policy: str, state_dict: dict, batches) -> dict:
        from atomc.codegen import generate
        from atomc.runtime import SwapTrainer

        if policy in self.reasons:
            raise Skip(self.reasons[policy])
        plan = self.plans[policy]
        pkg = generate(plan, self.workdir / f"{self.config}_{policy}", traced=self.traced)
        cuda = self.device.type == "cuda"
        budget = self.args.gpu_mem_bytes
        if cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)
        try:
            trainer = SwapTrainer.from_package(pkg, device=str(self.device), state_dict=state_dict,
                                               optimizer={"lr": 1e-4},
                                               gpu_mem=budget if cuda else None)
            try:
                result = measure(trainer.step, batches, self.device, self.args.warmup,
                                 self.args.profile_link)
            finally:
                trainer.close()
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        result.update(plan_summary(plan))
        return result


def plan_summary(plan) -> dict[str, Any]:
    out = {"submodels": len(plan.submodels), "accum": plan.accum,
           "predicted_step_ms": plan.predicted_step_ms, "plan_activations": plan.activations,
           "transfer_dtype": plan.transfer_dtype, "autocast": plan.autocast,
           "plan_notes": list(plan.notes)}
    recompute_ms = getattr(plan, "recompute_step_ms", None)
    if recompute_ms:
        out["predicted_recompute_step_ms"] = recompute_ms
    return out


# ---------------------------------------------------------------------------------------------
# one model


def bench_config(config: str, args, device: torch.device, workdir: Path) -> dict:
    import hf
    import swap_bench

    cfg, _ = hf.load_config(config)
    vocab = int(cfg.vocab_size)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        reference = hf.build_model(config, args.seq_len)
    num_params = sum(p.numel() for p in reference.parameters())
    state_dict = {k: v.detach().cpu().clone() for k, v in reference.state_dict().items()}
    del reference
    free(device)
    print(f"-- {config}: {num_params / 1e9:.3f}B parameters, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch}, {args.dtype}, budget "
          f"{args.gpu_mem_bytes / 2**30:.3g} GiB for atomc", flush=True)

    row: dict[str, Any] = {"config": config, "params": num_params, "dtype": args.dtype,
                           "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                           "budget_bytes": args.gpu_mem_bytes, "contenders": {}}
    plans = None
    atomc_failed = ""
    C = args.accum
    if "atomc" in args.contender_list:
        try:
            plans = AtomcPlans(config, args, device, workdir)
        except Exception as e:  # noqa: BLE001 - each atomc row records it; the others still run
            atomc_failed = f"tracing or profiling failed: {first_line(e)}"
            print(f"   atomc {atomc_failed}", flush=True)
            free(device)
    if plans is not None:
        C = plans.make_plans(args.policy_list)
        for p, plan in plans.plans.items():
            recompute = getattr(plan, "recompute_step_ms", None)
            print(f"   atomc {p}: {len(plan.submodels)} sub-models at C = {plan.accum}, "
                  f"predicted {plan.predicted_step_ms:.1f} ms"
                  + (f" (all-recompute {recompute:.1f} ms)" if recompute else ""), flush=True)
            for note in plan.notes:
                print(f"      note: {note}")
        if getattr(plans, "calibration", None):
            row["calibration"] = plans.calibration
        row["atomc_prep_s"] = plans.prep_s
    if C is None:
        C = 1
        if plans is not None:
            print("   no atomc policy plans at this budget; the others run at C = 1", flush=True)
    row["accum"] = C
    row["tokens_per_step"] = C * args.micro_batch * args.seq_len
    batches = swap_bench.token_batches(vocab, C * args.micro_batch, args.seq_len,
                                       args.warmup + args.steps)
    results = row["contenders"]

    def add(name: str, fn: Callable[[], dict]) -> None:
        results[name] = run_contender(name, fn, device)
        write_json(args, rows_so_far + [row])

    for contender in args.contender_list:
        if contender == "atomc":
            for p in args.policy_list:
                if atomc_failed:
                    add(f"atomc-{p}", lambda: {"error": atomc_failed})
                else:
                    add(f"atomc-{p}", lambda p=p: plans.run(p, state_dict, batches))
        elif contender in ("resident", "resident-ckpt"):
            add(contender, lambda c=contender: resident(config, state_dict, batches, C, args,
                                                        device, c.endswith("ckpt")))
        elif contender in ("fsdp2", "fsdp2-ckpt"):
            add(contender, lambda c=contender: fsdp2(config, state_dict, batches, C, args,
                                                     device, c.endswith("ckpt")))
        elif contender == "megatrain":
            add(contender, lambda: megatrain(config, state_dict, batches, C, args, device))
        elif contender == "deepspeed":
            add(contender, lambda: deepspeed_zero3(config, state_dict, batches, C, args, device))
    return row


rows_so_far: list[dict] = []


# ---------------------------------------------------------------------------------------------
# report


def peak_tflops(args, device: torch.device) -> tuple[float | None, str]:
    """(peak TFLOPS of the device for the run's dtype, where it comes from)."""
    from atomc.profile.hardware import hardware_names, load_hardware

    if device.type != "cuda":
        return None, "no peak for a CPU"
    name = args.hardware
    if name is None:
        gpu = torch.cuda.get_device_name(device).lower().replace("-", " ").split()
        scored = []
        for n in hardware_names():  # every model token in the name; memory size breaks ties
            tokens = n.split("-")
            if all(t in gpu for t in tokens if not t.endswith("gb")):
                scored.append((sum(t in gpu for t in tokens), n))
        if not scored:
            return None, (f"no atomc hardware profile matches {' '.join(gpu)!r}; give "
                          f"--hardware NAME ({', '.join(hardware_names())})")
        name = max(scored)[1]
    hw = load_hardware(name)
    key = "tfloat32" if args.dtype == "float32" else args.dtype
    if key not in hw.peak_tflops:
        return None, f"hardware profile {name} has no {key} peak"
    return hw.peak_tflops[key], f"{key} peak of hardware profile {name}"


def figures(r: dict, row: dict, peak: float | None) -> dict[str, float]:
    tokens = row["tokens_per_step"]
    s = r["step_ms"] / 1e3
    tflops = 6 * row["params"] * tokens / s / 1e12
    out = {"tokens_per_s": tokens / s, "tflops": tflops}
    if peak:
        out["mfu"] = tflops / peak
    return out


def report(rows: list[dict], meta: dict[str, Any]) -> None:
    """The tables of `rows` and their bench/RESULTS.md rows; `meta` says where and how they
    were measured (run_meta)."""
    peak, peak_source = meta["peak_tflops"], meta["peak_source"]
    print()
    print(f"MFU against the {peak_source}" if peak else f"MFU: {peak_source}")
    for row in rows:
        res = row["contenders"]
        base = res.get("resident", {}).get("step_ms")
        print()
        print(f"{row['config']}: {row['params'] / 1e9:.2f}B, {row['dtype']}, C = {row['accum']}, "
              f"{row['tokens_per_step']} tokens per step and weight pass")
        print(f"{'contender':18s} {'tok/s':>10s} {'TFLOPS':>7s} {'MFU':>6s} {'/res':>6s} "
              f"{'H2D':>5s} {'D2H':>5s} {'peak GiB':>8s} {'loss0':>8s} {'pred tok/s':>10s} "
              f"{'pred/meas':>9s}")
        for name, r in res.items():
            if "step_ms" not in r:
                why = r.get("skipped") or r.get("error", "")
                print(f"{name:18s} {'skipped' if 'skipped' in r else 'FAILED'}: {why}")
                continue
            f = figures(r, row, peak)
            pred = r.get("predicted_step_ms")
            print(f"{name:18s} {f['tokens_per_s']:10,.0f} {f['tflops']:7.1f} "
                  f"{_opt(f.get('mfu'), '6.3f')} "
                  f"{_opt(base and base / r['step_ms'], '6.3f')} "
                  f"{_opt(r.get('h2d_busy'), '5.2f')} {_opt(r.get('d2h_busy'), '5.2f')} "
                  f"{_opt(r.get('peak_gib'), '8.2f')} {r['losses'][0]:8.4f} "
                  f"{_opt(pred and row['tokens_per_step'] / pred * 1e3, '10,.0f')} "
                  f"{_opt(pred and pred / r['step_ms'], '9.3f')}")
        print_ratios(row)
    print()
    print("bench/RESULTS.md rows:")
    print(RESULTS_HEADER)
    for row in rows:
        for line in markdown_rows(row, meta):
            print(line)


def _opt(v: float | None, fmt: str) -> str:
    """`v` formatted, or a dash as wide as the format says."""
    width = re.match(r"\d*", fmt).group()
    return format(v, fmt) if v is not None else "-".rjust(int(width or 0))


def fastest(res: dict, names: tuple[str, ...]) -> tuple[str, float] | None:
    timed = [(res[n]["step_ms"], n) for n in names if "step_ms" in res.get(n, {})]
    if not timed:
        return None
    ms, name = min(timed)
    return name, ms


def print_ratios(row: dict) -> None:
    res = row["contenders"]
    others = {"resident": ("resident",), "MegaTrain": ("megatrain",),
              "FSDP2": ("fsdp2", "fsdp2-ckpt"), "DeepSpeed": ("deepspeed",)}
    for name, r in res.items():
        if not name.startswith("atomc-") or "step_ms" not in r:
            continue
        parts = []
        for label, names in others.items():
            best = fastest(res, names)
            if best is not None:
                which = f" ({best[0]})" if len(names) > 1 else ""
                parts.append(f"/ {label}{which} {best[1] / r['step_ms']:.3f}")
        print(f"  {name} tokens/s " + (", ".join(parts) if parts else "(nothing to compare)"))


RESULTS_HEADER = ("| row | date | machine | commit | command | model | dtype | budget | C | "
                  "contender | tok/s | TFLOPS | MFU | / resident | H2D busy | D2H busy | "
                  "peak GiB | predicted tok/s |")


def run_meta(args, device: torch.device) -> dict[str, Any]:
    """Where and how this run measures: machine, commit, command, the peak for MFU."""
    peak, source = peak_tflops(args, device)
    return {"device": args.device_name, "machine": machine_name(device), "commit": commit(),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "command": "python " + " ".join(shlex.quote(a) for a in [
                "bench/side_by_side.py", *args.argv]),
            "peak_tflops": peak, "peak_source": source}


def markdown_rows(row: dict, meta: dict[str, Any]) -> list[str]:
    machine, peak = meta["machine"], meta["peak_tflops"]
    base = row["contenders"].get("resident", {}).get("step_ms")
    lines = []
    first = True
    for name, r in row["contenders"].items():
        rid = f"side-{machine}-{row['config'].removeprefix('llama-')}-{name}"
        cells = [rid, meta["date"], f"`{machine}`", meta["commit"],
                 f"`{meta['command']}`" if first else "(same run)", row["config"], row["dtype"],
                 f"{row['budget_bytes'] / 2**30:.3g} GiB", str(row["accum"]), name]
        if "step_ms" in r:
            f = figures(r, row, peak)
            pred = r.get("predicted_step_ms")
            cells += [f"{f['tokens_per_s']:,.0f}", f"{f['tflops']:.1f}",
                      _opt(f.get("mfu"), ".3f").strip(),
                      _opt(base and base / r["step_ms"], ".3f").strip(),
                      _opt(r.get("h2d_busy"), ".2f").strip(),
                      _opt(r.get("d2h_busy"), ".2f").strip(),
                      _opt(r.get("peak_gib"), ".2f").strip(),
                      _opt(pred and row["tokens_per_step"] / pred * 1e3, ",.0f").strip()]
        else:
            why = (r.get("skipped") or r.get("error", "")).replace("|", "/")
            cells += [("skipped: " if "skipped" in r else "failed: ") + why[:120]] + ["-"] * 7
        lines.append("| " + " | ".join(cells) + " |")
        first = False
    return lines


def machine_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-box" if platform.machine() == "x86_64" else platform.node()
    name = torch.cuda.get_device_name(device).lower()
    for short in ("h200", "h100", "a100", "rtx-4090", "rtx-3090"):
        if short.replace("rtx-", "") in name:
            return short
    return name.replace(" ", "-")


def write_json(args, rows: list[dict]) -> None:
    from atomc.jsonio import write_json as atomic_write

    atomic_write(Path(args.out), {"meta": args.meta,
                                  "args": {k: v for k, v in vars(args).items()
                                           if k not in ("torch_dtype", "meta")},
                                  "rows": rows})


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="llama-1.3b,llama-2.7b",
                    help="presets of examples/hf.py, comma-separated")
    ap.add_argument("--gpu-mem", default="8GiB", help="atomc's device memory budget")
    ap.add_argument("--reserve", default="1GiB", help="part of the budget kept for the context")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=None,
                    help="C for every contender (default: the first atomc plan's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="atomc activation policies, comma-separated")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, of {', '.join(CONTENDERS)}")
    ap.add_argument("--megatrain", default=None, metavar="DIR",
                    help="a checkout of github DLYuanGod/MegaTrain (see megatrain_driver.py)")
    ap.add_argument("--no-verify-megatrain", dest="verify_megatrain", action="store_false",
                    help="skip checking MegaTrain's loss and gradients against transformers")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibrate-steps", type=int, default=0,
                    help="calibrate atomc's profile on this many traced steps first (CUDA)")
    ap.add_argument("--cpu-adam-gbps", default="auto",
                    help="the host's AdamW rate for atomc's plans (auto: measured)")
    ap.add_argument("--hardware", default=None,
                    help="atomc hardware profile for the peak TFLOPS (default: by device name)")
    ap.add_argument("--no-link-profile", dest="profile_link", action="store_false",
                    help="skip the profiled step that measures the link's busy shares")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny-llama on the CPU, every contender that runs there, in seconds")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "side_by_side.json"))
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables of an earlier run's --out file and exit")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in args.argv
                 if a.startswith("--")}
        for key, value in SMOKE.items():
            if key not in given:
                setattr(args, key, value)
        args.device = args.device or "cpu"
    return args


def check_args(args) -> str | None:
    """The first bad option as one line, or None."""
    from atomc.errors import AtomcError
    from atomc.units import parse_size

    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.contender_list = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contender_list if c not in CONTENDERS]
    if unknown:
        return (f"--contenders: unknown {', '.join(unknown)}; expected some of "
                f"{', '.join(CONTENDERS)}")
    if not args.config_list:
        return "--configs is empty; give presets of examples/hf.py, e.g. llama-1.3b"
    import hf

    for c in args.config_list:
        if c not in hf.PRESETS:
            return (f"--configs: {c!r} is not a preset of examples/hf.py; expected some of "
                    f"{', '.join(hf.PRESETS)}")
    for name in ("steps", "seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more"
    if args.warmup < 0 or args.calibrate_steps < 0:
        return "--warmup and --calibrate-steps must be 0 or more"
    if args.accum is not None and args.accum < 1:
        return f"--accum {args.accum}: give 1 or more"
    try:
        args.gpu_mem_bytes = parse_size(args.gpu_mem, "--gpu-mem")
        args.reserve_bytes = parse_size(args.reserve, "--reserve")
    except AtomcError as e:
        return str(e)
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        return f"--device {args.device}: expected cuda, cuda:N or cpu"
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        return (f"--device {args.device}: torch.cuda.is_available() is false here; give "
                f"--device cpu (or --smoke)")
    if args.megatrain is not None and not Path(args.megatrain).is_dir():
        return (f"--megatrain {args.megatrain}: no such directory; give a checkout of github "
                f"DLYuanGod/MegaTrain (see bench/megatrain_driver.py)")
    return None


def report_file(path: str) -> int:
    """`--report PATH`: the tables of a run's JSON (one cut short by its time limit too)."""
    try:
        document = json.loads(Path(path).read_text())
        rows, meta = document["rows"], document["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"side_by_side: --report {path}: cannot read a side_by_side JSON ({first_line(e)}); "
              f"give the --out file of a run", file=sys.stderr)
        return 2
    report(rows, meta)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report_file(args.report)
    bad = check_args(args)
    if bad:
        print(f"side_by_side: {bad}", file=sys.stderr)
        return 2
    if args.device is None:
        if not torch.cuda.is_available():
            print("bench/side_by_side.py needs CUDA (torch.cuda.is_available() is false on this "
                  "machine); nothing was measured. --smoke or --device cpu runs it on the CPU")
            return 0
        args.device = "cuda"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.torch_dtype = getattr(torch, args.dtype)
    # TF32 for float32 runs, and for atomc's profile, which is timed in float32 (as
    # bench/swap_bench.py times it); bfloat16 autocast leaves few float32 matmuls for it to touch
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    args.device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"{platform.processor() or platform.machine()} CPU")
    args.meta = run_meta(args, device)
    print(f"side_by_side on {args.device_name}, torch {torch.__version__}, {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, commit {args.meta['commit']}", flush=True)
    if device.type == "cuda":
        import swap_bench

        h2d, d2h = swap_bench.pinned_copy_gbps(device)
        print(f"pinned-copy peak: H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s (1 GiB, median of 5)")
    rows_so_far.clear()
    with tempfile.TemporaryDirectory(prefix="atomc-side-by-side-") as tmp:
        for config in args.config_list:
            row = bench_config(config, args, device, Path(tmp))
            rows_so_far.append(row)
            write_json(args, rows_so_far)
            # reported after each model: a lease that ends mid-run keeps what was measured
            report(rows_so_far, args.meta)
    print(f"\nwrote {args.out}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
