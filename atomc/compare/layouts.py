"""One global batch in DT-FM layouts (GPipe, 1F1B), and PipeDream as a baseline, predicted.

**gpipe**, **1f1b** (DT-FM layouts, atomc.distributed.runner): for every number of stages D_PP
that divides the devices, `atomc place` lays D_PP stages x D_DP replicas out on the network;
each device runs its stage's step (atomc.actions: GPipe or 1F1B over the replica's
micro-batches) with its sends and receives on the links, then what the runner does after
it: waits for its sends, sums tied weights' gradients between the stages holding them,
averages the stage's gradients over its data-parallel group (the sharded exchange) and steps
AdamW on the device. A stage keeps its graphs where they fit its device. Where a stage of the
runner's step (one flush, graphs kept) does not fit, the runner runs it swapped
(atomc.distributed.runner `_decide_swap` with the device's memory as the budget,
atomc.stages.swapped) and then runs the whole layout as GPipe: gpipe's layout then has
those stages swapped, each stage's step the list it runs (`swapped_stage_order`: every receive,
ATOM's forward over its blocks as sub-models loaded from host memory, the sends; the same back)
timed by the events simulator as a peer's step is, and its update CPU AdamW; 1f1b's layout has
none (the runner would run it as GPipe). Besides, as GPipe does to fit, compare tries
recomputing blocks and splitting the step into smaller flushes (not what the runner does), and
takes the fastest layout that fits.

**pipedream** (Narayanan et al., SOSP 2019; ATOM's baseline), which atomc does not run: the
same layouts, each stage running asynchronous 1F1B (atomc.actions.orders.pipedream) across
step boundaries with no flush. Its update granularity is PipeDream's: a stage updates its
weights after every micro-batch's backward (PipeDream's mini-batch), first summing tied
weights' gradients with the stages holding them and averaging the micro-batch's gradients over
its data-parallel group (PipeDream's replicated stages synchronise every mini-batch), then
AdamW; with --no-sync none of that is timed. Stage j stashes D_PP - j weight versions (the one
each in-flight micro-batch's forward used, for its backward) besides a gradient and, with
updates, AdamW's two moments, and keeps the activations of its D_PP - j micro-batches in
flight; the versions count with --no-sync too, as PipeDream's weight-stashing optimizer clones
them all when it is made. Its step is the mean of `PIPEDREAM_WINDOW` steady-state steps,
simulated after enough steps to fill the pipeline and followed by enough to drain it, so that
neither the fill nor the drain is in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atomc.actions import Action, directions, max_in_flight, pipeline_order
from atomc.actions.orders import pipedream, swapped_stage_order
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
from atomc.partition import host_gap_ms
from atomc.place import place
from atomc.place.network import Network
from atomc.simulate.events import copies_on_host, simulate_actions
from atomc.simulate.network import (
    Links,
    StageCosts,
    exchange_jobs,
    message_job,
    pipeline_jobs,
    simulate_programs,
)
from atomc.units import format_bytes, ms_to_ns

LAYOUT_STEPS = 3  # simulated steps of a layout; the last one is reported, so that the first's
# filling of the links is not in it
# PipeDream's steady state: the mean of this many steps (a pipeline whose stages or links
# differ can settle into steps that alternate in a period of 2 or 3 steps)
PIPEDREAM_WINDOW = 6
SCHEDULES = ("gpipe", "1f1b", "pipedream")


@dataclass(frozen=True)
class SwappedStep:
    """A swapped stage's step on one device (its list without the receives and sends, timed
    by the events simulator): what runs between its receives and sends, ns."""

    forward_ns: int  # its opening load to the end of its last forward (every sub-model)
    backward_ns: int  # from there to its last offload (0 where it holds the output: all above)
    compute_ns: int  # forwards and backwards (with recomputation) of every micro-batch
    copies_ns: int  # the host-to-device lane: every load of the step


def pipedream_steps(stages: int, micro: int) -> tuple[int, int]:
    """(steps simulated, first step of the window): as many steps before and after the
    window as it takes D_PP micro-batches to fill the pipeline and to drain it."""
    edge = math.ceil(stages / micro)
    return 2 * edge + PIPEDREAM_WINDOW, edge


def _stage_counts(n: int, num_units: int, setting: Setting) -> list[int]:
    wanted = setting.stages or tuple(p for p in range(1, n + 1) if n % p == 0)
    return [p for p in wanted if n % p == 0 and p <= num_units]


def _params(ref: HardwareModel, a: int, b: int) -> set[str]:
    """What units [a, b) read: their weights and buffers."""
    return set().union(*(u.params for u in ref.units[a:b]))


def _tied_sets(ref: HardwareModel, ranges) -> dict[tuple[int, ...], set[str]]:
    """Stages that share a weight -> the weights: the runner sums their gradients."""
    held = [_params(ref, a, b) for a, b in ranges]
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
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"layout schedules {unknown}: expected some of {', '.join(SCHEDULES)}")
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


def swapped_step(hm: HardwareModel, start: int, stop: int, micro: int, stage: int,
                 holds_output: bool) -> SwappedStep:
    """The step of a swapped stage over units [start, stop) (one sub-model a unit): its
    order without R and S through the events simulator, cut where it waits for the
    gradients (after its last forward). Every lane is idle there: the forward's loads were
    waited for, and nothing else runs in a forward."""
    order = [a for a in swapped_stage_order(stop - start, micro, stage, holds_output)
             if a.kind not in "RS"]
    times = hm.swapped_stage_times(start, stop, micro)
    host = copies_on_host(hm.profile.device)
    sim = simulate_actions(order, times, micro, host_copies=host,
                           host_gap_ns=ms_to_ns(host_gap_ms(hm.profile)))
    # the simulator takes the step's first action to end at 0 (the step before ends with it)
    # and records the next step's first action last: the step is that action's time and the
    # others'. It is a load, but for one sub-model holding the output, whose list has none.
    *events, _ = sim.timeline.events
    first = order[0]
    opening = times[0].load_ns if first.kind == "L" else times[first.index].fwd_ns // micro
    end = ms_to_ns(max(e.end_ms for e in events if e.lane in ("compute", "offload")))
    copies = ms_to_ns(sim.timeline.busy_ms("prefetch", step=0))
    if holds_output:
        return SwappedStep(opening + end, 0, sim.compute_ns, copies)
    last_forward = ms_to_ns(max(e.end_ms for e in events if e.kind == "forward"))
    return SwappedStep(opening + last_forward, end - last_forward, sim.compute_ns, copies)


def _stage_costs(sched: str, machines, models, ref: HardwareModel, ranges, matrix, micro: int,
                 flush: int, recompute_ok: bool, swap_ok: bool = False):
    """Each device's (order, StageCosts, SwappedStep or None), the stages that recompute and
    those that are swapped; or the first stage that does not fit (a reason). A stage keeps
    its graphs where they fit; with `recompute_ok`, it recomputes its blocks where they do
    not; with `swap_ok`, it runs swapped. PipeDream's order is all its simulated steps; its
    stage j also holds D_PP - j weight versions."""
    pp, dp = len(matrix), len(matrix[0])
    costs = {}
    recomputing = set()
    swapped = set()
    for j, (a, b) in enumerate(ranges):
        if sched == "pipedream":
            order = pipedream(micro, j, pp, pipedream_steps(pp, micro)[0])
        else:
            order = flushed_order(sched, micro, flush, j, pp)
        flight = max_in_flight(order)
        versions = pp - j if sched == "pipedream" else 1
        # values travel with the micro-batch's generator states; gradients alone
        vin, gout = ref.boundary_bytes(a) if j > 0 else (0, 0)
        vout, gin = ref.boundary_bytes(b) if j < pp - 1 else (0, 0)
        vin += ref.rng_state_bytes if j > 0 else 0
        vout += ref.rng_state_bytes if j < pp - 1 else 0
        for r in range(dp):
            d = matrix[j][r]
            m = machines[d]
            hm = models[m.hardware]
            # the stashed versions besides the weights a resident stage holds
            stash = (versions - 1) * hm.param_bytes(_params(ref, a, b))
            recompute = (recompute_ok
                         and hm.stage_memory_bytes(a, b, flight) + stash > m.memory_bytes)
            need = hm.stage_memory_bytes(a, b, flight, recompute) + stash
            if need > m.memory_bytes and swap_ok:
                swap = hm.swapped_stage_memory_bytes(a, b, micro)
                host = (hm.swapped_stage_host_bytes(a, b, micro)
                        if m.host_memory_bytes is not None else 0)
                if swap > m.memory_bytes or host > (m.host_memory_bytes or 0):
                    over = ((swap, m.memory_bytes, "")
                            if swap > m.memory_bytes else (host, m.host_memory_bytes, "host "))
                    return None, (
                        f"{pp} stages x {dp} replicas, {sched}: stage {j} (blocks {a}..{b - 1}) "
                        f"does not fit resident ({format_bytes(need)}, {need} bytes), and "
                        f"swapped over {micro} micro-batches needs {format_bytes(over[0])} "
                        f"({over[0]} bytes) of {over[2]}memory on device {m.name}, which has "
                        f"{format_bytes(over[1])} ({over[1]} bytes)")
                swapped.add(j)
                order = swapped_stage_order(b - a, micro, j, j == pp - 1)
                step = swapped_step(hm, a, b, micro, j, j == pp - 1)
                costs[d] = (order, StageCosts(0, 0, vin, gout, vout, gin), step)
                continue
            if need > m.memory_bytes:
                return None, (
                    f"{pp} stages x {dp} replicas, {sched}: stage {j} (blocks {a}..{b - 1}, "
                    f"{flight} micro-batch(es) in flight"
                    f"{f', {versions} weight versions stashed' if versions > 1 else ''}"
                    f"{', blocks recomputed' if recompute_ok else ''}) needs "
                    f"{format_bytes(need)} ({need} bytes) on device {m.name}, which has "
                    f"{format_bytes(m.memory_bytes)} ({m.memory_bytes} bytes)")
            if recompute:
                recomputing.add(j)
            fwd, bwd = hm.stage_compute_ns(a, b, recompute)
            costs[d] = (order, StageCosts(fwd, bwd, vin, gout, vout, gin), None)
    return (costs, recomputing, swapped), ""


def _simulate_layout(sched: str, machines, models, links: Links, ref: HardwareModel, ranges,
                     matrix, micro: int, setting: Setting, names) -> ModeResult:
    """The layout's step: one flush of the replica's micro-batches with every graph kept
    where that fits (the layout runner's step); else the fastest of the largest flush that
    fits keeping the graphs, the largest that fits recomputing blocks and, for GPipe, the
    runner's step with the stages that do not fit swapped. PipeDream does not flush: it keeps
    the graphs, or recomputes blocks."""
    sizes = [x for x in range(micro, 0, -1) if micro % x == 0 and
             (sched != "pipedream" or x == micro)]
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
    if sched == "gpipe" and (micro, frozenset()) not in found:
        got, why = _stage_costs(sched, machines, models, ref, ranges, matrix, micro, micro,
                                False, swap_ok=True)
        if got is not None:
            found["swapped"] = (micro, *got)
        elif not found:
            reason = why
    if not found:
        if sched == "1f1b":
            reason += ("; the layout runner would run a stage that does not fit swapped, and "
                       "the whole layout as GPipe (see GPipe)")
        return infeasible(sched, reason)
    results = [_run_layout(sched, machines, models, links, ref, ranges, matrix, micro, flush,
                           costs, recomputing, swapped, setting, names)
               for flush, costs, recomputing, swapped in found.values()]
    return min(results, key=lambda r: r.step_ns)


def _swapped_jobs(order: list[Action], sc: StageCosts, step: SwappedStep, *, key: int,
                  replica: int, prev_device: int | None, next_device: int | None) -> list:
    """A swapped stage's step (`swapped_stage_order`) as jobs: its receives and sends as
    pipeline_jobs makes them, and what runs between them as one compute job (the forward
    part, then the backward part, of `step`)."""
    jobs: list = []
    parts = iter((step.forward_ns, step.backward_ns))
    between = False
    for a, direction in zip(order, directions(order)):
        if a.kind in "RS":
            jobs.append(message_job(a, direction, sc, step=key, replica=replica,
                                    prev_device=prev_device, next_device=next_device))
            between = False
        elif not between:
            jobs.append(("compute", next(parts), "swapped step"))
            between = True
    return jobs


def _pipedream_programs(machines, models, ref: HardwareModel, matrix, micro: int, costs,
                        tied, stage_params, setting: Setting) -> list[list]:
    """Every device's PipeDream order as one program: after each micro-batch's backward the
    tied weights' gradients, the data-parallel average and AdamW (with sync), and a `mark`
    where the micro-batch is its step's last."""
    pp, dp = len(matrix), len(matrix[0])
    programs: list[list] = [[] for _ in machines]
    for j in range(pp):
        for r in range(dp):
            d = matrix[j][r]
            order, sc, _ = costs[d]
            hm = models[machines[d].hardware]

            def update(m: int, j=j, r=r, d=d, hm=hm) -> list:
                jobs: list = []
                for stages, fqns in sorted(tied.items()):
                    if j in stages:
                        others = [(s, matrix[s][r]) for s in stages if s != j]
                        nbytes = ref.param_bytes(fqns)
                        jobs += [("send", o, nbytes, ("tied", m, r, stages, j, o))
                                 for _, o in others]
                        jobs += [("recv", o, ("tied", m, r, stages, s, d)) for s, o in others]
                if setting.sync:
                    group = [matrix[j][x] for x in range(dp)]
                    jobs += exchange_jobs(d, group, ref.param_bytes(stage_params[j]),
                                          ("dp", m, j))
                    opt = hm.optimizer_ns(stage_params[j])
                    if opt:
                        jobs.append(("compute", opt, "optimizer"))
                if (m + 1) % micro == 0:
                    jobs.append(("mark", m // micro))
                return jobs

            programs[d] = pipeline_jobs(order, sc, step=0, replica=r,
                                        prev_device=matrix[j - 1][r] if j > 0 else None,
                                        next_device=matrix[j + 1][r] if j < pp - 1 else None,
                                        update=update)
    return programs


def _run_layout(sched: str, machines, models, links: Links, ref: HardwareModel, ranges, matrix,
                micro: int, flush: int, costs, recomputing, swapped, setting: Setting,
                names) -> ModeResult:
    pp, dp = len(matrix), len(matrix[0])
    tied = _tied_sets(ref, ranges) if setting.sync else {}
    stage_params = [_params(ref, a, b) for a, b in ranges]
    if sched == "pipedream":
        steps, first = pipedream_steps(pp, micro)
        programs = _pipedream_programs(machines, models, ref, matrix, micro, costs, tied,
                                       stage_params, setting)
        sim = simulate_programs(programs, links)
        last = first + PIPEDREAM_WINDOW - 1
        span = (sim.step_end(last) - sim.step_end(first - 1)) // PIPEDREAM_WINDOW
        return _layout_result(sched, sim, steps, span, ref, ranges, matrix, micro, flush,
                              recomputing, swapped, costs, names)
    programs = [[] for _ in machines]
    for step in range(LAYOUT_STEPS):
        for j in range(pp):
            for r in range(dp):
                d = matrix[j][r]
                order, sc, swap = costs[d]
                hm = models[machines[d].hardware]
                prog = programs[d]
                ends = {"prev_device": matrix[j - 1][r] if j > 0 else None,
                        "next_device": matrix[j + 1][r] if j < pp - 1 else None}
                if swap is None:
                    prog += pipeline_jobs(order, sc, step=step, replica=r, **ends)
                else:
                    prog += _swapped_jobs(order, sc, swap, key=step, replica=r, **ends)
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
                    if swap is None:
                        opt = hm.optimizer_ns(stage_params[j])
                        if opt:
                            prog.append(("compute", opt, "optimizer"))
                    else:  # the swap runtime's CPU AdamW, which the runner waits for
                        opt = hm.swapped_stage_optimizer_ns(stage_params[j])
                        if opt:
                            prog.append(("compute", opt, "host optimizer"))
                prog.append(("mark", step))
    sim = simulate_programs(programs, links)
    span = sim.step_ns(LAYOUT_STEPS - 1)
    return _layout_result(sched, sim, LAYOUT_STEPS, span, ref, ranges, matrix, micro, flush,
                          recomputing, swapped, costs, names)


def _layout_result(sched: str, sim, steps: int, span: int, ref: HardwareModel, ranges, matrix,
                   micro: int, flush: int, recomputing, swapped, costs,
                   names) -> ModeResult:
    """The reported step of `span` ns. Every simulated step computes the same and sends the
    same bytes, so a device's (or link's) busy time in one step is its total over `steps`. A
    swapped stage's device computes only its forwards and backwards of the parts its jobs
    time (they wait for loads too), and not during the host's optimizer."""
    pp, dp = len(matrix), len(matrix[0])
    compute = []
    copies = []
    for d in range(len(names)):
        swap = costs[d][2] if d in costs else None
        if swap is None:
            compute.append(sim.busy_ns[d] / steps)
        else:
            compute.append(swap.compute_ns)
            copies.append((f"host-to-device copies on {names[d]}", swap.copies_ns / span))
    busy = tuple((names[d], compute[d] / span) for d in range(len(names)))
    rows = link_rows(names, sim.link_bytes, sim.link_busy_ns, span, 1 / steps)
    spans = ", ".join(f"{a}..{b - 1}" for a, b in ranges)
    config = (f"{pp} stage(s) x {dp} replica(s), {micro} micro-batches per replica"
              + (f" in {micro // flush} flushes of {flush}" if flush < micro else "")
              + (f", no flush (weight versions stashed by stage: "
                 f"{'/'.join(str(pp - j) for j in range(pp))}; the mean of {PIPEDREAM_WINDOW} "
                 f"steady steps)" if sched == "pipedream" else "")
              + f", blocks {spans}"
              + (f"; stage(s) {','.join(map(str, sorted(recomputing)))} recompute their "
                 f"blocks (the graphs do not fit)" if recomputing else "")
              + (f"; stage(s) {','.join(map(str, sorted(swapped)))} swapped (their blocks "
                 f"do not fit resident; loaded from host memory)" if swapped else ""))
    return ModeResult(mode=sched, feasible=True, step_ns=span,
                      samples=micro * dp * ref.micro_batch, config=config, busy=busy,
                      links=rows, resources=resources_of(busy, rows, copies),
                      detail={"stages": pp, "replicas": dp, "micro_batches": micro,
                              "recomputing": sorted(recomputing), "swapped": sorted(swapped),
                              "flush": flush,
                              "ranges": [list(x) for x in ranges],
                              "devices": [[names[d] for d in row] for row in matrix],
                              **({"weight_versions": [pp - j for j in range(pp)],
                                  "steps_simulated": steps} if sched == "pipedream" else {})})


__all__ = ["LAYOUT_STEPS", "PIPEDREAM_WINDOW", "SCHEDULES", "SwappedStep", "flushed_order",
           "pipedream_steps", "predict_layouts", "swapped_step"]
