"""One global batch in SWARM, predicted.

**swarm** (SWARM, atomc.swarm): the model in D_PP stages, every device a server of one stage,
assigned so the slowest stage is as fast as it gets (swarm.balance.best_assignment); a
server's time per micro-batch is the longer of its compute (a forward call, then a backward
call that runs the forward again; one call on the last stage) and its traffic with the
trainer (on device `swarm_trainer`), which sends every stage its inputs and takes its
outputs. Stochastic wiring over those servers (swarm.simulate.simulate_wiring) gives the
pipeline's throughput; after the global batch each stage's servers average their gradients
(the sharded exchange) and step.
"""

from __future__ import annotations

import numpy as np

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
from atomc.errors import UsageError
from atomc.place.cost import stage_ranges
from atomc.place.network import Network
from atomc.simulate.network import Links, exchange_jobs, simulate_programs
from atomc.swarm.balance import best_assignment
from atomc.swarm.simulate import simulate_wiring
from atomc.units import format_bytes


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
        return infeasible("swarm", f"SWARM needs at least 2 stages on at least 2 devices and "
                                    f"as many blocks (have {n} devices, {len(ref.units)} blocks)")
    micro_total = setting.global_batch // ref.micro_batch
    if micro_total < 1 or setting.global_batch % ref.micro_batch:
        return infeasible("swarm", f"the global batch {setting.global_batch} is not a multiple "
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
    return best if best is not None else infeasible("swarm", reason)


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
            return infeasible("swarm", (
                f"{stages} stages: stage {s} (blocks {a}..{b - 1}) needs {format_bytes(need)} "
                f"({need} bytes) on device {m.name}, which has {format_bytes(m.memory_bytes)} "
                f"({m.memory_bytes} bytes)"))
        t, compute, down, up = _server_ns(models, links, m, d, trainer, ref, ranges[s],
                                          s == stages - 1)
        speeds[s].append(1e9 / t)
        members[s].append(d)
        per_server[d] = (compute, down, up)
    if any(not s for s in speeds):
        return infeasible("swarm", f"{stages} stages for {n} devices leave a stage without "
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
    rows = link_rows(names, link_bytes, link_busy, span)
    sizes = "+".join(str(len(x)) for x in members)
    config = (f"{stages} stages, servers {sizes}, trainer on {names[trainer]}, "
              f"wiring at {wiring.efficiency:.0%} of the flow bound")
    return ModeResult(mode="swarm", feasible=True, step_ns=span,
                      samples=micro_total * ref.micro_batch, config=config, busy=busy_t,
                      links=rows, resources=resources_of(busy_t, rows),
                      phases=(("the pipeline", pipe_ns / span), ("averaging", 1 - pipe_ns / span)),
                      detail={"stages": stages, "assignment": [list(map(names.__getitem__, x))
                                                               for x in members],
                              "throughput_per_s": wiring.throughput})


__all__ = ["predict_swarm"]
