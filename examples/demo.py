"""`make demo`: compile a GPT for a small memory budget and train it with the swap runtime.

1. trace and profile examples/gpt.py (config "mini" on the CPU, "demo" on CUDA) on this device;
2. partition it for a memory budget small enough that it needs three or more sub-models;
3. generate the sub-models as a Python package;
4. train it with atomc's swap runtime on real text: the Python standard library's own source
   files, read from disk, as bytes (a byte-level vocabulary of 256);
5. write a checkpoint halfway, finish the run, then resume a fresh trainer from the
   checkpoint and check that it ends with exactly the same parameters;
6. draw the measured timeline of a step beside the partitioner's prediction.

Everything is written under out/demo/. A few minutes on two CPU cores; uses CUDA when present.
    python examples/demo.py [--steps N] [--device cpu|cuda] [--config NAME]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from atomc.calibrate import measure_runtime_costs
from atomc.codegen import generate
from atomc.data.text import ByteBatches, stdlib_text
from atomc.errors import InfeasiblePlanError
from atomc.partition import partition
from atomc.profile import profile_model
from atomc.runtime import SwapTrainer, warmup_cosine
from atomc.runtime.trace import to_timeline
from atomc.simulate import simulate_plan, write_timeline_svg
from atomc.trace import trace_model
from atomc.units import format_bytes, format_count

MODEL = ROOT / "examples" / "gpt.py"
OUT = ROOT / "out" / "demo"


def choose_budget(profile, accum: int, reserve: int, want: int = 3):
    """The largest budget (shrinking by 20% steps) whose plan needs `want` or more sub-models."""
    budget = 64 * sum(s.num_bytes for s in profile.graph.params.values()) + reserve
    while True:
        try:
            plan = partition(profile, int(budget), reserve_bytes=reserve, accum=accum)
        except InfeasiblePlanError as e:
            raise SystemExit(f"demo: no budget gives {want} sub-models ({e})") from None
        if len(plan.submodels) >= want:
            return int(budget), plan
        budget *= 0.8


def sample(state_dict: dict, config: str, prompt: bytes, length: int = 120,
           temperature: float = 0.7) -> str:
    """A continuation of `prompt` by the unpartitioned model with the trained weights (seeded)."""
    sys.path.insert(0, str(MODEL.parent))
    import gpt  # the model file itself

    model = gpt.build_model(config)
    model.load_state_dict(state_dict)
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(length):
            logits = model(idx[:, -model.cfg.seq_len:])[:, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", help="GPT config (default: mini on the CPU, demo on CUDA)")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per step (C)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    config = args.config or ("demo" if cuda else "mini")
    OUT.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    print(f"== 1. trace and profile {MODEL.relative_to(ROOT)} (config {config}, micro-batch "
          f"{args.micro_batch}) on {args.device}")
    traced = trace_model(MODEL, config, args.micro_batch, runs_on="cuda" if cuda else "cpu")
    profile = profile_model(traced, device=args.device, repeats=3,
                            runtime_costs=measure_runtime_costs)
    profile.save(OUT / "profile.json")
    param_bytes = sum(s.num_bytes for s in traced.graph.params.values())
    print(f"   {format_count(traced.graph.num_params())} parameters ({format_bytes(param_bytes)}), "
          f"{len(traced.graph.nodes)} operators, {profile.num_unique} measured")

    print("== 2. partition for a budget that needs several sub-models")
    reserve = 64 << 20 if cuda else 0
    budget, plan = choose_budget(profile, args.accum, reserve)
    plan.save(OUT / "plan.json")
    print(f"   budget {format_bytes(budget)}: {len(plan.submodels)} sub-models, C = {plan.accum}, "
          f"predicted step {plan.predicted_step_ms:.1f} ms")
    for s in plan.submodels:
        print(f"   P{s.index}: nodes {s.start}..{s.stop - 1}, "
              f"weights {format_bytes(s.param_bytes)}, peak {format_bytes(s.peak_bytes)}")

    print("== 3. generate the sub-models")
    pkg = generate(plan, OUT / "pkg", traced=traced)
    print(f"   wrote {pkg.relative_to(ROOT)}/")

    print(f"== 4. train {args.steps} steps on the standard library's sources (byte tokens)")
    text = stdlib_text()
    data = ByteBatches(text, traced.model.cfg.seq_len, plan.accum * args.micro_batch,
                       seed=args.seed, holdout_fraction=0.05)
    held = data.holdout(plan.accum * args.micro_batch)
    optimizer = {"lr": args.lr, "weight_decay": 0.01, "max_grad_norm": 1.0,
                 "lr_schedule": warmup_cosine(max(1, args.steps // 20), args.steps)}

    def make(checkpoint=None) -> SwapTrainer:
        return SwapTrainer.from_package(pkg, device=args.device, seed=args.seed,
                                        optimizer=optimizer, checkpoint=checkpoint, trace=True)

    trainer = make()
    print("   " + trainer.describe().replace("\n", "\n   "))
    print(f"   {len(text) / 1e6:.1f} MB of text; {plan.accum} x {args.micro_batch} x "
          f"{traced.model.cfg.seq_len} = "
          f"{plan.accum * args.micro_batch * traced.model.cfg.seq_len} tokens a step")
    half = args.steps // 2
    ckpt = OUT / "checkpoint.pt"
    losses: list[float] = []
    t_train = time.perf_counter()
    bar = tqdm(range(args.steps), desc="   training", unit="step")
    for step in bar:
        losses.append(trainer.step(data.batch(step)))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step + 1 == half:
            trainer.save_checkpoint(ckpt)
    bar.close()
    train_s = time.perf_counter() - t_train
    final = trainer.export_state_dict()
    trace = trainer.last_trace()
    window = max(1, args.steps // 10)
    print(f"   loss {sum(losses[:window]) / window:.3f} (first {window} steps) -> "
          f"{sum(losses[-window:]) / window:.3f} (last {window}); chance is {math.log(256):.3f}")
    for s in range(0, args.steps, max(1, args.steps // 8)):
        print(f"     step {s + 1:4d}  loss {losses[s]:.3f}")
    print(f"   {train_s:.1f} s, {args.steps / train_s:.2f} steps/s; checkpoint at step {half}: "
          f"{ckpt.relative_to(ROOT)}")

    print(f"== 5. resume from the step-{half} checkpoint and train to step {args.steps} again")
    resumed = make(checkpoint=ckpt)
    assert resumed.step_count == half, resumed.step_count
    for step in tqdm(range(half, args.steps), desc="   resumed", unit="step"):
        resumed.step(data.batch(step))
    again = resumed.export_state_dict()
    same = all(torch.equal(final[k], again[k]) for k in final)
    worst = max((final[k] - again[k]).abs().max().item() for k in final)
    print(f"   resumed parameters {'equal' if same else 'DIFFER FROM'} the uninterrupted run's "
          f"({len(final)} tensors, max difference {worst:g})")

    print("== 6. timelines: measured (last step) beside the partitioner's prediction")
    measured = to_timeline([trace], len(plan.submodels), plan.accum,
                           label=f"{config}: measured on {args.device}")
    predicted = simulate_plan(plan).timeline
    write_timeline_svg(measured, OUT / "timeline_measured.svg")
    write_timeline_svg(predicted, OUT / "timeline_predicted.svg")
    recent = sorted(trainer.traces.values(), key=lambda t: t.step)
    periods = sorted((b.host_start - a.host_start) * 1e3 for a, b in itertools.pairwise(recent))
    step_ms = periods[len(periods) // 2] if periods else trace.wall_ms
    print(f"   step: measured {step_ms:.1f} ms (median of the last {len(periods)}, start to "
          f"start), predicted {plan.predicted_step_ms:.1f} ms; compute busy "
          f"{trace.busy_fraction():.0%} measured, {plan.predicted_utilisation:.0%} predicted")
    print(f"   (`atomc calibrate {pkg.relative_to(ROOT)} --profile "
          f"{(OUT / 'profile.json').relative_to(ROOT)}` scales the profile to measured steps)")
    print(f"   wrote {(OUT / 'timeline_measured.svg').relative_to(ROOT)} "
          f"and timeline_predicted.svg")

    with torch.no_grad():
        held_loss = _heldout_loss(final, config, held)
    print(f"   held-out loss {held_loss:.3f}")
    prompt = b"    def __init__(self"
    print(f"   sample: {sample(final, config, prompt)!r}")
    trainer.close()
    resumed.close()
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0 if same else 1


def _heldout_loss(state_dict: dict, config: str, tokens: torch.Tensor) -> float:
    sys.path.insert(0, str(MODEL.parent))
    import gpt

    model = gpt.build_model(config)
    model.load_state_dict(state_dict)
    model.eval()
    return float(gpt.loss_fn(model(tokens), (tokens,)))


if __name__ == "__main__":
    sys.exit(main())
