"""One global batch in SWARM, predicted.

**swarm** (SWARM, atomc.swarm): the model in D_PP stages, every device a server of one stage.
A server's time per micro-batch is the longer of its compute and its traffic with the trainer
(on device `swarm_trainer`), each direction of the link on its own. What the trainer's calls
carry (atomc.swarm.client): every call the micro-batch's inputs (the model's, as the data
gives them); a stage before the last gets a forward call (its input values in, its output
values back), then a backward call that runs the forward again (its input values and its
output gradients in, its input gradients back); the last stage one backward call (its input
values in, its input gradients back).

The servers are assigned as atomc's servers rebalance to (atomc.swarm.rebalance): where the
assignments number `EXACT_ASSIGNMENTS` or fewer, the one whose slowest stage is fastest, each
server at its own rate on each stage (a stage before the last costs a forward more than the
last; a server on the trainer's device sends nothing over a link); beyond that, the servers
fastest first, each onto the slowest stage it can hold (at its rate there), then Algorithm 2's
moves (balance.choose_move) while one raises the slowest stages. A device that cannot hold a
stage is not put on it; a stage no device can hold makes SWARM infeasible.

Stochastic wiring over those servers (swarm.simulate.simulate_wiring) gives the pipeline's
throughput, plus the fill (a micro-batch's first trip through the stages). Then each stage
commits as atomc's servers do (atomc.swarm.commit): its servers form a group (hivemind's
matchmaking, `swarm_matchmaking_s`: `atomc swarm serve`'s default), every server fetches every
other server's whole gradient sums (and buffers) and adds them in one order, and each steps.
The model sends each server's sums to the others at once; the servers fetch them one peer
after another, which takes longer than this with three or more servers on a stage whose
incoming links are not shared (`commit_jobs`).
"""

from __future__ import annotations

import itertools

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
from atomc.simulate.network import Job, Links, simulate_programs
from atomc.swarm.balance import ServerLoad, choose_move
from atomc.swarm.simulate import simulate_wiring
from atomc.units import format_bytes

# every assignment of servers to stages is tried up to this many (balance.plan_moves's bound)
EXACT_ASSIGNMENTS = 4096


def commit_jobs(me: int, group: list[int], num_bytes: int, key: object) -> list[Job]:
    """`me`'s part in a stage's commit: its `num_bytes` of sums to every other server of the
    stage, and every other server's sums in."""
    others = [g for g in group if g != me]
    return ([("send", o, num_bytes, (key, me, o)) for o in others]
            + [("recv", o, (key, o, me)) for o in others])


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
    plan = placement_plan(ref, 1)
    for stages in counts:
        result = _swarm_with(stage_ranges(plan, stages), machines, models, links, ref, trainer,
                             micro_total, setting, names)
        if not result.feasible:
            reason = result.reason
        elif best is None or result.step_ns < best.step_ns:
            best = result
    return best if best is not None else infeasible("swarm", reason)


def input_bytes(ref: HardwareModel) -> int:
    """Bytes of one micro-batch's model inputs: every call to a server carries them."""
    return sum(t.num_bytes for n in ref.profile.graph.nodes if n.op == "placeholder"
               for t in n.outputs)


def server_traffic(ref: HardwareModel, rng: tuple[int, int], last: bool) -> tuple[int, int]:
    """(bytes trainer -> server, bytes server -> trainer) of one micro-batch on the stage of
    units [a, b): see the module docstring for what each call carries."""
    a, b = rng
    batch = input_bytes(ref)
    vin, gout = ref.boundary_bytes(a) if a > 0 else (0, 0)
    if last:
        return vin + batch, gout
    vout, gin = ref.boundary_bytes(b)
    return (vin + batch) + (vin + gin + batch), vout + gout


def _server_ns(models, links: Links, m: Machine, d: int, trainer: int, ref: HardwareModel,
               rng: tuple[int, int], last: bool) -> tuple[int, int, int, int]:
    """(time per micro-batch, compute, bytes trainer -> server, bytes server -> trainer)."""
    hm = models[m.hardware]
    fwd, bwd = hm.stage_compute_ns(*rng)
    compute = fwd + bwd if last else 2 * fwd + bwd
    down, up = server_traffic(ref, rng, last)
    wire = max(links.wire_ns(trainer, d, down), links.wire_ns(d, trainer, up))
    return max(compute, wire, 1), compute, down, up


def assign_servers(rates: np.ndarray) -> list[int]:
    """Servers -> stages, the slowest stage as fast as it gets; `rates[d][s]`: server d's
    micro-batches/s on stage s, 0 where it cannot serve it (see the module docstring)."""
    n, stages = rates.shape
    if stages ** n <= EXACT_ASSIGNMENTS:
        grid = np.array(list(itertools.product(range(stages), repeat=n)), dtype=np.int64)
        gains = rates[np.arange(n), grid]
        sums = np.stack([(gains * (grid == s)).sum(axis=1) for s in range(stages)], axis=1)
        return [int(s) for s in grid[int(np.argmax(sums.min(axis=1)))]]
    assign = [0] * n
    sums = np.zeros(stages)
    for d in sorted(range(n), key=lambda i: (-float(rates[i].max()), i)):
        can = np.flatnonzero(rates[d] > 0)
        can = can if len(can) else np.arange(stages)  # it holds none: the check after says so
        s = int(can[np.argmin(sums[can])])
        assign[d] = s
        sums[s] += rates[d][s]
    for _ in range(n * stages):  # each move raises the sorted stage rates: few are possible
        loads = [ServerLoad(str(d), assign[d], float(rates[d][assign[d]]), 0.0,
                            served=tuple(float(x) for x in rates[d])) for d in range(n)]
        move = choose_move(loads, stages)
        if move is None or rates[int(move.peer)][move.to_stage] <= 0:
            break
        assign[int(move.peer)] = move.to_stage
    return assign


def _swarm_with(ranges: tuple[tuple[int, int], ...], machines, models, links: Links,
                ref: HardwareModel, trainer: int, micro_total: int, setting: Setting,
                names) -> ModeResult:
    n = len(machines)
    stages = len(ranges)
    placed = _servers(ranges, machines, models, links, ref, trainer)
    if isinstance(placed, ModeResult):
        return placed
    table, rates, assign, members = placed
    speeds = [[float(rates[d][s]) for d in members[s]] for s in range(stages)]
    fwd_ref, bwd_ref = ref.stage_compute_ns(0, len(ref.units))
    ratio = (fwd_ref + bwd_ref) / max(fwd_ref, 1)
    lat = [links.latency_ns[trainer][d] + links.latency_ns[d][trainer]
           for d in range(n) if d != trainer]
    wiring = simulate_wiring(speeds, microbatch_s=1.0, backward_ratio=ratio,
                             latency_s=float(np.mean(lat or [0])) / 1e9,
                             num_microbatches=max(2000, 40 * n), seed=setting.seed)
    pipe_ns = round(micro_total / wiring.throughput * 1e9)
    # the fill: a micro-batch's first trip through the stages, before the flow is steady
    fill_ns = sum(min(1e9 / x for x in s) for s in speeds)
    pipe_ns += round(fill_ns)
    sim = simulate_programs(_step_programs(ranges, machines, models, ref, setting, assign,
                                           members, pipe_ns), links)
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
        _, compute, down, up = table[d][assign[d]]
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
                      detail={"stages": stages, "ranges": [list(r) for r in ranges],
                              "assignment": [list(map(names.__getitem__, x)) for x in members],
                              "server_ns": {names[d]: table[d][assign[d]][0] for d in range(n)},
                              "throughput_per_s": float(wiring.throughput),
                              "efficiency": float(wiring.efficiency),
                              "pipeline_ns": pipe_ns})


def _servers(ranges: tuple[tuple[int, int], ...], machines, models, links: Links,
             ref: HardwareModel, trainer: int):
    """(each device's server times per stage, its rates where the stage fits it, the stage
    each device serves, each stage's servers); or why a stage has no server that holds it."""
    n = len(machines)
    stages = len(ranges)
    need = [[models[m.hardware].stage_memory_bytes(a, b, 1) for a, b in ranges]
            for m in machines]
    table = [[_server_ns(models, links, m, d, trainer, ref, r, j == stages - 1)
              for j, r in enumerate(ranges)] for d, m in enumerate(machines)]
    rates = np.array([[1e9 / table[d][s][0] if need[d][s] <= machines[d].memory_bytes else 0.0
                       for s in range(stages)] for d in range(n)])

    def short(d: int, s: int) -> ModeResult:
        m = machines[d]
        a, b = ranges[s]
        return infeasible("swarm", (
            f"{stages} stages: stage {s} (blocks {a}..{b - 1}) needs "
            f"{format_bytes(need[d][s])} ({need[d][s]} bytes) on device {m.name}, which has "
            f"{format_bytes(m.memory_bytes)} ({m.memory_bytes} bytes)"))

    for s in range(stages):
        if not np.any(rates[:, s] > 0):  # no device holds it: name the one that comes closest
            return short(max(range(n), key=lambda i: (machines[i].memory_bytes - need[i][s], -i)),
                         s)
    assign = assign_servers(rates)
    members: list[list[int]] = [[d for d in range(n) if assign[d] == s] for s in range(stages)]
    if any(not x for x in members):
        return infeasible("swarm", f"{stages} stages for {n} devices leave a stage without "
                                    f"a server")
    for d, s in enumerate(assign):
        if rates[d][s] <= 0:  # Algorithm 2 had nowhere else for it
            return short(d, s)
    return table, rates, assign, members


def _step_programs(ranges, machines, models, ref: HardwareModel, setting: Setting, assign,
                   members, pipe_ns: int) -> list[list[Job]]:
    """Every device's step after the pipeline: with sync, its stage's commit among the
    stage's servers (after matchmaking) and its optimizer step."""
    programs = []
    commit_ns = pipe_ns + round(setting.swarm_matchmaking_s * 1e9)
    for d in range(len(machines)):
        s = assign[d]
        jobs: list[Job] = [("until", pipe_ns)]
        if setting.sync:
            a, b = ranges[s]
            fqns = set().union(*(u.params for u in ref.units[a:b]))
            if len(members[s]) > 1:
                jobs += [("until", commit_ns),
                         *commit_jobs(d, members[s], ref.param_bytes(fqns), ("swarm", s))]
            opt = models[machines[d].hardware].optimizer_ns(fqns)
            if opt:
                jobs.append(("compute", opt, "optimizer"))
        programs.append(jobs + [("mark", 0)])
    return programs


__all__ = ["EXACT_ASSIGNMENTS", "assign_servers", "input_bytes", "predict_swarm",
           "server_traffic"]
