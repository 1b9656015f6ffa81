"""Regenerate docs/host-plans.md: plans past the host's memory (`make tables`).

    python bench/host_tables.py [--out docs/host-plans.md] [--work DIR] [--reuse]

Every row is the real command, run as a user runs it, in its own process:

    atomc profile examples/hf.py --config CFG --target T -o WORK/CFG.T.profile.json
    atomc partition WORK/CFG.T.profile.json --gpu-mem 22GiB --transfer-dtype bfloat16 \
        --host-mem SIZE [--disks N --disk-gbps R/W --disk-capacity SIZE] -o WORK/....json

and its numbers are read back from the plan it wrote (a refusal from its one-line error), with
the command's CPU time (user + system of its process). tests/test_host_plans.py pins the
properties the README quotes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpt3_tables import TIMING_RUNS, run, wrap

from atomc.ir import Plan, Profile
from atomc.jsonio import write_atomic
from atomc.units import format_bytes

# one drive: Samsung 990 PRO 2 TB (MZ-V9P2T0BW), PCIe 4.0 x4: sequential read up to 7,450 MB/s
# and write up to 6,900 MB/s (Samsung's specification); what it sustains once its SLC cache is
# full is lower, and `atomc partition --offload-dir` measures the drive it is given instead
DRIVE_GBPS = "7.45/6.9"
DRIVE_SIZE = "2TB"
DRIVE = ("Samsung 990 PRO 2 TB: 7.45 GB/s read, 6.9 GB/s write (Samsung's specification of "
         "sequential rates; sustained writes past its SLC cache are lower)")

MODEL_FILES = {"gpt3": "examples/gpt.py"}
# LoHan (arXiv 2403.06504, ICDE'25 as Ratel) on one RTX 4090 with 768 GB of DDR4 and 12 NVMe
# drives: (config, batch, TFLOPS) as its paper reports them
LOHAN = {"gpt3-175b": (16, 86.9), "gpt3-13b": (64, 155.8)}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One `atomc partition` command: the model, the host, the drives."""

    section: str
    config: str
    target: str
    gpu_mem: str
    host_mem: str
    disks: int = 0
    accum: int | None = None  # --accum (None: the C of the most tokens a second)
    moments: str = "float32"  # --optimizer-states

    @property
    def model_file(self) -> str:
        return MODEL_FILES["gpt3"] if self.config.startswith("gpt3") else "examples/hf.py"

    @property
    def name(self) -> str:
        tail = f".{self.disks}d" if self.disks else ""
        tail += f".C{self.accum}" if self.accum else ""
        return (f"{self.config}.{self.target}.{self.gpu_mem}.{self.host_mem}.{self.moments}"
                f"{tail}")

    def options(self) -> list[str]:
        out = ["--gpu-mem", self.gpu_mem, "--transfer-dtype", "bfloat16", "--host-mem",
               self.host_mem, "--optimizer-states", self.moments]
        if self.disks:
            out += ["--disks", str(self.disks), "--disk-gbps", DRIVE_GBPS, "--disk-capacity",
                    DRIVE_SIZE]
        if self.accum:
            out += ["--accum", str(self.accum)]
        return out


SPECS = (
    # the 128 GiB desktop of the Llama-3-8B worked example, no drive
    Spec("llama-3-8b", "llama-3-8b", "rtx-3090", "22GiB", "128GiB", moments="bfloat16"),
    Spec("llama-3-8b", "llama-3-8b", "rtx-4090", "22GiB", "128GiB", moments="bfloat16"),
    Spec("llama-3-8b", "llama-3-8b", "rtx-4090", "22GiB", "128GiB"),
    # Llama-2-70B on the same desktop with 1, 2 and 4 drives
    *(Spec("llama-2-70b", "llama-2-70b", "rtx-4090", "22GiB", "128GiB", disks=n)
      for n in (1, 2, 4)),
    # LoHan's machine, at LoHan's batch and at the C of the most tokens a second
    *(Spec("lohan", cfg, "rtx-4090", "22GiB", "768GB", disks=12, accum=acc)
      for cfg in ("gpt3-13b", "gpt3-175b") for acc in (LOHAN[cfg][0], None)),
    Spec("gpt3-175b", "gpt3-175b", "rtx-4090", "22GiB", "256GiB", disks=4),
    # throughput as GPU memory grows (the RTX 3090 example)
    *(Spec("llama-1.3b", "llama-1.3b", "rtx-3090", f"{g}GiB", "1024TiB") for g in (8, 11, 16)),
)


@dataclasses.dataclass
class Row:
    spec: Spec
    plan: Plan | None
    error: str
    cpu_s: float
    wall_s: float


def profile_path(work: Path, spec: Spec) -> Path:
    path = work / f"{spec.config}.{spec.target}.profile.json"
    if not path.exists():
        done, _, _ = run(["profile", spec.model_file, "--config", spec.config, "--target",
                          spec.target, "-o", str(path)])
        if done.returncode:
            raise SystemExit(f"atomc profile {spec.config} --target {spec.target} failed:\n"
                             f"{done.stderr}")
    return path


def plan_row(work: Path, spec: Spec, reuse: bool) -> Row:
    out = work / f"{spec.name}.plan.json"
    record = out.with_suffix(".run.json")
    if reuse and record.exists():
        got = json.loads(record.read_text())
        return Row(spec, None if got["error"] else Plan.load(out), got["error"], got["cpu_s"],
                   got["wall_s"])
    prof = profile_path(work, spec)
    out.unlink(missing_ok=True)
    done, wall, cpu = run(["partition", str(prof), *spec.options(), "-o", str(out)], TIMING_RUNS)
    if done.returncode == 0:
        row = Row(spec, Plan.load(out), "", cpu, wall)
    elif done.returncode == 2 and done.stderr.startswith("atomc partition: error: "):
        row = Row(spec, None, done.stderr.strip().removeprefix("atomc partition: error: "), cpu,
                  wall)
    else:
        raise SystemExit(f"atomc partition {' '.join(spec.options())} failed (exit "
                         f"{done.returncode}):\n{done.stderr}")
    write_atomic(record, json.dumps({"error": row.error, "cpu_s": cpu, "wall_s": wall}))
    return row


def num_params(profile: Profile) -> int:
    return sum(math.prod(p.shape) for p in profile.graph.params.values())


def model_tflops(plan: Plan, params: int) -> float:
    """6 x parameters x tokens a second: the model FLOPs of a step, recomputation not counted
    (the convention LoHan's and most training papers' TFLOPS follow)."""
    return 6 * params * plan.tokens_per_step / (plan.predicted_step_ms / 1e3) / 1e12


def chosen(plan: Plan):
    return next((p for p in plan.sweep if p.accum == plan.accum), None)


def binding(plan: Plan) -> str:
    """The lane busiest over the step, and the constraint the plan breaks where it does."""
    from atomc.simulate import binding_lane, simulate_plan

    lane = binding_lane(simulate_plan(plan).timeline)
    return lane if plan.feasible else f"{lane}; {plan.binding.split(':')[0]} broken"


def cells(row: Row, params: int) -> list[str]:
    s = row.spec
    drives = f"{s.disks} x {DRIVE_SIZE}" if s.disks else "none"
    head = [s.config, s.target, s.gpu_mem, s.host_mem, drives, s.moments]
    if row.plan is None:
        return [*head, "refused", "-", "-", "-", "-", "-", "-", "-", f"{row.cpu_s:.1f} s"]
    p = row.plan
    host = p.host
    disk = sum(host.disk_by_kind.values()) if host is not None and host.disk_by_kind else 0
    c = f"{p.accum}" + (" (given)" if p.accum_fixed else "")
    return [*head, c, f"{p.tokens_per_step / (p.predicted_step_ms / 1e3):,.0f}",
            f"{model_tflops(p, params):.1f}", f"{p.predicted_utilisation:.1%}", binding(p),
            format_bytes(host.total()) if host is not None else "-",
            format_bytes(disk) if disk else "-", "yes" if p.feasible else "no",
            f"{row.cpu_s:.1f} s"]


HEAD = ["model", "target", "GPU memory", "host memory", "drives", "moments", "C", "tokens/s",
        "model TFLOPS",
        "GPU busy", "binding", "host bytes", "disk bytes", "every constraint met", "CPU time"]


def table(rows: list[Row], params: dict[str, int]) -> list[str]:
    out = ["| " + " | ".join(HEAD) + " |", "|" + "|".join(
        "---" if i < 6 else "---:" for i in range(len(HEAD))) + "|"]
    out += ["| " + " | ".join(cells(r, params[r.spec.config])) + " |" for r in rows]
    return out


def sweep_lines(row: Row) -> list[str]:
    p = row.plan
    if p is None or not p.sweep:
        return []
    title = (f"`atomc show --sweep` of {row.spec.config} at {row.spec.gpu_mem}, "
             f"{row.spec.host_mem}, {row.spec.disks} drive(s):")
    out = [title, "", "| C | step | tokens/s | GPU busy | binding | every constraint met |",
           "|---:|---:|---:|---:|---|---|"]
    out += [f"| {pt.accum}{' (chosen)' if pt.accum == p.accum else ''} | "
            f"{pt.step_ms / 1e3:.1f} s | {pt.tokens_per_s:,.0f} | {pt.gpu_busy:.1%} | "
            f"{pt.binding} | {'yes' if pt.feasible else 'no'} |" for pt in p.sweep]
    return out + [""]


INTRO = """\
# Plans past the host's memory

Generated by `bench/host_tables.py` (`make tables`) on {date}, {machine}; do not edit by hand.
Every row is `atomc partition` on an estimated profile (`atomc profile MODEL --config CONFIG
--target TARGET`), with bfloat16 weights and compute on the GPU and a 22 GiB budget of the
24 GB card:

    atomc partition P.json --gpu-mem 22GiB --transfer-dtype bfloat16 --host-mem SIZE \\
        --optimizer-states MOMENTS [--disks N --disk-gbps {gbps} --disk-capacity {size}]

and read back from the plan it wrote. C is the one of the most tokens a second unless given
(`--accum`); "binding" is the lane busiest over the step, or the constraint the plan breaks;
"host bytes" is everything the run holds on the host (masters, moments, transfer images,
gradient ring, activation stash and disk staging), "disk bytes" the states the plan puts on
the drives. Model TFLOPS is 6 x parameters x tokens a second (recomputation not counted).
The drive: {drive}. The CPU AdamW rate is the hardware profile's host figure (rtx-4090: a
Core i9-13900K desktop, 9.3 GB/s of fp32 masters; rtx-3090: 5.3 GB/s). The last column is
the whole command's CPU time, the least of {runs} runs, with atomc's bytecode written as an
installed atomc has it (the machine, a VM, shares its cores with other work, which adds time
to a run).
"""


def lohan_lines(rows: list[Row], params: dict[str, int]) -> list[str]:
    out = [("Beside LoHan's published figures (same model, GPU, host memory, drive count and "
           "batch; micro-batch 1 of 2048 tokens, C micro-batches a step):"), ""]
    for r in rows:
        if r.spec.section != "lohan" or r.plan is None or not r.spec.accum:
            continue
        batch, tflops = LOHAN[r.spec.config]
        out.append(f"- {r.spec.config}, batch {batch}: atomc plans "
                   f"{model_tflops(r.plan, params[r.spec.config]):.1f} model TFLOPS "
                   f"({r.plan.predicted_utilisation:.1%} GPU busy, binding "
                   f"{binding(r.plan)}); LoHan measured {tflops} TFLOPS.")
    out += ["", wrap("What differs: atomc's figures are predictions from an estimated profile "
            "(roofline times at 65% of the card's 165 TFLOPS dense bfloat16 peak with float32 "
            "accumulation), LoHan's are measured; 155.8 TFLOPS is 94% of that peak, so LoHan "
            "counts its FLOPs or accumulates differently (the card computes float16 with "
            "float16 accumulation at twice the rate). LoHan's host "
            "is a server with 768 GB of DDR4 and its own CPUs, whose AdamW rate differs from "
            "the desktop figure used here; its drives' rates are taken here as the 990 PRO's. "
            "LoHan also swaps activations to the drives; atomc keeps them in host memory or "
            "recomputes them."), ""]
    return out


def render(rows: list[Row], params: dict[str, int]) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    lines = [INTRO.format(date=date, machine=machine, gbps=DRIVE_GBPS, size=DRIVE_SIZE,
                          drive=DRIVE, runs=TIMING_RUNS)]
    sections = [
        ("llama-3-8b", "Llama-3-8B full fine-tuning on a 128 GiB desktop, no drive"),
        ("llama-2-70b", "Llama-2-70B on the same desktop with 1, 2 and 4 drives"),
        ("lohan", "GPT-3 13B and 175B on LoHan's machine (768 GB, 12 NVMe drives)"),
        ("gpt3-175b", "GPT-3 175B with 256 GiB and 4 drives"),
        ("llama-1.3b", "Llama-1.3B on an RTX 3090 host as GPU memory grows"),
    ]
    for key, title in sections:
        mine = [r for r in rows if r.spec.section == key]
        if not mine:
            continue
        lines += [f"## {title}", ""]
        lines += table(mine, params)
        lines.append("")
        if key == "lohan":
            lines += lohan_lines(mine, params)
        if key in ("llama-2-70b", "llama-1.3b"):
            for r in mine:
                lines += sweep_lines(r)
        for r in mine:
            if r.plan is None:
                lines += [f"- {r.spec.name}: refused: {r.error}", ""]
            elif not r.plan.feasible:
                lines += [(f"- {r.spec.config}, {r.spec.disks} drive(s), C = {r.plan.accum}: "
                          f"{r.plan.binding}."), ""]
    worst = max(rows, key=lambda r: r.cpu_s)
    slow = [r for r in rows if r.cpu_s >= 5.0]
    lines += ["## Planning time", "",
              wrap(f"The slowest command took {worst.cpu_s:.1f} s of CPU ({worst.spec.config} "
                   f"at {worst.spec.gpu_mem}), Python start-up and reading the profile included. "
                   f"{len(slow)} of {len(rows)} commands took 5 s or more, the goal: the search "
                   f"runs again at each C the throughput sweep weighs, over graphs of "
                   f"1,700-5,400 operators."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "host-plans.md"))
    ap.add_argument("--work", help="folder for profiles and plans (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true",
                    help="take each row from an earlier run in --work where there is one")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="atomc-host-tables-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for spec in SPECS:
            row = plan_row(work, spec, args.reuse)
            rows.append(row)
            print(f"{spec.name:60s} {' | '.join(cells(row, 1))}", flush=True)
        params = {r.spec.config: num_params(Profile.load(profile_path(work, r.spec)))
                  for r in rows}
        text = render(rows, params)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
