"""One global batch in ATOM peers, predicted.

**peers** (ATOM, atomc.distributed.peer): every device trains the whole model with its own
swap plan (atomc.partition for its memory); one local step is the plan's schedule timed by
events.simulate_swap. Local steps go on until the devices together have processed the
global batch, as each sees it through the progress tracker, `progress_lag_s` late
(`local_steps`: peers in step take one step more than the batch needs); the averaging round
gathers them (hivemind waits `matchmaking_s` from the first device that is ready), and
they average their fp32 weights in one sharded exchange over the links
(network.exchange_jobs: the same bytes as averaging gradients).
"""

from __future__ import annotations

from atomc.compare.costs import HardwareModel, host_memory_line
from atomc.compare.modes import Machine, ModeResult, Setting, infeasible, link_rows, resources_of
from atomc.simulate.network import Links, exchange_jobs, simulate_programs
from atomc.units import format_bytes


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
            return infeasible("peers", f"device {m.name} ({m.hardware}, "
                                        f"{format_bytes(m.memory_bytes)}): {pp.error}")
        if m.host_memory_bytes is not None and pp.host_bytes > m.host_memory_bytes:
            return infeasible("peers", host_memory_line(m.name, pp.host_bytes,
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
    rows = link_rows(names, sim.link_bytes, sim.link_busy_ns, span)
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
        links=rows,
        resources=resources_of(busy, rows, prefetch), phases=phases,
        detail={"local_step_ns": {names[d]: steps[d] for d in group},
                "local_steps": {names[d]: counts[d] for d in group},
                "averaging_start_ns": start, "ready_ns": max(ready)})


__all__ = ["local_steps", "predict_peers"]
