"""Regenerate docs/gpt3-plans.md: the GPT-3 plan tables the README quotes (`make tables`).

    python bench/gpt3_tables.py [--out docs/gpt3-plans.md] [--work DIR]
        [--configs gpt3-small,...] [--mems 8,11,16,32]

Every row is the real command, run as a user runs it, in its own process:

    atomc profile examples/gpt.py --config CFG --target T -o WORK/CFG.T.profile.json
    atomc partition WORK/CFG.T.profile.json --gpu-mem NGiB --transfer-dtype D \
        --host-mem 1024TiB -o WORK/....json

(`--cpu-adam-gbps auto`, the default: the hardware profile's host figure for an estimated
profile; the default 1 GiB reserve). The table's numbers are read back from the plans the
commands wrote, a refusal from the command's one-line error, and each row records the
command's time: wall clock, and the CPU time (user + system) of its process, each the least of
TIMING_RUNS runs (a machine that shares its cores with other work adds time to a run, to its
CPU time too). The explanation paragraphs are computed from the same plans and profiles with
the partitioner's own cost model, so no number in the file is typed by hand.
tests/partition/test_headline_plans.py pins the headline rows' properties.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atomc.ir import Plan, Profile
from atomc.jsonio import write_atomic
from atomc.units import format_bytes

CONFIGS = ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl", "gpt3-2.7b", "gpt3-6.7b",
           "gpt3-13b", "gpt3-175b")
MEMS = (8, 11, 16, 32)
# (target, models, the half dtype its GPU computes in)
TABLES = (("v100-32gb", CONFIGS, "float16"), ("rtx-3090", ("gpt3-175b",), "bfloat16"))
HEADLINE_GIB = 11
GIB = 1 << 30
WIDTH = 96  # the prose's lines; table rows stay one line each


def wrap(text: str, first: str = "", rest: str = "") -> str:
    """`text` as lines of at most WIDTH columns, the first led by `first`, the others by
    `rest` (a list item's continuation indent)."""
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


@dataclasses.dataclass
class Row:
    target: str
    config: str
    dtype: str  # the --transfer-dtype given
    gib: int
    plan: Plan | None  # None: the command refused (error)
    error: str
    wall_s: float
    cpu_s: float

    @property
    def weights(self) -> str:
        return "float32" if self.dtype == "float32" else "half"


# a planning command is timed this many times and its least time kept: on a shared machine (a
# VM whose host lends its cores to others) one run of the same command took 4.7-8.5 s of CPU
TIMING_RUNS = 3


# the environment of a command as a user runs it: an installed atomc has its bytecode (pip
# compiles a wheel's modules), so Python may write it here too, where a machine that forbids it
# (PYTHONDONTWRITEBYTECODE) would have every run compile atomc's 300 modules again (0.3 s)
AS_INSTALLED = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run(cmd: list[str], runs: int = 1) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run an atomc command `runs` times (one run where it fails); its result, and the least
    wall time and process CPU time (user + system) of the runs."""
    wall = cpu = math.inf
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "atomc", *cmd], cwd=ROOT,
                              capture_output=True, text=True, env=AS_INSTALLED)
        wall = min(wall, time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = min(cpu, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        if done.returncode:
            break
    return done, wall, cpu


HOST_MEM = "1024TiB"


def profile_path(work: Path, config: str, target: str) -> Path:
    path = work / f"{config}.{target}.profile.json"
    if not path.exists():
        done, _, _ = run(["profile", "examples/gpt.py", "--config", config, "--target", target,
                          "-o", str(path)])
        if done.returncode:
            raise SystemExit(f"atomc profile {config} --target {target} failed:\n{done.stderr}")
    return path


def plan_row(work: Path, target: str, config: str, dtype: str, gib: int,
             reuse: bool = False) -> Row:
    """One row: the command's plan or refusal and its times (kept beside the plan, so that
    `--reuse` can write the file again from the same commands' results)."""
    prof = profile_path(work, config, target)
    out = work / f"{config}.{target}.{dtype}.{gib}GiB.plan.json"
    record = out.with_suffix(".run.json")
    if reuse and record.exists():
        got = json.loads(record.read_text())
        plan = Plan.load(out) if not got["error"] else None
        return Row(target, config, dtype, gib, plan, got["error"], got["wall_s"], got["cpu_s"])
    out.unlink(missing_ok=True)
    # the host is listed, not checked: the rows are about the GPU (HOST_MEM)
    done, wall, cpu = run(["partition", str(prof), "--gpu-mem", f"{gib}GiB",
                           "--transfer-dtype", dtype, "--host-mem", HOST_MEM, "-o", str(out)],
                          TIMING_RUNS)
    if done.returncode == 0:
        row = Row(target, config, dtype, gib, Plan.load(out), "", wall, cpu)
    elif done.returncode == 2 and done.stderr.startswith("atomc partition: error: "):
        message = done.stderr.strip().removeprefix("atomc partition: error: ")
        row = Row(target, config, dtype, gib, None, message, wall, cpu)
    else:
        raise SystemExit(f"atomc partition {prof.name} --gpu-mem {gib}GiB --transfer-dtype "
                         f"{dtype} failed (exit {done.returncode}):\n{done.stderr}")
    write_atomic(record, json.dumps({"error": row.error, "wall_s": wall, "cpu_s": cpu}))
    return row


# ---------------------------------------------------------------------------------------------
# tables


def step_text(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


def outcome(row: Row) -> tuple[str, ...]:
    if row.plan is None:
        return ("-", "-", "-", "-", "-", "-", "-", "no: does not fit (below)")
    p = row.plan
    met = "yes" if p.feasible else f"no: {p.binding.split(' (')[0]}"
    recompute = step_text(p.recompute_step_ms) if p.recompute_step_ms is not None else "-"
    host = f"{p.host.total() / 2**30:,.0f} GiB" if p.host is not None else "-"
    tokens = p.tokens_per_step / (p.predicted_step_ms / 1e3) if p.predicted_step_ms else 0.0
    return (str(len(p.submodels)), str(p.accum), f"{tokens:,.0f}", f"{p.predicted_utilisation:.1%}",
            step_text(p.predicted_step_ms), recompute, host, met)


def table(rows: list[Row], with_model: bool) -> list[str]:
    """Rows of equal outcome for one model and weights merged (8 / 11 GiB), as the README's."""
    head = ["model"] if with_model else []
    head += ["GPU memory", "weights", "sub-models", "C", "tokens/s", "predicted GPU busy",
             "predicted step",
             "recomputing everything", "host memory", "every constraint met",
             "`atomc partition` CPU time"]
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" if i < len(head) - 9 else "---:"
                          for i in range(len(head))) + "|"]
    for (config, weights), group in itertools.groupby(rows, lambda r: (r.config, r.weights)):
        group = list(group)
        for key, same in itertools.groupby(group, outcome):
            same = list(same)
            mems = " / ".join(str(r.gib) for r in same) + " GiB"
            times = " / ".join(f"{r.cpu_s:.1f} s" for r in same)
            cells = ([config] if with_model else []) + [mems, weights, *key, times]
            out.append("| " + " | ".join(cells) + " |")
    return out


# ---------------------------------------------------------------------------------------------
# explanations, computed with the partitioner's cost model


@dataclasses.dataclass
class Model:
    """A plan's profile as the partitioner costs it: tables wide enough for any range asked."""

    profile: Profile
    view: Profile
    tables: object
    params: object

    @classmethod
    def of(cls, profile: Profile, plan: Plan, width: int | None = None) -> Model:
        from atomc.partition.cost import CostParams, runtime_params
        from atomc.partition.precision import Precision, device_view
        from atomc.partition.tables import build_tables, node_facts

        view = device_view(profile, Precision(plan.transfer_dtype, plan.autocast))
        facts = node_facts(view)
        wide = max(s.stop - s.start for s in plan.submodels)
        tables = build_tables(facts, max(width or 0, wide))
        # the cuts' costs recomputing everything: what the search itself weighs (activations
        # "auto" stores operators' outputs on top of the cut plan)
        acts = "recompute" if plan.activations == "auto" else plan.activations
        p = CostParams(plan.accum, plan.capacity_bytes - plan.reserve_bytes, profile.h2d_gbps,
                       profile.d2h_gbps, plan.cpu_adam_gbps, acts, **runtime_params(profile))
        return cls(profile, view, tables, p)

    def node(self, name: str) -> int:
        return next(i for i, n in enumerate(self.view.graph.nodes) if n.name == name)

    def costs(self, cuts: list[int]):
        from atomc.partition.cost import plan_costs

        return plan_costs(self.tables, self.params, cuts)


def ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def working(c) -> int:
    """Working memory beside the runtime's slots (cost.derive's work_bytes, for one range)."""
    return max(c.mem_fwd_bytes - c.param_bytes, c.mem_bwd_bytes - c.param_bytes - c.grad_bytes)


def span(values: list[int], fmt) -> str:
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def layers(plan: Plan, i: int) -> str:
    s = plan.submodels[i]
    return f"{s.layers[0]} .. {s.layers[-1]}" if s.layers else f"{s.first_node} .. {s.last_node}"


def stored_text(plan: Plan) -> str:
    """What --activations auto stores, and the step recomputing everything (the costs below
    are the cuts', recomputing everything)."""
    if plan.recompute_step_ms is None:
        return ""
    c = plan.accum
    kept = c * sum(s.kept_bytes for s in plan.submodels)
    sent = c * sum(s.sent_bytes for s in plan.submodels)
    count = sum(len(s.kept) + len(s.sent) for s in plan.submodels)
    return (f" ({step_text(plan.recompute_step_ms)} recomputing everything: `--activations "
            f"auto` stores the outputs of {count} operators, {format_bytes(kept)} kept on the "
            f"GPU and {format_bytes(sent)} sent to host memory for C micro-batches; the costs "
            f"below are the cuts' recomputing everything)")


def headline(rows: list[Row], work: Path) -> list[str]:
    """The 175B half-precision rows at 11 GiB on both hosts, explained with their numbers."""
    from atomc.partition import build_plan
    from atomc.partition.constraints import slot_bytes
    from atomc.partition.cost import first_tail
    from atomc.partition.precision import Precision

    out = []
    for row in rows:
        plan = row.plan
        if plan is None:
            out.append(wrap(f"{row.target}: the command refused: {row.error}", "- ", "  "))
            continue
        profile = Profile.load(profile_path(work, row.config, row.target))
        m = Model.of(profile, plan, width=64)
        cuts = [s.start for s in plan.submodels[1:]]
        costs = m.costs(cuts)
        usable = plan.capacity_bytes - plan.reserve_bytes
        slots = slot_bytes(costs)
        big = max(range(len(costs)), key=lambda i: working(costs[i]))
        mid = costs[len(costs) // 2 - 1: len(costs) // 2 + 2]  # a block's three thirds
        first, second = costs[0], costs[1]
        tail, _ = first_tail(costs)
        wait = tail - first.offload_ns - first.optimizer_ns
        out.append(wrap(
            f"**{row.target}, {row.dtype}**: every constraint met at C = {plan.accum}: "
            f"{len(costs)} sub-models, {plan.predicted_utilisation:.1%} predicted busy, "
            f"{step_text(plan.predicted_step_ms)} a step{stored_text(plan)}. Sub-model 0 is "
            f"{layers(plan, 0)} ({format_bytes(first.param_bytes)}, little compute: C*t_bwd "
            f"{ms(first.accum_bwd_ns)}); the middle sub-models are thirds of a block "
            f"({span([c.param_bytes for c in mid], format_bytes)}, loaded in "
            f"{span([c.load_fwd_ns for c in mid], ms)} behind "
            f"{span([c.accum_fwd_ns for c in mid], ms)} of forward compute); the last is "
            f"{layers(plan, len(costs) - 1)}. "
            f"The runtime's two weight and two gradient slots of the largest sub-model "
            f"({format_bytes(max(c.param_bytes for c in costs))}) take {format_bytes(slots)} of "
            f"the {format_bytes(usable)} usable; the most working memory beside them is "
            f"sub-model {big}'s, {format_bytes(working(costs[big]))}.", "- ", "  "))
        out.append(wrap(
            f"At the step boundary sub-model 1 ({layers(plan, 1)}) must send its gradients "
            f"out ({ms(second.offload_ns)}) and have the CPU update it "
            f"({ms(second.optimizer_ns)}) while sub-model 0 runs its backward and sends its "
            f"own gradients ({ms(first.accum_bwd_ns)} + {ms(first.offload_ns)}): sub-model 0's "
            f"update waits {ms(wait)} for it. The GPU waits there anyway, for sub-model 0's "
            f"gradients, update and refresh ({ms(first.offload_ns)} + "
            f"{ms(first.optimizer_ns)} + {ms(first.load_fwd_ns)}); the wait makes that "
            f"{ms(tail + first.load_fwd_ns)}, {wait / (plan.predicted_step_ms * 1e6):.2%} of "
            f"the step, and the predicted step includes it.", "  ", "  "))
        # the plan the earlier tables had: the embedding and the first block's attention
        # through its scaled-dot-product attention together in sub-model 0
        sdpa = m.node("scaled_dot_product_attention") + 1
        wide = [sdpa, *[c for c in cuts if c > sdpa]]
        old = build_plan(profile, m.tables, m.params, wide, capacity_bytes=plan.capacity_bytes,
                         reserve_bytes=plan.reserve_bytes, precision=Precision(
                             plan.transfer_dtype, plan.autocast), view=m.view)
        short = min(s.slack_memory_bytes for s in old.submodels)
        worst = min(range(len(old.submodels)), key=lambda i: old.submodels[i].slack_memory_bytes)
        wide_costs = m.costs(wide)
        out.append(wrap(
            f"The earlier tables' plan put the embedding and the first block's attention input "
            f"projection together in sub-model 0 ({format_bytes(wide_costs[0].param_bytes)}), "
            f"whose backward then hid sub-model 1's update. The runtime sizes its four slots "
            f"for that sub-model ({format_bytes(slot_bytes(wide_costs))}), and sub-model "
            f"{worst}'s working memory ({format_bytes(working(wide_costs[worst]))}) does not "
            f"fit beside them: short by {format_bytes(-short)} of {format_bytes(usable)}, "
            f"so it would run out of memory on the GPU.", "  ", "  "))
    return out


def refusals(rows: list[Row], work: Path) -> list[str]:
    """Rows the command refused: its message, and the arithmetic of the runtime's slots.

    Every plan's largest sub-model holds at least the largest operator's parameters (P), and
    the runtime holds four slots of it; so each node X needs some sub-model around it whose
    working memory fits beside four slots of max(P, its own parameters). The node whose
    cheapest such sub-model needs most, and what that is, says why nothing fits."""
    from atomc.partition import plan_tables
    from atomc.partition.cost import CostParams, derive
    from atomc.partition.precision import device_view, resolve_precision
    from atomc.partition.tables import node_facts

    out = []
    for row in rows:
        if row.plan is not None:
            continue
        profile = Profile.load(profile_path(work, row.config, row.target))
        view = device_view(profile, resolve_precision(profile, row.dtype, None))
        facts = node_facts(view)
        n = facts.num_nodes
        usable = row.gib * GIB - GIB
        tables = plan_tables(facts, usable, "recompute")
        d = derive(tables, CostParams(1, usable, profile.h2d_gbps, profile.d2h_gbps))
        one = tables.param_bytes[:, 1]
        j = int(one.argmax())
        floor = int(one[j])
        big = 2**62
        need = d.work_bytes + 4 * np.maximum(floor, d.param_bytes)
        need = np.where(d.ok, need, big)
        least = np.full(n, big, dtype=np.int64)  # per node: its cheapest sub-model's need
        for w in range(1, tables.max_width + 1):
            for o in range(w):
                least[o:n] = np.minimum(least[o:n], need[: n - o, w])
        x = int(least.argmax())
        said = row.error if not out else row.error[row.error.find("the smallest budget"):]
        line = f"- {row.config}, {row.target}, {row.weights}, {row.gib} GiB: {said}."
        if least[x] > usable:
            node = view.graph.nodes[x]
            what = "no sub-model around it fits alone" if least[x] == big else (
                f"the cheapest sub-model around it needs {format_bytes(int(least[x]))}, its "
                f"working memory and the slots")
            line += (f" The largest operator's parameters are "
                     f"{view.graph.nodes[j].module_fqn or view.graph.nodes[j].name}'s "
                     f"({format_bytes(floor)}): the runtime's four slots take at least "
                     f"{format_bytes(4 * floor)} of the {format_bytes(usable)} usable at "
                     f"C = 1, and at {node.module_fqn or node.op}'s {node.name} {what}.")
        out.append(wrap(line, "", "  "))
    return out


def bindings(rows: list[Row]) -> list[str]:
    """Rows whose best plan breaks a constraint: which, between which sub-models, by how much."""
    out = []
    for r in rows:
        if r.plan is None or r.plan.feasible:
            continue
        i = int(r.plan.binding.split(":")[0].removeprefix("sub-model "))
        pair = [j for j in (i, i + 1) if j < len(r.plan.submodels)]
        named = ", ".join(f"sub-model {j} is {layers(r.plan, j)} "
                          f"({format_bytes(r.plan.submodels[j].param_bytes)})" for j in pair)
        out.append(wrap(f"{r.config}, {r.target}, {r.weights}, {r.gib} GiB, C = {r.plan.accum} "
                        f"({len(r.plan.submodels)} sub-models, "
                        f"{r.plan.predicted_utilisation:.1%} predicted busy): {r.plan.binding}; "
                        f"{named}. {r.plan.notes[-1][0].upper()}{r.plan.notes[-1][1:]}.",
                        "- ", "  "))
    return out


def timings(rows: list[Row]) -> list[str]:
    out = ["| target | model | weights | GPU memory | CPU | wall |", "|---|---|---|---:|---:|---:|"]
    out += [f"| {r.target} | {r.config} | {r.weights} | {r.gib} GiB | {r.cpu_s:.1f} s | "
            f"{r.wall_s:.1f} s |" for r in rows]
    return out


# ---------------------------------------------------------------------------------------------


INTRO = """\
# GPT-3 plans

Generated by `bench/gpt3_tables.py` (`make tables`) on {date}, {machine}; do not edit by hand.
Every row is `atomc partition` run on an estimated profile of `examples/gpt.py` (micro-batch
1, sequence 2048), exactly as written below, and read back from the plan it wrote;
`tests/partition/test_headline_plans.py` pins the headline rows (GPT-3 175B at 11 GiB), so a
change that moves them fails a test.

    atomc profile examples/gpt.py --config CONFIG --target TARGET -o P.json
    atomc partition P.json --gpu-mem N GiB --transfer-dtype DTYPE --host-mem 1024TiB

- **float32**: `--transfer-dtype float32`: fp32 weights and gradients on the GPU, compute under
  autocast in the target's half dtype (the profile's times assume it), so activations are
  sized as CUDA autocast makes them.
- **half**: `--transfer-dtype float16` on the V100 (`bfloat16` on the RTX 3090): half weights
  and gradients (norm weights fp32), half autocast, fp32 masters on the host.

The CPU AdamW rate is each hardware profile's host figure (`--cpu-adam-gbps auto`): 13.2 GB/s
of fp32 masters for the V100's server host, 5.3 GB/s for the RTX 3090's desktop. `--gpu-mem`
as listed, with the default 1 GiB reserve. C is the accumulation degree of the most tokens a
second: the partitioner weighs C from the smallest whose best plan meets every constraint
([design](design.md#partition-algorithm-1-exact)) upwards (`atomc show --sweep` prints each;
`--accum min` takes the smallest). The constraints: every load hidden behind compute, every
gradient offload and CPU update keeping pace with the backward, and memory, counting the
runtime's two weight and two gradient slots, each the size of the largest sub-model
(atomc.runtime.slots).
At the step boundary the GPU always waits for sub-model 0's gradients, CPU update and refresh;
when sub-model 1's update is still running then, that wait grows, and the predicted step
includes it (a note in the plan says by how much).

Activations are planned per operator (`--activations auto`, the default: heavy operators'
outputs kept on the GPU or sent to host memory where the memory and link slack allow, the rest
recomputed; docs/partitioning.md): "predicted step" is that plan's, "recomputing everything"
the same cuts' step with every sub-model recomputing its forward in its backward.

Host memory is listed, not checked (`--host-mem 1024TiB`): the rows are about the GPU. The column
is what the run holds on the host with float32 moments (masters, moments, pinned transfer
copies, gradient buffers, activations); `--optimizer-states bfloat16` and frozen weights
reduce it (docs/checkpoints.md). Without `--host-mem`, a target's plan is checked against the
host its hardware profile states, and GPT-3 6.7B and larger are refused there.

The last column is the whole command's CPU time (user + system of its process: Python and
torch start-up, reading the profile, the search, writing the plan), one per GPU memory of the
row, the least of {runs} runs, with atomc's bytecode written as an installed atomc has it;
wall clock is in the last section.
"""

READING = """\
Reading the tables:

- C is the one of the most tokens a second. A larger C computes more micro-batches per load,
  so loads, offloads and the CPU update (a cost per step) weigh less per token, until the GPU
  computes nearly all the step; it also keeps more boundary activations, so memory bounds it.
  When a model fits whole (small models, large GPUs) the plan still cuts it in two or three:
  the next sub-model's update overlaps the first one's backward. `--accum min` gives the
  smallest C that meets every constraint, ATOM's rule, for the shortest step.
- Half-precision weights halve every load and offload and the device memory of weights and
  gradients; the CPU update does not shrink (it reads fp32 masters).
- The runtime's slots are sized for the largest sub-model, so one large sub-model (the
  embedding, the tied LM head) takes memory from every other: the partitioner tries caps on the
  largest sub-model at each C and keeps the best plan.
"""


HISTORY = """\
## What moved these plans

How these plans differ from the README's earlier tables (commit 745e32a), and which changes
moved them, is in [bench/RESULTS.md](../bench/RESULTS.md#gpt3-plans-moved).
"""


def render(rows: list[Row], work: Path) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    lines = [INTRO.format(date=date, machine=machine, runs=TIMING_RUNS)]
    for target, configs, _half in TABLES:
        mine = [r for r in rows if r.target == target]
        if not mine:
            continue
        hw = Profile.load(profile_path(work, mine[0].config, target)).hardware
        lines.append(f"## {target}: {hw.description if hw else target}\n")
        lines.extend(table(mine, with_model=len(configs) > 1))
        lines.append("")
    lines.append(READING)
    head = [r for r in rows if r.config == "gpt3-175b" and r.gib == HEADLINE_GIB
            and r.weights == "half"]
    if head:
        lines.append(f"## GPT-3 175B at {HEADLINE_GIB} GiB in half precision\n")
        lines.append("The configuration ATOM trained on an 11 GB GTX 1080 Ti, on both hosts:\n")
        lines.extend(headline(head, work))
        lines.append("")
    lines.append(HISTORY)
    refused = refusals(rows, work)
    if refused:
        lines.append("## Rows that do not fit\n")
        lines.extend(refused)
        lines.append("")
    bound = bindings(rows)
    if bound:
        lines.append("## Rows where a constraint binds\n")
        lines.extend(bound)
        lines.append("")
    slow = [r for r in rows if r.cpu_s >= 5.0]
    lines.append("## Partition time\n")
    worst = max(rows, key=lambda r: r.cpu_s)
    lines.append(wrap(f"Every row's whole command took at most {worst.cpu_s:.1f} s of CPU "
                      f"({worst.config}, {worst.target}, {worst.weights}, {worst.gib} GiB)"
                      + (f"; {len(slow)} rows took 5 s or more." if slow else
                         ", under the 5 s goal.") + " About 2 s of each is Python and torch "
                      "start-up and reading the profile (the gpt3-small rows, whose search takes "
                      "a tenth of a second, show it). Wall clock is that of the machine that ran "
                      "the script, shared with other work when it ran slower than the CPU time.")
                 + "\n")
    lines.extend(timings(rows))
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpt3-plans.md"))
    ap.add_argument("--work", help="folder for profiles and plans (default: a temporary one)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--mems", default=",".join(str(m) for m in MEMS))
    ap.add_argument("--reuse", action="store_true",
                    help="take each row from an earlier run in --work where there is one")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    mems = [int(m) for m in args.mems.split(",")]
    with tempfile.TemporaryDirectory(prefix="atomc-tables-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for target, models, half in TABLES:
            for config in (c for c in models if c in configs):
                for dtype in ("float32", half):
                    for gib in mems:
                        row = plan_row(work, target, config, dtype, gib, args.reuse)
                        rows.append(row)
                        print(f"{target:10s} {config:12s} {dtype:9s} {gib:3d} GiB  "
                              f"{' | '.join(outcome(row))}  cpu {row.cpu_s:.1f} s, "
                              f"wall {row.wall_s:.1f} s", flush=True)
        text = render(rows, work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
