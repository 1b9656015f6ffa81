"""One outer round of DiLoCo peers, predicted.

**diloco** (atomc.distributed.diloco: `atomc peer --outer nesterov`, `--inner-steps H`,
`--round-dtype`, `--fragments K`): every device trains the whole model with its own swap plan,
as ATOM's peers (atomc.compare.peers), and every H/K local steps (or, without --inner-steps,
each global batch, as the peers' progress tracker sees it: peers.local_steps) a round averages
one fragment's pseudo-gradient:

- **the wait for one another** (with --inner-steps): a peer that has taken its steps waits
  until the progress tracker shows every peer's, `progress_lag_s` after each peer's last step;
  then each asks hivemind for a group, and the group forms when the first caller's
  `matchmaking_s` has passed (or the last caller comes);
- **the round** is hivemind's butterfly all-reduce of the round's tensor, timed as the peers'
  rounds are (peers.averaging_programs over hivemind's group orders), with the tensor the
  peer averages: the largest fragment's values (smaller fragments padded, as the runtime
  does), cut into hivemind's parts at the round dtype's compressed size, each part on the wire
  at the codec's bytes (atomc.distributed.rounds);
- **one fragment** (K = 1): the peers wait for the round, then take their next H local steps;
  **K fragments**: the round runs beside the next H/K local steps and is waited for at the
  next boundary, before that boundary's round starts.

The prediction is the steady state of a full pass over the fragments: the time from one
boundary to the boundary K later (H local steps each; `cycle_ns` in the detail), simulated
boundary by boundary from a cold start for CYCLES passes, the last one taken. Like every mode
it is stated per global batch: the pass's time and traffic scaled by the global batch over the
samples of the pass. Besides the step, the bytes on each link and what binds,
it gives what decentralized runs report: the compute utilization (each device's local steps'
time over the wall time, the mean over the devices), the communication share (the wall time
the slowest device is not stepping), and the bytes sent per token against plain data
parallelism's (every local step all-reducing the fp32 gradients, hivemind's butterfly).
"""

from __future__ import annotations

from dataclasses import dataclass

from atomc.compare.costs import HardwareModel
from atomc.compare.modes import Machine, ModeResult, Setting, infeasible, link_rows, resources_of
from atomc.compare.peers import (
    averaging_programs,
    dp_bytes_per_token,
    group_orders,
    local_steps,
    peer_plans,
    tokens_per_sample,
)
from atomc.distributed.outer import fragments_of
from atomc.distributed.rounds import (
    DTYPE_BYTES,
    split_parts,
    tensor_dtype,
    values_per_part,
    wire_bytes,
)
from atomc.errors import UsageError
from atomc.partition.hostmem import plan_weights
from atomc.simulate.network import Links, simulate_programs

CYCLES = 3  # passes over the fragments simulated; the last one is the steady state


def round_shares(values: int, group: int, round_dtype: str | None, value_bytes: int,
                 part_bytes: int) -> list[list[int]]:
    """Wire bytes of the parts each place of the group order reduces in one round."""
    per_part = values_per_part(values, round_dtype, value_bytes, part_bytes)
    places = split_parts([(values, per_part)], group)
    return [[wire_bytes(n, round_dtype, value_bytes) for _, n in place] for place in places]


def predict_diloco(machines: list[Machine], models: dict[str, HardwareModel], links: Links,
                   setting: Setting) -> ModeResult:
    plans = peer_plans("diloco", machines, models, setting)
    if isinstance(plans, ModeResult):
        return plans
    if not setting.sync:
        return infeasible("diloco", "no rounds without averaging (--no-sync): compare peers")
    n = len(machines)
    ref_model = models[machines[0].hardware]
    sizes = [w.owned for w in plan_weights(ref_model.profile.graph, plans[0].plan.submodels,
                                           ref_model.profile.graph.dtype)]
    k = setting.fragments
    if k > len(sizes):
        raise UsageError(f"--fragments {k} is more than the {len(sizes)} sub-models of "
                         f"{machines[0].name}'s plan; a fragment is one or more whole sub-models: "
                         f"give at most {len(sizes)}")
    fragments = fragments_of(sizes, k)
    width = max(sum(sizes[i] for i in fr) for fr in fragments)
    master = "float64" if ref_model.master_value_bytes == 8 else "float32"
    value_bytes = DTYPE_BYTES[tensor_dtype(setting.round_dtype, master)]
    shares = round_shares(width, n, setting.round_dtype, value_bytes,
                          setting.averaging_part_bytes)
    samples = [pp.plan.accum * models[m.hardware].micro_batch for m, pp in zip(machines, plans)]
    steps = [max(pp.step_ns, 1) for pp in plans]
    if setting.inner_steps is not None:
        counts = [setting.inner_steps // k] * n
    else:
        counts = local_steps(steps, samples, setting.global_batch, setting.progress_lag_s)
    cyc = _cycles(links, setting, shares, steps, counts)
    facts = _Facts(sizes=sizes, fragments=fragments, width=width, master=master,
                   samples=samples, steps=steps, counts=counts)
    return _result(machines, models, plans, setting, facts, cyc)


@dataclass(frozen=True)
class _Facts:
    """What the rounds are made of: the plan's sub-models' sizes and their fragments, the
    widest fragment, the master dtype, and each peer's samples, step and local steps."""

    sizes: list[int]
    fragments: list
    width: int
    master: str
    samples: list[int]
    steps: list[int]
    counts: list[int]


@dataclass(frozen=True)
class _Cycle:
    """The steady pass over the fragments: its length, the last boundary's (slowest ready,
    start, end), and its rounds' traffic by link."""

    cycle: int
    last: tuple[int, int, int]
    link_bytes: dict
    link_busy: dict


def _round_from(leader: int, orders, group: list[int], shares, setting: Setting,
                links: Links) -> tuple[int, dict, dict]:
    """One round from its start, led by `leader`: the mean over hivemind's group orders."""
    ends, link_bytes, link_busy = [], {}, {}
    for order in orders:
        jobs = averaging_programs(order, leader, 0, shares, setting.stream_window_bytes)
        sim = simulate_programs([[*jobs.get(d, []), ("mark", 0)] for d in group], links)
        ends.append(sim.step_end(0))
        for lane, nbytes in sim.link_bytes.items():
            link_bytes[lane] = link_bytes.get(lane, 0) + nbytes / len(orders)
            link_busy[lane] = link_busy.get(lane, 0) + sim.link_busy_ns[lane] / len(orders)
    return round(sum(ends) / len(ends)), link_bytes, link_busy


def _cycles(links: Links, setting: Setting, shares, steps: list[int],
            counts: list[int]) -> _Cycle:
    """The boundaries one after another, CYCLES passes over the fragments: when each device
    is ready, waits, calls, resumes; the last pass is the steady state."""
    n = len(steps)
    group = list(range(n))
    k = setting.fragments
    lag = round(setting.progress_lag_s * 1e9)
    mm = round(setting.matchmaking_s * 1e9)
    # every order for <= 4 peers
    orders = group_orders(group, setting.seed)
    resume = [0] * n  # when each device takes its next local step
    done = 0  # when the round in flight ends (K > 1); the last round's end (K = 1)
    calls_at: list[list[int]] = []
    waits: list[tuple[int, int, int]] = []  # per boundary: (slowest ready, start, end)
    cache: dict[int, tuple[int, dict, dict]] = {}
    bytes_cycle: dict = {}
    busy_cycle: dict = {}
    for b in range(CYCLES * k):
        ready = [resume[d] + counts[d] * steps[d] for d in group]
        held = [max(ready[d], done) if k > 1 else ready[d] for d in group]
        if setting.inner_steps is not None:
            calls = [max(held[d], max((ready[o] + lag for o in group if o != d), default=0))
                     for d in group]
        else:  # the global batch rule: the tracker's lag is in local_steps' counts
            calls = held
        leader = min(group, key=lambda d: (calls[d], d))
        start = max(calls[leader] + mm, max(calls)) if n > 1 else max(calls)
        if leader not in cache:
            cache[leader] = (_round_from(leader, orders, group, shares, setting, links)
                             if n > 1 else (0, {}, {}))
        length, lb, lbusy = cache[leader]
        end = start + length
        calls_at.append(calls)
        waits.append((max(ready), start, end))
        if b >= (CYCLES - 1) * k:  # the last pass: its rounds' traffic
            for lane, v in lb.items():
                bytes_cycle[lane] = bytes_cycle.get(lane, 0) + v
                busy_cycle[lane] = busy_cycle.get(lane, 0) + lbusy[lane]
        if k > 1:
            resume = calls
            done = end
        else:
            resume = [end] * n
    first, last = (CYCLES - 1) * k - 1, CYCLES * k - 1
    if k > 1:
        cycle = max(calls_at[last]) - max(calls_at[first])
    else:
        cycle = waits[last][2] - waits[first][2]
    return _Cycle(max(cycle, 1), waits[last], bytes_cycle, busy_cycle)


def _result(machines: list[Machine], models: dict[str, HardwareModel], plans,
            setting: Setting, f: _Facts, cyc: _Cycle) -> ModeResult:
    """The steady pass as one global batch at DiLoCo's rate: busy shares, links, phases."""
    names = [m.name for m in machines]
    n = len(machines)
    group = list(range(n))
    k = setting.fragments
    counts, steps, samples, cycle = f.counts, f.steps, f.samples, cyc.cycle
    bytes_cycle, busy_cycle = cyc.link_bytes, cyc.link_busy
    stepping = [k * counts[d] * steps[d] for d in group]
    busy = tuple((names[d], k * counts[d] * plans[d].compute_ns / cycle) for d in group)
    # per global batch at DiLoCo's rate, as every mode is compared (a pass over the fragments
    # trains `samples_cycle`, more or fewer than the global batch)
    samples_cycle = k * sum(c * x for c, x in zip(counts, samples))
    scale = setting.global_batch / samples_cycle
    rows = link_rows(names, bytes_cycle, busy_cycle, round(cycle * scale), scale)
    prefetch = [(f"host-to-device copies on {names[d]}",
                 k * counts[d] * plans[d].prefetch_busy_ns / cycle) for d in group]
    slowest = max(stepping)
    ready_last, start_last, end_last = cyc.last
    if k == 1:
        phases = (("local steps", slowest / cycle),
                  ("waiting for one another", (start_last - ready_last) / cycle),
                  ("averaging", (end_last - start_last) / cycle))
    else:
        phases = (("local steps", slowest / cycle),
                  ("waiting at the boundaries", (cycle - slowest) / cycle))
    tokens = tokens_per_sample(models[machines[0].hardware])
    sent = sum(v for v in bytes_cycle.values())
    per_token = sent / (samples_cycle * tokens) if samples_cycle else 0.0
    dp = dp_bytes_per_token(machines, models, samples)
    accums = sorted({pp.plan.accum for pp in plans})
    rule = (f"H={setting.inner_steps}" if setting.inner_steps is not None
            else f"{max(counts)} local step(s) a global batch")
    config = (f"{n} peer(s), C={'/'.join(map(str, accums))}, {rule}, "
              f"{setting.round_dtype or f.master} rounds of {k} fragment(s) of {len(f.sizes)} "
              f"sub-models" + (", each beside the next local steps" if k > 1 else "")
              + f"; every fragment averaged once in {cycle / 1e9:.3f} s ({samples_cycle} "
              f"samples)")
    return ModeResult(
        mode="diloco", feasible=True, step_ns=round(cycle * scale),
        samples=setting.global_batch, config=config,
        busy=busy, links=rows, resources=resources_of(busy, rows, prefetch), phases=phases,
        detail={"cycle_ns": cycle, "cycle_samples": samples_cycle,
                "local_step_ns": {names[d]: steps[d] for d in group},
                "local_steps": {names[d]: k * counts[d] for d in group},
                "fragments": f.fragments, "round_values": f.width,
                "round_bytes_per_peer": {names[d]: sum(v for (a, _), v in bytes_cycle.items()
                                                       if a == d) / k for d in group},
                "round_ns": end_last - start_last,
                "host_bytes": {names[d]: plans[d].host_bytes for d in group},
                "utilization": sum(stepping) / n / cycle,
                "communication_share": (cycle - slowest) / cycle,
                "tokens_per_sample": tokens, "bytes_per_token": per_token,
                "dp_bytes_per_token": dp,
                "vs_dp": per_token / dp if dp else 0.0})


__all__ = ["predict_diloco", "round_shares"]
