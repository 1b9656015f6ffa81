"""One global batch in ATOM peers, predicted.

**peers** (ATOM, atomc.distributed.peer): every device trains the whole model with its own
swap plan (atomc.partition for its memory); one local step is the plan's schedule timed by
events.simulate_swap. Local steps go on until the devices together have processed the
global batch, as each sees it through the progress tracker, `progress_lag_s` late
(`local_steps`: peers in step take one step more than the batch needs). Then one averaging
round, as hivemind's DecentralizedAverager runs it with atomc peer's settings:

- **group**: the first device that is ready leads; hivemind assembles the group when the
  leader's `matchmaking_s` (min_matchmaking_time) has passed, with every device ready by
  then (the model waits for the last one when it is later);
- **start**: each member finishes its matchmaking's DHT messages (withdrawing its entry,
  updating the group key) before it sends a part; those messages travel the peers' libp2p
  connections behind the part data already on them, so the first member to start holds the
  others back. The model lets the leader start as the group forms and every other member
  when the leader's first `stream_window_bytes` to it (one flow-control window of a libp2p
  stream, yamux's 256 KiB) have crossed the link (`averaging_programs`);
- **butterfly all-reduce** (hivemind's AllReduceRunner) of the fp32 weights, one vector: the
  vector is cut into parts of `averaging_part_bytes` and each member of the group, in an
  order hivemind shuffles every round, reduces whole parts (`share_parts`: shares differ by
  up to a part); every member streams each other member that member's parts, a reducer
  sends each averaged part back to every sender once all senders' copies of it are in, and a
  member is done when every averaged part has come back. Every part is a message on the
  links (simulate_programs); the round is the mean over hivemind's group orders (all of
  them for up to four peers, `ORDERS` seeded ones beyond).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

from atomc.compare.costs import HardwareModel, PeerPlan, host_memory_line
from atomc.compare.modes import Machine, ModeResult, Setting, infeasible, link_rows, resources_of
from atomc.distributed.outer import OuterConfig, fragments_of, peer_host_bytes
from atomc.distributed.rounds import DTYPE_BYTES, split_parts
from atomc.ir import Plan
from atomc.partition.hostmem import MOMENTS_PER_WEIGHT, moment_bytes, plan_weights
from atomc.simulate.network import Job, Links, simulate_programs
from atomc.units import format_bytes

ORDERS = 24  # group orders a round is averaged over (every order for up to 4 peers)
# messages per share at most: beyond, neighbouring parts travel as one message (a large
# vector's parts stream; the simulated round then differs from part-by-part by a message's time)
MAX_MESSAGES_PER_SHARE = 16


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


def share_parts(num_values: int, group_size: int, value_bytes: int,
                part_bytes: int) -> list[list[int]]:
    """Bytes of the parts each place of the group order reduces, as hivemind splits one vector
    of `num_values` (its TensorPartContainer, uncompressed, with load_balance_peers for peers
    that state no bandwidth): parts of `part_bytes`, the last one shorter, each given whole to
    the place whose even share (hagenbach_bishoff's) it overlaps most
    (atomc.distributed.rounds.split_parts)."""
    places = split_parts([(num_values, int(part_bytes / value_bytes))], group_size)
    return [[n * value_bytes for _, n in place] for place in places]


def _messages(parts: list[int]) -> list[int]:
    """A share's parts as messages: every part, or neighbouring parts together beyond
    MAX_MESSAGES_PER_SHARE."""
    if len(parts) <= MAX_MESSAGES_PER_SHARE:
        return list(parts)
    cuts = [round(i * len(parts) / MAX_MESSAGES_PER_SHARE)
            for i in range(MAX_MESSAGES_PER_SHARE + 1)]
    return [sum(parts[a:b]) for a, b in itertools.pairwise(cuts)]


def averaging_programs(order: list[int], leader: int, start_ns: int,
                       shares: list[list[int]], window_bytes: int) -> dict[int, list[Job]]:
    """Each member's jobs in one round (see the module docstring): `order` the devices in
    hivemind's group order (place i reduces `shares[i]`, bytes by part), `leader` the device
    that starts at `start_ns`; the others start when the leader's first `window_bytes` to them
    have arrived."""
    msgs = {d: _messages(shares[i]) for i, d in enumerate(order)}
    jobs: dict[int, list[Job]] = {}
    for d in order:
        others = [o for o in order if o != d]
        mine: list[Job] = [("until", start_ns)]
        if d != leader:
            mine.append(("recv", leader, ("go", d)))
        for r in others:  # my copy of every other member's parts, in order
            told = d != leader  # the leader's `go` to r follows its first window to r
            left = window_bytes
            for k, nbytes in enumerate(msgs[r]):
                if not told and nbytes > left:
                    if left:
                        mine.append(("send", r, left, ("head", d, r)))
                    mine.append(("send", r, 0, ("go", r)))
                    told, nbytes = True, nbytes - left
                elif not told:
                    left -= nbytes
                mine.append(("send", r, nbytes, ("in", d, r, k)))
            if not told:
                mine.append(("send", r, 0, ("go", r)))
        for k, nbytes in enumerate(msgs[d]):  # my parts: averaged once every copy is in
            mine += [("recv", s, ("in", s, d, k)) for s in others]
            mine += [("send", s, nbytes, ("out", d, s, k)) for s in others]
        mine += [("recv", r, ("out", r, d, k)) for r in others for k in range(len(msgs[r]))]
        jobs[d] = mine
    return jobs


def group_orders(group: list[int], seed: int) -> list[list[int]]:
    """The group orders a round is averaged over: every one for up to four members (hivemind
    shuffles the order uniformly), else ORDERS drawn with `seed`."""
    if math.factorial(len(group)) <= ORDERS:
        return [list(p) for p in itertools.permutations(group)]
    rng = random.Random(seed)
    return [rng.sample(group, len(group)) for _ in range(ORDERS)]


def peer_side_bytes(model: HardwareModel, plan: Plan, cfg: OuterConfig) -> dict[str, int]:
    """Host bytes a peer with `plan` and outer options `cfg` keeps beside its swap trainer, by
    kind: atomc.distributed.outer.peer_host_bytes (what `atomc peer` checks at start), its
    sizes read from the plan instead of a running trainer. The buffers counted are every
    buffer the sub-models read (the graph does not mark which ones a state dict keeps)."""
    graph = model.profile.graph
    master = "float64" if model.master_value_bytes == 8 else "float32"
    weights = plan_weights(graph, plan.submodels, graph.dtype)
    sizes = [w.owned for w in weights]
    seen: set[str] = set()
    buffers = [0] * len(sizes)  # a buffer counts in the first sub-model that reads it
    for s in plan.submodels:
        for node in graph.nodes[s.start:s.stop]:
            for fqn in node.buffer_fqns:
                if fqn in graph.buffers and fqn not in seen:
                    seen.add(fqn)
                    buffers[s.index] += math.prod(graph.buffers[fqn].shape)
    # more fragments than sub-models: predict_diloco refuses it in one line, after this
    fragments = fragments_of(sizes, min(cfg.fragments, len(sizes)))
    width = max(sum(sizes[i] for i in fr) for fr in fragments)
    buffer_width = max(sum(buffers[i] for i in fr) for fr in fragments)
    host = plan.host
    states = host.optimizer_states if host is not None else "float32"
    trainable = sum(w.trainable for w in weights)
    state = (sum(sizes) * DTYPE_BYTES[master]
             + MOMENTS_PER_WEIGHT * trainable * moment_bytes(states, master))
    on_disk = host is not None and any("masters" in kinds for kinds in host.disk_kinds)
    return peer_host_bytes(sum(sizes), width, buffer_width, master, state, cfg,
                           outer_on_disk=on_disk)


def peer_plans(mode: str, machines: list[Machine], models: dict[str, HardwareModel],
               setting: Setting) -> list[PeerPlan] | ModeResult:
    """Each device's swap plan and simulated local step, or why `mode` does not fit: its
    host bytes are the trainer's and what the peer keeps beside it (`peer_side_bytes`)."""
    plans = []
    cfg = setting.outer(mode)
    for m in machines:
        hm = models[m.hardware]
        pp = hm.peer_plan(m.memory_bytes, setting.accum)
        if pp.plan is None:
            return infeasible(mode, f"device {m.name} ({m.hardware}, "
                                    f"{format_bytes(m.memory_bytes)}): {pp.error}")
        side = peer_side_bytes(hm, pp.plan, cfg)
        pp = dataclasses.replace(pp, host_bytes=pp.host_bytes + sum(side.values()))
        if m.host_memory_bytes is not None and pp.host_bytes > m.host_memory_bytes:
            return infeasible(mode, host_memory_line(m.name, pp.host_bytes,
                                                     m.host_memory_bytes, side))
        plans.append(pp)
    return plans


def tokens_per_sample(model: HardwareModel) -> int:
    """Tokens in one sample: the sequence length of the model's first integer input of shape
    [batch, sequence] (a language model's ids); 1 for other models (bytes per sample)."""
    for node in model.profile.graph.nodes:
        if node.op != "placeholder" or not node.outputs:
            continue
        spec = node.outputs[0]
        if len(spec.shape) == 2 and spec.dtype.startswith(("int", "uint")):
            return int(spec.shape[1])
    return 1


def dp_bytes_per_token(machines: list[Machine], models: dict[str, HardwareModel],
                       samples_per_step: list[int]) -> float:
    """Plain data parallelism over the same devices: every local step all-reduces the fp32
    gradients of the trainable weights in a butterfly (each device sends the others their
    shares, then its averaged share back: 2 (n - 1) / n of the gradients); bytes sent by all
    devices over the tokens of one step of all of them."""
    n = len(machines)
    if n < 2:
        return 0.0
    ref = models[machines[0].hardware]
    grads = ref.master_bytes // ref.master_value_bytes * 4
    sent = n * 2 * (n - 1) / n * grads
    return sent / (sum(samples_per_step) * tokens_per_sample(ref))


def predict_peers(machines: list[Machine], models: dict[str, HardwareModel], links: Links,
                  setting: Setting) -> ModeResult:
    names = [m.name for m in machines]
    plans = peer_plans("peers", machines, models, setting)
    if isinstance(plans, ModeResult):
        return plans
    samples = [pp.plan.accum * models[m.hardware].micro_batch for m, pp in zip(machines, plans)]
    steps = [max(pp.step_ns, 1) for pp in plans]
    counts = local_steps(steps, samples, setting.global_batch,
                         setting.progress_lag_s if setting.sync else 0.0)
    ready = [c * s for c, s in zip(counts, steps)]
    group = list(range(len(machines)))
    sync = setting.sync and len(machines) > 1
    leader = min(group, key=lambda d: (ready[d], d))
    start = max(max(ready), ready[leader] + round(setting.matchmaking_s * 1e9)) if sync else 0
    ref = models[machines[0].hardware]
    value_bytes = ref.master_value_bytes
    shares = share_parts(ref.master_bytes // value_bytes, len(group), value_bytes,
                         setting.averaging_part_bytes)
    orders = group_orders(group, setting.seed) if sync else [group]
    ends, link_bytes, link_busy = [], {}, {}
    for order in orders:
        rounds = (averaging_programs(order, leader, start, shares, setting.stream_window_bytes)
                  if sync else {})
        programs = [[("until", ready[d]), *rounds.get(d, []), ("mark", 0)] for d in group]
        sim = simulate_programs(programs, links)
        ends.append(sim.step_end(0))
        for lane, nbytes in sim.link_bytes.items():
            link_bytes[lane] = link_bytes.get(lane, 0) + nbytes / len(orders)
            link_busy[lane] = link_busy.get(lane, 0) + sim.link_busy_ns[lane] / len(orders)
    span = round(sum(ends) / len(ends))
    busy = tuple((names[d], counts[d] * plans[d].compute_ns / span) for d in group)
    rows = link_rows(names, link_bytes, link_busy, span)
    prefetch = [(f"host-to-device copies on {names[d]}",
                 counts[d] * plans[d].prefetch_busy_ns / span) for d in group]
    accums = sorted({pp.plan.accum for pp in plans})
    subs = sorted({len(pp.plan.submodels) for pp in plans})
    config = (f"{len(machines)} peer(s), C={'/'.join(map(str, accums))}, "
              f"{'/'.join(map(str, subs))} sub-models each, {max(counts)} local step(s)")
    tokens = sum(c * x for c, x in zip(counts, samples)) * tokens_per_sample(ref)
    per_token = sum(link_bytes.values()) / tokens if tokens else 0.0
    dp = dp_bytes_per_token(machines, models, samples)
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
                "averaging_start_ns": start, "ready_ns": max(ready),
                "leader": names[leader], "window_bytes": setting.stream_window_bytes,
                "host_bytes": {names[d]: plans[d].host_bytes for d in group},
                "shares_bytes": [sum(s) for s in shares],
                "round_ns": {"min": min(ends) - start, "mean": span - start,
                             "max": max(ends) - start} if sync else {},
                "utilization": sum(c * s for c, s in zip(counts, steps)) / len(group) / span,
                "tokens_per_sample": tokens_per_sample(ref),
                "bytes_per_token": per_token, "dp_bytes_per_token": dp,
                "vs_dp": per_token / dp if dp else 0.0})


__all__ = ["ORDERS", "averaging_programs", "dp_bytes_per_token", "group_orders", "local_steps",
           "peer_plans", "peer_side_bytes", "predict_peers", "share_parts", "tokens_per_sample"]
