"""One global batch in DT-FM layouts (GPipe, 1F1B), predicted.

**gpipe**, **1f1b** (DT-FM layouts, atomc.distributed.runner): for every number of stages D_PP
that divides the devices, `atomc place` lays D_PP stages x D_DP replicas out on the network;
each device runs its stage's step (atomc.actions: GPipe or 1F1B over the replica's
micro-batches) with its sends and receives on the links, then what the runner does after
it: waits for its sends, sums tied weights' gradients between the stages holding them,
averages the stage's gradients over its data-parallel group (the sharded exchange) and steps
AdamW on the device. Stages are resident: the best layout whose every stage fits its device.
"""

from __future__ import annotations

from atomc.actions import Action, max_in_flight, pipeline_order
from atomc.compare.costs import HardwareModel, placement_plan
from atomc.compare.modes import (
    Machine,
    ModeResult,
    Setting,
    infeasible,
    link_rows,
    links_of,
    resources_of,
)
from atomc.place import place
from atomc.place.network import Network
from atomc.simulate.network import (
    Links,
    StageCosts,
    exchange_jobs,
    pipeline_jobs,
    simulate_programs,
)
from atomc.units import format_bytes

LAYOUT_STEPS = 3  # simulated steps of a layout; the last one is reported, so that the first's
# filling of the links is not in it


def _stage_counts(n: int, num_units: int, setting: Setting) -> list[int]:
    wanted = setting.stages or tuple(p for p in range(1, n + 1) if n % p == 0)
    return [p for p in wanted if n % p == 0 and p <= num_units]


def _tied_sets(ref: HardwareModel, ranges) -> dict[tuple[int, ...], set[str]]:
    """Stages that share a weight -> the weights: the runner sums their gradients."""
    held = [set().union(*(u.params for u in ref.units[a:b])) for a, b in ranges]
    params = set(ref.profile.graph.params)
    out: dict[tuple[int, ...], set[str]] = {}
    for f in sorted(set().union(*held) & params):
        stages = tuple(j for j, h in enumerate(held) if f in h)
        if len(stages) > 1:
            out.setdefault(stages, set()).add(f)
    return out


def predict_layouts(machines: list[Machine], models: dict[str, HardwareModel], network: Network,
                    setting: Setting, schedules=("gpipe", "1f1b")) -> dict[str, ModeResult]:
    """The best layout of each schedule (see the module docstring)."""
    n = len(machines)
    names = [m.name for m in machines]
    index = {m.name: i for i, m in enumerate(machines)}
    ref = models[machines[0].hardware]
    links = links_of(network)
    best: dict[str, ModeResult] = {}
    reasons: dict[str, list[str]] = {s: [] for s in schedules}
    counts = _stage_counts(n, len(ref.units), setting)
    if not counts:
        why = (f"no number of stages in {list(setting.stages or ())} divides the {n} devices "
               f"and is at most the model's {len(ref.units)} blocks")
        return {s: infeasible(s, why) for s in schedules}
    for pp in counts:
        dp = n // pp
        b = ref.micro_batch
        if setting.global_batch % (dp * b):
            for s in schedules:
                reasons[s].append(f"{pp} stages x {dp} replicas: the global batch "
                                  f"{setting.global_batch} does not split into {dp} replicas of "
                                  f"micro-batches of {b}")
            continue
        micro = setting.global_batch // (dp * b)
        plan = placement_plan(ref, micro)
        layout = place(network, pp, dp, plan=plan, seed=setting.seed,
                       budget_s=setting.place_budget_s, patience=setting.place_patience,
                       compare_random=False)
        ranges = [s.submodels for s in layout.stages]
        matrix = [[index[d] for d in row] for row in layout.devices]  # [stage][replica]
        for sched in schedules:
            result = _simulate_layout(sched, machines, models, links, ref, ranges, matrix,
                                      micro, setting, names)
            if not result.feasible:
                reasons[sched].append(result.reason)
            elif sched not in best or result.step_ns < best[sched].step_ns:
                best[sched] = result
    out = {}
    for s in schedules:
        if s in best:
            out[s] = best[s]
        else:
            out[s] = infeasible(s, "; ".join(reasons[s][-1:]) or "no layout")
    return out


def flushed_order(sched: str, micro: int, flush: int, stage: int, stages: int) -> list[Action]:
    """A stage's step of `micro` micro-batches as micro / flush pipeline flushes of `flush`
    each (the gradients accumulate between them); one flush is the layout runner's step."""
    out = []
    for f in range(micro // flush):
        out += [Action(a.kind, a.index, a.micro + f * flush)
                for a in pipeline_order(sched, flush, stage, stages)]
    return out


def _stage_costs(sched: str, machines, models, ref: HardwareModel, ranges, matrix, micro: int,
                 flush: int, recompute_ok: bool):
    """Each device's (order, StageCosts) and the stages that recompute, or the first stage
    that does not fit (a reason). A stage keeps its graphs where they fit; with
    `recompute_ok`, it recomputes its blocks where they do not."""
    pp, dp = len(matrix), len(matrix[0])
    costs = {}
    recomputing = set()
    for j, (a, b) in enumerate(ranges):
        order = flushed_order(sched, micro, flush, j, pp)
        flight = max_in_flight(order)
        # values travel with the micro-batch's generator states; gradients alone
        vin, gout = ref.boundary_bytes(a) if j > 0 else (0, 0)
        vout, gin = ref.boundary_bytes(b) if j < pp - 1 else (0, 0)
        vin += ref.rng_state_bytes if j > 0 else 0
        vout += ref.rng_state_bytes if j < pp - 1 else 0
        for r in range(dp):
            d = matrix[j][r]
            m = machines[d]
            hm = models[m.hardware]
            recompute = recompute_ok and hm.stage_memory_bytes(a, b, flight) > m.memory_bytes
            need = hm.stage_memory_bytes(a, b, flight, recompute)
            if need > m.memory_bytes:
                return None, (
                    f"{pp} stages x {dp} replicas, {sched}: stage {j} (blocks {a}..{b - 1}, "
                    f"{flight} micro-batch(es) in flight"
                    f"{', blocks recomputed' if recompute_ok else ''}) needs "
                    f"{format_bytes(need)} ({need} bytes) on device {m.name}, which has "
                    f"{format_bytes(m.memory_bytes)} ({m.memory_bytes} bytes)")
            if recompute:
                recomputing.add(j)
            fwd, bwd = hm.stage_compute_ns(a, b, recompute)
            costs[d] = (order, StageCosts(fwd, bwd, vin, gout, vout, gin))
    return (costs, recomputing), ""


def _simulate_layout(sched: str, machines, models, links: Links, ref: HardwareModel, ranges,
                     matrix, micro: int, setting: Setting, names) -> ModeResult:
    """The layout's step: one flush of the replica's micro-batches with every graph kept
    where that fits (the layout runner's step); else the faster of the largest flush that
    fits keeping the graphs and the largest that fits recomputing blocks."""
    sizes = [x for x in range(micro, 0, -1) if micro % x == 0]
    found = {}
    reason = ""
    for recompute_ok in (False, True):
        for flush in sizes:
            got, why = _stage_costs(sched, machines, models, ref, ranges, matrix, micro, flush,
                                    recompute_ok)
            if got is not None:
                found[(flush, frozenset(got[1]))] = (flush, *got)
                break
            if flush == sizes[0] or recompute_ok:
                reason = why
        if (micro, frozenset()) in found:
            break  # the runner's own step fits
    if not found:
        return infeasible(sched, reason)
    results = [_run_layout(sched, machines, models, links, ref, ranges, matrix, micro, flush,
                           costs, recomputing, setting, names)
               for flush, costs, recomputing in found.values()]
    return min(results, key=lambda r: r.step_ns)


def _run_layout(sched: str, machines, models, links: Links, ref: HardwareModel, ranges, matrix,
                micro: int, flush: int, costs, recomputing, setting: Setting,
                names) -> ModeResult:
    pp, dp = len(matrix), len(matrix[0])
    tied = _tied_sets(ref, ranges) if setting.sync else {}
    stage_params = [set().union(*(u.params for u in ref.units[a:b])) for a, b in ranges]
    programs: list[list] = [[] for _ in machines]
    for step in range(LAYOUT_STEPS):
        for j in range(pp):
            for r in range(dp):
                d = matrix[j][r]
                order, sc = costs[d]
                hm = models[machines[d].hardware]
                prog = programs[d]
                prog += pipeline_jobs(order, sc, step=step, replica=r,
                                      prev_device=matrix[j - 1][r] if j > 0 else None,
                                      next_device=matrix[j + 1][r] if j < pp - 1 else None)
                prog.append(("flush",))
                for stages, fqns in sorted(tied.items()):
                    if j not in stages:
                        continue
                    nbytes = ref.param_bytes(fqns)
                    others = [matrix[s][r] for s in stages if s != j]
                    prog += [("send", o, nbytes, ("tied", step, r, stages, j, o)) for o in others]
                    prog += [("recv", o, ("tied", step, r, stages, s, d))
                             for s, o in zip([s for s in stages if s != j], others)]
                if setting.sync:
                    group = [matrix[j][x] for x in range(dp)]
                    prog += exchange_jobs(d, group, ref.param_bytes(stage_params[j]),
                                          ("dp", step, j))
                    opt = hm.optimizer_ns(stage_params[j])
                    if opt:
                        prog.append(("compute", opt, "optimizer"))
                prog.append(("mark", step))
    sim = simulate_programs(programs, links)
    last = LAYOUT_STEPS - 1
    span = sim.step_ns(last)
    busy = tuple((names[d], sim.busy_ns[d] / LAYOUT_STEPS / span) for d in range(len(machines)))
    rows = link_rows(names, sim.link_bytes, sim.link_busy_ns, span, 1 / LAYOUT_STEPS)
    spans = ", ".join(f"{a}..{b - 1}" for a, b in ranges)
    config = (f"{pp} stage(s) x {dp} replica(s), {micro} micro-batches per replica"
              + (f" in {micro // flush} flushes of {flush}" if flush < micro else "")
              + f", blocks {spans}"
              + (f"; stage(s) {','.join(map(str, sorted(recomputing)))} recompute their "
                 f"blocks (the graphs do not fit)" if recomputing else ""))
    return ModeResult(mode=sched, feasible=True, step_ns=span,
                      samples=micro * dp * ref.micro_batch, config=config, busy=busy,
                      links=rows, resources=resources_of(busy, rows),
                      detail={"stages": pp, "replicas": dp, "micro_batches": micro,
                              "recomputing": sorted(recomputing), "flush": flush,
                              "ranges": [list(x) for x in ranges],
                              "devices": [[names[d] for d in row] for row in matrix]})


__all__ = ["LAYOUT_STEPS", "flushed_order", "predict_layouts"]
