"""One global batch in each way of training, predicted with the simulators.

input:  the devices (`Machine`: hardware, memory, host memory), the network (atomc.place's
        Network: bandwidth and latency of every link), the model on each kind of device
        (costs.HardwareModel) and the `Setting` (global batch, the peers' C, ...)
output: a `ModeResult` per mode: the time of one global batch, each device's busy share, the
        bytes on each link and the resource that binds

- **peers** (ATOM, atomc.distributed.peer): every device trains the whole model with its own
  swap plan (atomc.partition for its memory); one local step is the plan's schedule timed by
  events.simulate_swap. Local steps go on until the devices together have processed the
  global batch, as each sees it through the progress tracker, `progress_lag_s` late
  (`local_steps`: peers in step take one step more than the batch needs); the averaging round
  gathers them (hivemind waits `matchmaking_s` from the first device that is ready), and
  they average their fp32 weights in one sharded exchange over the links
  (network.exchange_jobs: the same bytes as averaging gradients).
- **gpipe**, **1f1b** (DT-FM layouts, atomc.distributed.runner): for every number of stages D_PP
  that divides the devices, `atomc place` lays D_PP stages x D_DP replicas out on the network;
  each device runs its stage's step (atomc.actions: GPipe or 1F1B over the replica's
  micro-batches) with its sends and receives on the links, then what the runner does after
  it: waits for its sends, sums tied weights' gradients between the stages holding them,
  averages the stage's gradients over its data-parallel group (the sharded exchange) and steps
  AdamW on the device. Stages are resident: the best layout whose every stage fits its device.
- **swarm** (SWARM, atomc.swarm): the model in D_PP stages, every device a server of one stage,
  assigned so the slowest stage is as fast as it gets (swarm.balance.best_assignment); a
  server's time per micro-batch is the longer of its compute (a forward call, then a backward
  call that runs the forward again; one call on the last stage) and its traffic with the
  trainer (on device `swarm_trainer`), which sends every stage its inputs and takes its
  outputs. Stochastic wiring over those servers (swarm.simulate.simulate_wiring) gives the
  pipeline's throughput; after the global batch each stage's servers average their gradients
  (the sharded exchange) and step.

Every simulated step is integer nanoseconds; a step of a layout is the third of three steps,
so that the first's filling of the links is not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from atomc.actions import Action, max_in_flight, pipeline_order
from atomc.codegen.manual import plan_from_cuts
from atomc.compare.costs import HardwareModel, block_cuts, host_memory_line
from atomc.errors import UsageError
from atomc.place import place
from atomc.place.cost import stage_ranges
from atomc.place.network import Network
from atomc.simulate.network import (
    INF,
    Links,
    StageCosts,
    exchange_jobs,
    pipeline_jobs,
    simulate_programs,
)
from atomc.swarm.balance import best_assignment
from atomc.swarm.simulate import simulate_wiring
from atomc.units import NS_PER_MS, format_bytes

MODES = ("peers", "gpipe", "1f1b", "swarm")
BOUND = 0.6  # a resource busy this share of the step or more is what binds it
LAYOUT_STEPS = 3  # simulated steps of a layout; the last one is reported


@dataclass(frozen=True)
class Machine:
    """A device as compare sees it."""

    name: str
    hardware: str  # key of its HardwareModel
    memory_bytes: int
    host_memory_bytes: int | None = None  # None: not checked


@dataclass(frozen=True)
class Setting:
    global_batch: int  # samples in one global batch, all devices together
    accum: int | None = None  # the peers' C (None: the partitioner's choice)
    sync: bool = True  # average and update after the global batch (False: ATOM Fig. 14)
    matchmaking_s: float = 2.0  # hivemind's min_matchmaking_time (atomc peer's default)
    # how late a peer sees the others' progress: the refresh period of the progress tracker
    # atomc peer runs (hivemind's ProgressTracker, default_refresh_period=0.5)
    progress_lag_s: float = 0.5
    stages: tuple[int, ...] | None = None  # D_PP to try (None: every divisor)
    place_budget_s: float = 2.0
    place_patience: int = 2000
    swarm_trainer: int = 0  # device index the SWARM trainer runs on
    seed: int = 0


@dataclass(frozen=True)
class ModeResult:
    mode: str
    feasible: bool
    reason: str = ""  # why the devices cannot hold it
    step_ns: int = 0  # one global batch
    samples: int = 0  # what that step trains: the global batch, or more (peers overshoot it)
    config: str = ""  # the configuration chosen, in words
    busy: tuple[tuple[str, float], ...] = ()  # (device, compute-busy share of the step)
    links: tuple[tuple[str, str, int, float], ...] = ()  # (from, to, bytes, busy share)
    resources: tuple[tuple[str, float], ...] = ()  # every resource's busy share, busiest first
    # the step's parts one after another (peers: local steps, then averaging), as shares
    phases: tuple[tuple[str, float], ...] = ()
    detail: dict = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.step_ns / 1e9

    def per_sample_s(self) -> float:
        return self.step_s / self.samples if self.samples else 0.0

    @property
    def binding(self) -> str:
        """The busiest resource, in words: a device's compute or copies, a link, or a link
        used one direction at a time (GPipe sends values, then gradients back), or waits."""
        if not self.resources:
            return ""
        name, share = self.resources[0]
        if share >= BOUND:
            return f"{name} ({share:.0%} busy)"
        if self.phases:
            parts = ", then ".join(f"{p} {x:.0%}" for p, x in self.phases if x >= 0.005)
            return f"{parts} of the step (the busiest: {name}, {share:.0%})"
        both: dict[tuple[str, str], list[float]] = {}
        for a, b, _, s in self.links:
            key = (a, b) if a < b else (b, a)
            both.setdefault(key, []).append(s)
        if both:
            (a, b), ways = max(both.items(), key=lambda kv: sum(kv[1]))
            pair = sum(ways)
            if BOUND <= pair <= 1.05:  # the two ways take turns: values, then gradients
                return f"link {a} <-> {b}, one way at a time ({pair:.0%} busy)"
            if pair > 1.05:  # both ways part of the time: the work in flight waits on it
                return (f"link {a} <-> {b} both ways ({' and '.join(f'{x:.0%}' for x in ways)} "
                        f"busy), the micro-batches in flight waiting on it")
        return f"waits (the busiest: {name}, {share:.0%} busy)"

    def mean_busy(self) -> float:
        return float(np.mean([b for _, b in self.busy])) if self.busy else 0.0


def links_of(network: Network) -> Links:
    bw = tuple(tuple(g * 1e9 for g in row) for row in network.bandwidth_gbps)
    lat = tuple(tuple(round(ms * NS_PER_MS) for ms in row) for row in network.delay_ms)
    return Links(bw, lat)


def _infeasible(mode: str, reason: str) -> ModeResult:
    return ModeResult(mode=mode, feasible=False, reason=reason)


def _link_rows(names, link_bytes, link_busy, span_ns, scale: float = 1.0):
    rows = [(names[a], names[b], round(nbytes * scale),
             link_busy.get((a, b), 0) * scale / span_ns if span_ns else 0.0)
            for (a, b), nbytes in link_bytes.items() if nbytes]
    return tuple(sorted(rows, key=lambda r: (-r[3], -r[2], r[0], r[1])))


def _resources(busy, links, extra=()) -> tuple[tuple[str, float], ...]:
    out = [(f"compute on {d}", s) for d, s in busy]
    out += [(f"link {a} -> {b}", s) for a, b, _, s in links]
    out += list(extra)
    return tuple(sorted(out, key=lambda r: -r[1]))


# ---------------------------------------------------------------------------------------------
# peers


def local_steps(steps_ns: list[int], samples: list[int], global_batch: int,
                lag_s: float) -> list[int]:
    """How many local steps each peer takes before it averages. After each step a peer asks
    whether the collaboration has reached the global batch: its own steps count at once, the
    others' as the progress tracker saw them `lag_s` ago, carried forward at their rates
    (hivemind's estimate of when the global batch will be reached); once it has, the peer
    stops stepping and looks for its group. Peers in step with each other so take one step
    more than the global batch needs whenever the lag is longer than nothing."""
    n = len(steps_ns)
    lag = round(lag_s * 1e9)
    done = [0] * n
    stopped: list[int | None] = [None] * n  # steps taken when the peer stopped

    def estimate(i: int, t: int) -> float:
        k = max(t - lag, 0) // steps_ns[i] + (lag / steps_ns[i] if t >= lag else 0.0)
        return min(k, stopped[i]) if stopped[i] is not None else k

    while any(x is None for x in stopped):
        d = min((i for i in range(n) if stopped[i] is None),
                key=lambda i: ((done[i] + 1) * steps_ns[i], i))
        done[d] += 1
        t = done[d] * steps_ns[d]
        total = done[d] * samples[d] + sum(estimate(i, t) * samples[i]
                                           for i in range(n) if i != d)
        if total >= global_batch - 1e-9:
            stopped[d] = done[d]
    return done


def predict_peers(machines: list[Machine], models: dict[str, HardwareModel], links: Links,
                  setting: Setting) -> ModeResult:
    names = [m.name for m in machines]
    plans = []
    for m in machines:
        hm = models[m.hardware]
        pp = hm.peer_plan(m.memory_bytes, setting.accum)
        if pp.plan is None:
            return _infeasible("peers", f"device {m.name} ({m.hardware}, "
                                        f"{format_bytes(m.memory_bytes)}): {pp.error}")
        if m.host_memory_bytes is not None and pp.host_bytes > m.host_memory_bytes:
            return _infeasible("peers", host_memory_line(m.name, pp.host_bytes,
                                                         m.host_memory_bytes))
        plans.append(pp)
    samples = [pp.plan.accum * models[m.hardware].micro_batch for m, pp in zip(machines, plans)]
    steps = [max(pp.step_ns, 1) for pp in plans]
    counts = local_steps(steps, samples, setting.global_batch,
                         setting.progress_lag_s if setting.sync else 0.0)
    ready = [c * s for c, s in zip(counts, steps)]
    group = list(range(len(machines)))
    sync = setting.sync and len(machines) > 1
    start = max(max(ready), min(ready) + round(setting.matchmaking_s * 1e9)) if sync else 0
    programs = []
    for d in group:
        jobs = [("until", ready[d])]
        if sync:
            jobs += [("until", start),
                     *exchange_jobs(d, group, models[machines[d].hardware].master_bytes,
                                    ("average", 0))]
        programs.append(jobs + [("mark", 0)])
    sim = simulate_programs(programs, links)
    span = sim.step_end(0)
    busy = tuple((names[d], counts[d] * plans[d].compute_ns / span) for d in group)
    link_rows = _link_rows(names, sim.link_bytes, sim.link_busy_ns, span)
    prefetch = [(f"host-to-device copies on {names[d]}",
                 counts[d] * plans[d].prefetch_busy_ns / span) for d in group]
    accums = sorted({pp.plan.accum for pp in plans})
    subs = sorted({len(pp.plan.submodels) for pp in plans})
    config = (f"{len(machines)} peer(s), C={'/'.join(map(str, accums))}, "
              f"{'/'.join(map(str, subs))} sub-models each, {max(counts)} local step(s)")
    phases = (("local steps", max(ready) / span),
              ("waiting for the group", (start - max(ready)) / span if sync else 0.0),
              ("averaging", (span - start) / span if sync else 0.0))
    return ModeResult(
        mode="peers", feasible=True, step_ns=span,
        samples=sum(c * x for c, x in zip(counts, samples)), config=config, busy=busy,
        links=link_rows,
        resources=_resources(busy, link_rows, prefetch), phases=phases,
        detail={"local_step_ns": {names[d]: steps[d] for d in group},
                "local_steps": {names[d]: counts[d] for d in group},
                "averaging_start_ns": start, "ready_ns": max(ready)})


# ---------------------------------------------------------------------------------------------
# layouts


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


def placement_plan(ref: HardwareModel, micro: int):
    """The units as a plan for `atomc place`: its message sizes per step (M micro-batches) and
    its compute, backward without recomputation (resident stages)."""
    return plan_from_cuts(ref.profile, block_cuts(ref.profile), accum=max(micro, 1),
                          activations="keep")


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
        return {s: _infeasible(s, why) for s in schedules}
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
            out[s] = _infeasible(s, "; ".join(reasons[s][-1:]) or "no layout")
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
        return _infeasible(sched, reason)
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
    link_rows = _link_rows(names, sim.link_bytes, sim.link_busy_ns, span, 1 / LAYOUT_STEPS)
    spans = ", ".join(f"{a}..{b - 1}" for a, b in ranges)
    config = (f"{pp} stage(s) x {dp} replica(s), {micro} micro-batches per replica"
              + (f" in {micro // flush} flushes of {flush}" if flush < micro else "")
              + f", blocks {spans}"
              + (f"; stage(s) {','.join(map(str, sorted(recomputing)))} recompute their "
                 f"blocks (the graphs do not fit)" if recomputing else ""))
    return ModeResult(mode=sched, feasible=True, step_ns=span,
                      samples=micro * dp * ref.micro_batch, config=config, busy=busy,
                      links=link_rows, resources=_resources(busy, link_rows),
                      detail={"stages": pp, "replicas": dp, "micro_batches": micro,
                              "recomputing": sorted(recomputing), "flush": flush,
                              "ranges": [list(x) for x in ranges],
                              "devices": [[names[d] for d in row] for row in matrix]})


# ---------------------------------------------------------------------------------------------
# SWARM


def predict_swarm(machines: list[Machine], models: dict[str, HardwareModel], network: Network,
                  setting: Setting) -> ModeResult:
    n = len(machines)
    names = [m.name for m in machines]
    ref = models[machines[0].hardware]
    links = links_of(network)
    trainer = setting.swarm_trainer
    if not 0 <= trainer < n:
        raise UsageError(f"--swarm-trainer {trainer}: expected a device index 0..{n - 1}")
    counts = [p for p in (setting.stages or range(2, n + 1)) if 2 <= p <= min(n, len(ref.units))]
    if not counts:
        return _infeasible("swarm", f"SWARM needs at least 2 stages on at least 2 devices and "
                                    f"as many blocks (have {n} devices, {len(ref.units)} blocks)")
    micro_total = setting.global_batch // ref.micro_batch
    if micro_total < 1 or setting.global_batch % ref.micro_batch:
        return _infeasible("swarm", f"the global batch {setting.global_batch} is not a multiple "
                                    f"of the micro-batch {ref.micro_batch}")
    best: ModeResult | None = None
    reason = ""
    for stages in counts:
        result = _swarm_with(stages, machines, models, links, ref, trainer, micro_total,
                             setting, names)
        if not result.feasible:
            reason = result.reason
        elif best is None or result.step_ns < best.step_ns:
            best = result
    return best if best is not None else _infeasible("swarm", reason)


def _server_ns(models, links: Links, m: Machine, d: int, trainer: int, ref: HardwareModel,
               rng: tuple[int, int], last: bool) -> tuple[int, int, int, int]:
    """(time per micro-batch, compute, bytes trainer -> server, bytes server -> trainer)."""
    hm = models[m.hardware]
    a, b = rng
    fwd, bwd = hm.stage_compute_ns(a, b)
    compute = fwd + bwd if last else 2 * fwd + bwd
    vin, gout = ref.boundary_bytes(a) if a > 0 else (0, 0)
    vout, gin = ref.boundary_bytes(b) if not last else (0, 0)
    down, up = vin + gin, vout + gout
    wire = max(links.wire_ns(trainer, d, down), links.wire_ns(d, trainer, up))
    return max(compute, wire, 1), compute, down, up


def _swarm_with(stages: int, machines, models, links: Links, ref: HardwareModel, trainer: int,
                micro_total: int, setting: Setting, names) -> ModeResult:
    n = len(machines)
    ranges = stage_ranges(placement_plan(ref, 1), stages)
    # the rate each device would serve at, on a stage of average cost: to assign them
    rate = []
    for d, m in enumerate(machines):
        times = [_server_ns(models, links, m, d, trainer, ref, r, j == stages - 1)[0]
                 for j, r in enumerate(ranges)]
        rate.append(1e9 / float(np.mean(times)))
    assign = best_assignment(rate, stages)
    speeds: list[list[float]] = [[] for _ in range(stages)]
    members: list[list[int]] = [[] for _ in range(stages)]
    per_server = {}
    for d, s in enumerate(assign):
        m = machines[d]
        a, b = ranges[s]
        need = models[m.hardware].stage_memory_bytes(a, b, 1)
        if need > m.memory_bytes:
            return _infeasible("swarm", (
                f"{stages} stages: stage {s} (blocks {a}..{b - 1}) needs {format_bytes(need)} "
                f"({need} bytes) on device {m.name}, which has {format_bytes(m.memory_bytes)} "
                f"({m.memory_bytes} bytes)"))
        t, compute, down, up = _server_ns(models, links, m, d, trainer, ref, ranges[s],
                                          s == stages - 1)
        speeds[s].append(1e9 / t)
        members[s].append(d)
        per_server[d] = (compute, down, up)
    if any(not s for s in speeds):
        return _infeasible("swarm", f"{stages} stages for {n} devices leave a stage without "
                                    f"a server")
    fwd_ref, bwd_ref = ref.stage_compute_ns(0, len(ref.units))
    ratio = (fwd_ref + bwd_ref) / max(fwd_ref, 1)
    lat = [links.latency_ns[trainer][d] + links.latency_ns[d][trainer]
           for d in range(n) if d != trainer]
    wiring = simulate_wiring([list(s) for s in speeds], microbatch_s=1.0,
                             backward_ratio=ratio, latency_s=float(np.mean(lat or [0])) / 1e9,
                             num_microbatches=max(2000, 40 * n), seed=setting.seed)
    pipe_ns = round(micro_total / wiring.throughput * 1e9)
    # the fill: a micro-batch's first trip through the stages, before the flow is steady
    fill_ns = sum(min(1e9 / x for x in s) for s in speeds)
    pipe_ns += round(fill_ns)
    programs = []
    for d in range(n):
        s = assign[d]
        jobs = [("until", pipe_ns)]
        if setting.sync:
            a, b = ranges[s]
            fqns = set().union(*(u.params for u in ref.units[a:b]))
            jobs += exchange_jobs(d, members[s], ref.param_bytes(fqns), ("swarm", s))
            opt = models[machines[d].hardware].optimizer_ns(fqns)
            if opt:
                jobs.append(("compute", opt, "optimizer"))
        programs.append(jobs + [("mark", 0)])
    sim = simulate_programs(programs, links)
    span = sim.step_end(0)
    served = {}
    for s in range(stages):
        for k, d in enumerate(members[s]):
            served[d] = wiring.jobs[s][k]
    busy = []
    link_bytes = dict(sim.link_bytes)
    link_busy = dict(sim.link_busy_ns)
    for d in range(n):
        # the micro-batches it served: its share of its stage's
        stage_jobs = sum(served[x] for x in members[assign[d]]) or 1
        share = served[d] / stage_jobs * micro_total
        compute, down, up = per_server[d]
        busy.append((names[d], share * compute / span))
        if d != trainer:
            for lane, nbytes in (((trainer, d), down), ((d, trainer), up)):
                link_bytes[lane] = link_bytes.get(lane, 0) + round(share * nbytes)
                link_busy[lane] = link_busy.get(lane, 0) + links.wire_ns(*lane, share * nbytes)
    busy_t = tuple(busy)
    link_rows = _link_rows(names, link_bytes, link_busy, span)
    sizes = "+".join(str(len(x)) for x in members)
    config = (f"{stages} stages, servers {sizes}, trainer on {names[trainer]}, "
              f"wiring at {wiring.efficiency:.0%} of the flow bound")
    return ModeResult(mode="swarm", feasible=True, step_ns=span,
                      samples=micro_total * ref.micro_batch, config=config, busy=busy_t,
                      links=link_rows, resources=_resources(busy_t, link_rows),
                      phases=(("the pipeline", pipe_ns / span), ("averaging", 1 - pipe_ns / span)),
                      detail={"stages": stages, "assignment": [list(map(names.__getitem__, x))
                                                               for x in members],
                              "throughput_per_s": wiring.throughput})


__all__ = ["INF", "MODES", "Machine", "ModeResult", "Setting", "links_of", "predict_layouts",
           "predict_peers", "predict_swarm"]
