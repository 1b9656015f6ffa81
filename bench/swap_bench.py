"""Swap runtime benchmark (CUDA): swapped training under a memory budget vs the alternatives.

For each GPT config of examples/gpt.py (GPT-3 family, seq 2048 by default), in one process:

1. trace, profile on this GPU (measured), partition for `--gpu-mem` (the planner picks C,
   the CPU AdamW rate is measured on this host as `--cpu-adam-gbps auto` does), then what
   `atomc calibrate` does: `--calibrate-steps` traced steps of that plan's package, the
   profile calibrated to them, and a re-plan from the calibrated profile, whose package is
   the one benchmarked (at its C);
2. **swapped**: train it with atomc's swap runtime, the process's CUDA allocator capped at the
   budget (torch.cuda.set_per_process_memory_fraction), and record one traced step;
3. **resident**: the unpartitioned model on the whole GPU, torch.optim.AdamW(fused=True) on
   the GPU, the same C micro-batches of the same size (no cap: this is what fits without atomc);
4. **FSDP2 CPU offload**: `fully_shard(..., offload_policy=CPUOffloadPolicy())` on every block
   and the root, one GPU, one process (world size 1): the comparison a user would pick instead;

and report side by side: tokens/s of each, swapped/resident, swapped/FSDP2, the host-to-device
GB/s the swap runtime achieved (bytes of its weight and checkpoint loads over their copy times,
from CUDA events) against a plain pinned 1 GiB copy, the GPU's compute-busy fraction in the
traced step, the CPU optimizer's time, and the predicted step times: the first plan's from
the profile alone and re-costed on the calibrated profile (against its traced steps), and the
re-plan's against its untraced steps in 2 (steps the calibration never saw).

Goals (docs/design.md, section "Runtime: one core for every way of training"; issues 5 and
14): swapped >= 0.9 x resident at the planner's C; >= 2x FSDP2 CPU offload; transfers >= 85% of
the pinned-copy peak; prediction within 10% (5% after calibration).

Precision (`--dtype`, default bfloat16): float32 master weights and optimizer state for every
contender, bfloat16 device copies of weights and gradients under torch.autocast(bfloat16) for
the swapped run (the plan's transfer dtype), autocast for resident, and
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) for FSDP2. `--dtype float32`:
float32 on the device with TF32 matmuls for every contender. The profile is timed in float32
(TF32), so a bfloat16 plan's prediction reflects bfloat16 compute only after calibration.
Without CUDA the script says so and exits 0.

    python bench/swap_bench.py [--configs gpt3-small,gpt3-medium,gpt3-large] [--gpu-mem 8GiB]
                               [--seq-len 2048] [--micro-batch 1] [--steps 6] [--skip-fsdp]
                               [--calibrate-steps 6] [--activations recompute|keep]
                               [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# as `atomc` sets it (atomc.cli.main): swapped sub-models fragment the default CUDA allocator
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

GPT_PATH = ROOT / "examples" / "gpt.py"


# ---------------------------------------------------------------------------------------------
# measurements


def pinned_copy_gbps(device: torch.device, num_bytes: int = 1 << 30,
                     repeats: int = 5) -> tuple[float, float]:
    """H2D and D2H GB/s of one plain pinned copy of `num_bytes` (median of repeats)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    out = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out.append(num_bytes / (statistics.median(times) * 1e-3) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return out[0], out[1]


def token_batches(vocab: int, rows: int, seq: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(steps)]


def time_steps(step_fn, batches: list[torch.Tensor], warmup: int) -> float:
    """Median wall ms per step after `warmup` steps (synchronised around each timed step)."""
    for b in batches[:warmup]:
        step_fn(b)
    torch.cuda.synchronize()
    times = []
    for b in batches[warmup:]:
        t0 = time.perf_counter()
        step_fn(b)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------------
# contenders


def run_swapped(pkg: Path, state_dict: dict, batches, args, budget: int) -> dict:
    from atomc.runtime import SwapTrainer

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    try:
        trainer = SwapTrainer.from_package(pkg, device="cuda", state_dict=state_dict,
                                           optimizer={"lr": 1e-4}, gpu_mem=budget)
        try:
            step_ms = time_steps(trainer.step, batches, args.warmup)
            trainer.executor.tracer.enabled = True
            trainer.step(batches[-1])
            trace = trainer.last_trace()
            trainer.executor.tracer.enabled = False
            peak = torch.cuda.max_memory_allocated()
        finally:
            trainer.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    loads = [e for e in trace.events if e.lane == "prefetch"]
    offloads = [e for e in trace.events if e.kind == "offload"]
    h2d_bytes = sum(e.num_bytes for e in loads)
    h2d_ms = sum(e.duration_ms for e in loads)
    d2h_bytes = sum(e.num_bytes for e in offloads)
    d2h_ms = sum(e.duration_ms for e in offloads)
    return {
        "step_ms": step_ms,
        "traced_step_ms": trace.span_ms(),
        "busy": trace.busy_fraction(),
        "h2d_gbps": h2d_bytes / (h2d_ms * 1e-3) / 1e9 if h2d_ms else 0.0,
        "d2h_gbps": d2h_bytes / (d2h_ms * 1e-3) / 1e9 if d2h_ms else 0.0,
        "h2d_gib": h2d_bytes / 2**30,
        "optimizer_ms": trace.total_ms(kind="optimizer"),
        "peak_gib": peak / 2**30,
        "trace": trace.to_json(),
    }


def run_resident(config: str, state_dict: dict, batches, C: int, args) -> dict:
    import gpt

    try:
        model = gpt.build_model(config, seq_len=args.seq_len)
        model.load_state_dict(state_dict)
        model.cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(batch: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            for mb in batch.cuda(non_blocking=True).chunk(C):
                with autocast(args):
                    loss = gpt.loss_fn(model(mb), (mb,)) / C
                loss.backward()
            opt.step()

        step_ms = time_steps(step, batches, args.warmup)
        peak = torch.cuda.max_memory_allocated()
        result = {"step_ms": step_ms, "peak_gib": peak / 2**30}
    except torch.cuda.OutOfMemoryError as e:
        result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    model = opt = None
    free_cuda()
    return result


def run_fsdp2_offload(config: str, state_dict: dict, batches, C: int, args) -> dict:
    import gpt
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    note = ""
    try:
        mesh = init_device_mesh("cuda", (1,))
        model = gpt.build_model(config, seq_len=args.seq_len)
        model.load_state_dict(state_dict)
        options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=True)}
        if args.dtype != "float32":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype),
                                                        reduce_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, **options)
        fully_shard(model, **options)
        model.train()
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        except (RuntimeError, TypeError) as e:  # reported, not hidden
            note = f"fused CPU AdamW unavailable on DTensors ({type(e).__name__}); foreach used"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step(batch: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            parts = batch.cuda(non_blocking=True).chunk(C)
            for m, mb in enumerate(parts):
                model.set_requires_gradient_sync(m == C - 1)
                (gpt.loss_fn(model(mb), (mb,)) / C).backward()
            opt.step()

        step_ms = time_steps(step, batches, args.warmup)
        result = {"step_ms": step_ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    except torch.cuda.OutOfMemoryError as e:
        result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    if note:
        result["note"] = note
    model = opt = None
    free_cuda()
    return result


# ---------------------------------------------------------------------------------------------


def run_calibration(pkg: Path, profile, plan, batches, args):
    """`atomc calibrate`: traced steps of the first plan's package, the profile calibrated to
    them; returns the calibrated profile and what it says of the first plan."""
    from atomc.calibrate import calibrate, measure_package
    from atomc.partition import recost

    measured, _ = measure_package(pkg, steps=args.calibrate_steps, warmup=args.warmup,
                                  device="cuda", optimizer={"lr": 1e-4},
                                  batches=lambda s: batches[s % len(batches)])
    cal = calibrate(profile, plan, measured)
    dump(args, f"{plan.config or 'model'}_measured", measured)
    after = recost(cal, plan, cpu_adam_gbps=cal.calibration.cpu_adam_gbps)
    c = cal.calibration
    return cal, {"accum": plan.accum, "submodels": len(plan.submodels),
                 "predicted_step_ms": plan.predicted_step_ms,
                 "measured_step_ms": measured.median_step_ms,
                 "calibrated_step_ms": after.predicted_step_ms, "h2d_gbps": measured.h2d_gbps,
                 "cpu_adam_gbps": c.cpu_adam_gbps,
                 "fwd_scales": [s.fwd_scale for s in c.submodels],
                 "bwd_scales": [s.bwd_scale for s in c.submodels]}


def autocast(args):
    """The resident contender's autocast for --dtype (none for float32)."""
    import contextlib

    if args.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=getattr(torch, args.dtype))


def dump(args, name: str, document) -> None:
    """A profile, plan or measurement beside the bench's JSON (--out), for reading them
    afterwards (a lease's machine is gone by then)."""
    from atomc.jsonio import write_json

    write_json(Path(args.out).parent / f"{name}.json", document.to_json())


def make_plan(profile, args):
    """What `atomc partition --gpu-mem ... --cpu-adam-gbps auto` makes of a profile: the CPU
    AdamW rate measured on this host, or the calibrated one."""
    from atomc.calibrate.host import resolve_cpu_adam
    from atomc.partition import partition

    rate, source = resolve_cpu_adam("auto", profile)
    half = getattr(args, "dtype", "float32") != "float32"
    return partition(profile, args.gpu_mem, reserve_bytes=args.reserve, cpu_adam_gbps=rate,
                     cpu_adam_source=source, activations=args.activations,
                     transfer_dtype=args.dtype if half else None,
                     autocast=None if half else "none")


def bench_config(config: str, args, workdir: Path) -> dict:
    import gpt

    from atomc.calibrate import measure_runtime_costs
    from atomc.codegen import generate
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    options = {"seq_len": args.seq_len}
    t0 = time.perf_counter()
    traced = trace_model(GPT_PATH, config, args.micro_batch, options, runs_on="cuda")
    profile = profile_model(traced, device="cuda", repeats=5, progress=False,
                            runtime_costs=measure_runtime_costs)
    first = make_plan(profile, args)
    dump(args, f"{config}_profile", profile)
    dump(args, f"{config}_first_plan", first)
    vocab = gpt.CONFIGS[config].vocab_size
    model_bytes = sum(s.num_bytes for s in traced.graph.params.values())
    print(f"-- {config}: {traced.graph.num_params() / 1e6:.0f}M parameters "
          f"({model_bytes / 2**30:.2f} GiB fp32), budget {args.gpu_mem / 2**30:.2f} GiB; "
          f"from the profile: {len(first.submodels)} sub-models, C = {first.accum}, "
          f"CPU AdamW {first.cpu_adam_gbps:.1f} GB/s ({first.cpu_adam_source})", flush=True)
    calibration: dict = {}
    plan = first
    if args.calibrate_steps:
        pkg = generate(first, workdir / f"{config}_first", traced=traced)
        free_cuda()
        cal_batches = token_batches(vocab, first.accum * args.micro_batch, args.seq_len,
                                    args.warmup + args.calibrate_steps + 1)
        calibrated, calibration = run_calibration(pkg, profile, first, cal_batches, args)
        plan = make_plan(calibrated, args)
        dump(args, f"{config}_calibrated_profile", calibrated)
        dump(args, f"{config}_plan", plan)
        print(f"   calibrated ({calibration['measured_step_ms']:.1f} ms measured, "
              f"{calibration['predicted_step_ms']:.1f} predicted from the profile alone) and "
              f"re-planned: {len(plan.submodels)} sub-models, C = {plan.accum}, "
              f"CPU AdamW {plan.cpu_adam_gbps:.1f} GB/s", flush=True)
    pkg = generate(plan, workdir / f"{config}_pkg", traced=traced)
    prep_s = time.perf_counter() - t0
    C = plan.accum
    tokens = C * args.micro_batch * args.seq_len
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state_dict = gpt.build_model(config, seq_len=args.seq_len).state_dict()
    batches = token_batches(vocab, C * args.micro_batch, args.seq_len, args.warmup + args.steps)
    print(f"   benchmarking at C = {C}, {tokens} tokens/step (prepared in {prep_s:.0f} s)",
          flush=True)
    free_cuda()  # the profile's cached blocks would count against the cap
    swapped = run_swapped(pkg, state_dict, batches, args, args.gpu_mem)
    free_cuda()
    resident = run_resident(config, state_dict, batches, C, args)
    fsdp = {} if args.skip_fsdp else run_fsdp2_offload(config, state_dict, batches, C, args)
    return {"config": config, "params": traced.graph.num_params(), "model_gib": model_bytes / 2**30,
            "submodels": len(plan.submodels), "accum": C, "tokens_per_step": tokens,
            "predicted_step_ms": plan.predicted_step_ms,
            "predicted_busy": plan.predicted_utilisation, "calibrated": bool(calibration),
            "feasible": plan.feasible, "binding": plan.binding,
            "cpu_adam_gbps": plan.cpu_adam_gbps, "calibration": calibration,
            "swapped": swapped, "resident": resident, "fsdp2_offload": fsdp}


def report(rows: list[dict], h2d_peak: float, d2h_peak: float) -> None:
    def tps(r: dict, tokens: int) -> str:
        return (f"{tokens / (r['step_ms'] * 1e-3):,.0f}" if "step_ms" in r
                else r.get("error", "skipped")[:24])

    print()
    print(f"pinned-copy peak: H2D {h2d_peak:.1f} GB/s, D2H {d2h_peak:.1f} GB/s "
          f"(1 GiB, median of 5)")
    print("the plan benchmarked is the re-plan from the calibrated profile (when calibrated); "
          "meas: its untraced steps")
    print(f"{'config':12s} {'k':>3s} {'C':>3s} {'swapped tok/s':>14s} {'resident tok/s':>15s} "
          f"{'FSDP2 tok/s':>12s} {'swap/res':>8s} {'swap/FSDP2':>10s} {'H2D GB/s':>9s} "
          f"{'/peak':>6s} {'busy':>5s} {'opt ms':>7s} {'pred ms':>8s} {'meas ms':>8s} "
          f"{'pred/meas':>9s}")
    for r in rows:
        s, res, f = r["swapped"], r["resident"], r["fsdp2_offload"]
        ratio = f"{res['step_ms'] / s['step_ms']:.3f}" if "step_ms" in res else "-"
        vs_fsdp = f"{f['step_ms'] / s['step_ms']:.2f}" if "step_ms" in f else "-"
        print(f"{r['config']:12s} {r['submodels']:3d} {r['accum']:3d} "
              f"{tps(s, r['tokens_per_step']):>14s} {tps(res, r['tokens_per_step']):>15s} "
              f"{tps(f, r['tokens_per_step']) if f else 'skipped':>12s} "
              f"{ratio:>8s} {vs_fsdp:>10s} {s['h2d_gbps']:9.1f} {s['h2d_gbps'] / h2d_peak:6.2f} "
              f"{s['busy']:5.2f} {s['optimizer_ms']:7.1f} {r['predicted_step_ms']:8.1f} "
              f"{s['step_ms']:8.1f} {r['predicted_step_ms'] / s['step_ms']:9.3f}")
    cal_rows = [r for r in rows if r["calibration"]]
    if cal_rows:
        print()
        print("the first plan (from the profile alone), measured in traced steps:")
        print(f"{'config':12s} {'k':>3s} {'C':>3s} {'measured':>9s} {'profile alone':>14s} "
              f"{'calibrated':>11s}  fwd scales     bwd scales")
        for r in cal_rows:
            c = r["calibration"]
            m = c["measured_step_ms"]
            print(f"{r['config']:12s} {c['submodels']:3d} {c['accum']:3d} {m:8.1f}ms "
                  f"{c['predicted_step_ms']:7.1f} {c['predicted_step_ms'] / m - 1:+6.1%} "
                  f"{c['calibrated_step_ms']:5.1f} {c['calibrated_step_ms'] / m - 1:+5.1%}  "
                  f"{min(c['fwd_scales']):.2f}-{max(c['fwd_scales']):.2f}      "
                  f"{min(c['bwd_scales']):.2f}-{max(c['bwd_scales']):.2f}")
    print()
    print("goals: swapped/resident >= 0.90, swapped/FSDP2 >= 2, H2D/peak >= 0.85; prediction "
          "within 10% from the profile alone, 5% after calibration (the re-plan's, held out)")
    for r in rows:
        s, res, f, cal = r["swapped"], r["resident"], r["fsdp2_offload"], r["calibration"]
        checks = []
        if "step_ms" in res:
            checks.append(("swap/res", res["step_ms"] / s["step_ms"],
                           res["step_ms"] / s["step_ms"] >= 0.9))
        if "step_ms" in f:
            checks.append(("swap/FSDP2", f["step_ms"] / s["step_ms"],
                           f["step_ms"] / s["step_ms"] >= 2.0))
        checks.append(("H2D/peak", s["h2d_gbps"] / h2d_peak, s["h2d_gbps"] / h2d_peak >= 0.85))
        if cal:
            before = cal["predicted_step_ms"] / cal["measured_step_ms"]
            checks.append(("profile pred/meas", before, abs(before - 1) <= 0.10))
        pm = r["predicted_step_ms"] / s["step_ms"]
        checks.append(("calibrated pred/meas" if cal else "pred/meas", pm,
                       abs(pm - 1) <= (0.05 if cal else 0.10)))
        print(f"  {r['config']:12s} "
              + ", ".join(f"{n} {v:.3f} {'met' if ok else 'MISSED'}" for n, v, ok in checks))


def main() -> int:
    from atomc.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="gpt3-small,gpt3-medium,gpt3-large")
    ap.add_argument("--gpu-mem", default="8GiB", help="memory budget for the swapped runs")
    ap.add_argument("--reserve", default="1GiB",
                    help="part of the budget kept for CUDA context etc.")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="device copies and compute: bfloat16 (autocast; float32 masters) or "
                         "float32 (TF32 matmuls)")
    ap.add_argument("--skip-fsdp", action="store_true")
    ap.add_argument("--activations", default="recompute", choices=["auto", "recompute", "keep"],
                    help="the plan's activation rule (keep: no recomputation, more memory)")
    ap.add_argument("--calibrate-steps", type=int, default=6,
                    help="traced steps to calibrate the profile on (0: no calibration)")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "swap_bench.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/swap_bench.py needs CUDA (torch.cuda.is_available() is false on this "
              "machine); nothing was measured")
        return 0
    args.gpu_mem = parse_size(args.gpu_mem, "--gpu-mem")
    args.reserve = parse_size(args.reserve, "--reserve")
    torch.set_float32_matmul_precision("high")  # TF32 for float32 runs and the profile
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    print(f"swap_bench on {name} "
          f"({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB), "
          f"torch {torch.__version__}, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{args.dtype}")
    h2d_peak, d2h_peak = pinned_copy_gbps(device)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atomc-swap-bench-") as tmp:
        for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
            rows.append(bench_config(config, args, Path(tmp)))
            # reported after each config: a lease that ends mid-run keeps what was measured
            report(rows, h2d_peak, d2h_peak)
            out.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                       "h2d_peak_gbps": h2d_peak, "d2h_peak_gbps": d2h_peak,
                                       "args": dict(vars(args)),
                                       "rows": rows}, indent=1, default=str))
            print(f"\nwrote {out}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
