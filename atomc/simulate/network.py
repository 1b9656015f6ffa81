"""The simulator across devices: programs of jobs on several devices, joined by network links.

events.py times one device's swap schedule on its four lanes. Here several devices each run a
program, and what one device sends another receives over a link:

- a device's **compute** lane runs its compute jobs one after another, in program order (a
  pipeline stage's F and B, an optimizer step, a whole swap step that `simulate_actions` timed);
- a **send** puts a message on the link from the device to its destination and goes on at
  once (the runtimes send asynchronously); each link carries its messages one after another
  in the order they were sent, a message taking bytes x 8 / bandwidth on the link, and
  arrives the link's latency after it has left;
- a **recv** waits until its message has arrived; `flush` waits until every message the
  device sent has arrived (the layout runner's `Transport.flush` at the end of a step);
- `until` waits for a moment in absolute time (a protocol's fixed wait, such as matchmaking);
  `mark` records where a step ends on the device.

Links are ordered pairs of devices, independent of each other, as in DT-FM's communication
graph (atomc.place.network): a device sending to two others uses two links at once. A link of
infinite bandwidth and no latency is free; a device never sends to itself over a link.

`pipeline_jobs` compiles one pipeline stage's step (atomc.actions: GPipe, 1F1B) into jobs:
F and B on the compute lane, S and R as messages to and from the neighbouring stages' devices;
an order of several steps (PipeDream's) has its updates' jobs and step marks given by the
caller.
`exchange_jobs` is the sharded exchange that averages a vector over a group (DT-FM's sharded
parameter server, the layout runner's data-parallel averaging): every member sends each other
member that member's 1/n share, reduces its own share, and sends it back to everyone.
hivemind's all-reduce cuts its shares at whole parts and starts its members apart
(atomc.compare.peers.averaging_programs).

All times are integer nanoseconds, as in events.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from atomc.actions import Action, directions

INF = math.inf


@dataclass(frozen=True)
class Links:
    """Bandwidth (bit/s) and one-way latency (ns) of the link from device a to device b."""

    bandwidth_bps: tuple[tuple[float, ...], ...]
    latency_ns: tuple[tuple[int, ...], ...]

    @property
    def num_devices(self) -> int:
        return len(self.bandwidth_bps)

    @classmethod
    def uniform(cls, n: int, bandwidth_bps: float, latency_ns: int = 0) -> Links:
        return cls(tuple(tuple(bandwidth_bps for _ in range(n)) for _ in range(n)),
                   tuple(tuple(latency_ns for _ in range(n)) for _ in range(n)))

    def wire_ns(self, a: int, b: int, num_bytes: float) -> int:
        """How long `num_bytes` occupy the link a -> b (0 on an infinitely fast link)."""
        bw = self.bandwidth_bps[a][b]
        if a == b or bw == INF or num_bytes <= 0:
            return 0
        return math.ceil(num_bytes * 8 * 1e9 / bw)


# jobs: tuples, the first item their kind
#   ("compute", ns, label)     ("send", dst, bytes, key)     ("recv", src, key)
#   ("flush",)                 ("until", ns)                  ("mark", step)
Job = tuple


@dataclass
class NetworkSimulation:
    """What `simulate_programs` found."""

    num_devices: int
    step_ends_ns: list[dict[int, int]]  # per device: step -> when the device ended it
    busy_ns: list[int]  # per device: compute-lane busy time, all steps
    link_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # all steps
    link_busy_ns: dict[tuple[int, int], int] = field(default_factory=dict)

    def step_end(self, step: int) -> int:
        """When the last device ended `step`."""
        return max(ends[step] for ends in self.step_ends_ns if step in ends)

    def step_ns(self, step: int) -> int:
        """The duration of `step`, from the end of the step before (0 for step 0)."""
        return self.step_end(step) - (self.step_end(step - 1) if step > 0 else 0)


def simulate_programs(programs: Sequence[Sequence[Job]], links: Links) -> NetworkSimulation:
    """Run each device's program (see the module docstring); ValueError when they deadlock
    (a device waits for a message no device sends) or a message is sent twice."""
    n = len(programs)
    if links.num_devices < n:
        raise ValueError(f"{n} programs but links for {links.num_devices} devices")
    pos = [0] * n
    clock = [0] * n  # when each device's compute lane is next free
    busy = [0] * n
    last_arrival = [0] * n  # of the messages each device sent
    step_ends: list[dict[int, int]] = [{} for _ in range(n)]
    link_free: dict[tuple[int, int], int] = {}
    link_bytes: dict[tuple[int, int], int] = {}
    link_busy: dict[tuple[int, int], int] = {}
    arrivals: dict[object, int] = {}
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for d in range(n):
            prog = programs[d]
            while pos[d] < len(prog):
                job = prog[pos[d]]
                kind = job[0]
                if kind == "compute":
                    clock[d] += job[1]
                    busy[d] += job[1]
                elif kind == "send":
                    _, dst, nbytes, key = job
                    if key in arrivals:
                        raise ValueError(f"message {key} is sent twice")
                    if dst == d:
                        arrivals[key] = clock[d]
                    else:
                        lane = (d, dst)
                        start = max(clock[d], link_free.get(lane, 0))
                        wire = links.wire_ns(d, dst, nbytes)
                        link_free[lane] = start + wire
                        link_bytes[lane] = link_bytes.get(lane, 0) + int(nbytes)
                        link_busy[lane] = link_busy.get(lane, 0) + wire
                        arrivals[key] = start + wire + int(links.latency_ns[d][dst])
                    last_arrival[d] = max(last_arrival[d], arrivals[key])
                elif kind == "recv":
                    when = arrivals.get(job[2])
                    if when is None:
                        break  # not sent yet: another device first
                    clock[d] = max(clock[d], when)
                elif kind == "flush":
                    clock[d] = max(clock[d], last_arrival[d])
                elif kind == "until":
                    clock[d] = max(clock[d], job[1])
                elif kind == "mark":
                    step_ends[d][job[1]] = clock[d]
                else:
                    raise ValueError(f"job {job!r}: unknown kind {kind!r}")
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [(d, programs[d][pos[d]]) for d in range(n) if pos[d] < len(programs[d])]
            where = ", ".join(f"device {d} waits at {j}" for d, j in waiting[:4])
            raise ValueError(f"the programs deadlock: {where}")
    return NetworkSimulation(num_devices=n, step_ends_ns=step_ends, busy_ns=busy,
                             link_bytes=link_bytes, link_busy_ns=link_busy)


# ---------------------------------------------------------------------------------------------
# compiling action lists and collectives into jobs


@dataclass(frozen=True)
class StageCosts:
    """One pipeline stage on one device: per micro-batch times (ns) and boundary bytes."""

    fwd_ns: int
    bwd_ns: int  # the backward alone: a resident stage keeps each micro-batch's graph
    values_in_bytes: int = 0  # what one micro-batch brings from the stage before
    grads_out_bytes: int = 0  # the gradients of those values, sent back
    values_out_bytes: int = 0  # what one micro-batch sends to the stage after
    grads_in_bytes: int = 0  # the gradients of those values, coming back


def pipeline_jobs(actions: Sequence[Action], costs: StageCosts, *, step: int, replica: int,
                  prev_device: int | None, next_device: int | None,
                  update: Callable[[int], list[Job]] | None = None) -> list[Job]:
    """One stage's step (F, B, S, R actions of atomc.actions.orders) as jobs. Message keys
    name (step, replica, stage, micro-batch, what): the neighbouring stages' jobs meet on
    them. An order that updates the weights as it goes (U after a backward: PipeDream) needs
    `update`, which gives the jobs of the U that follows micro-batch m's backward (the
    averaging, the optimizer, a step's `mark`)."""
    jobs: list[Job] = []
    last_backward = None
    for a, direction in zip(actions, directions(list(actions))):
        if a.kind == "U" and update is not None:
            if last_backward is None:
                raise ValueError(f"action {a} updates before any backward")
            jobs += update(last_backward)
        elif a.kind == "F":
            jobs.append(("compute", costs.fwd_ns, "forward"))
        elif a.kind == "B":
            jobs.append(("compute", costs.bwd_ns, "backward"))
            last_backward = a.micro
        elif a.kind in ("S", "R"):
            jobs.append(message_job(a, direction, costs, step=step, replica=replica,
                                    prev_device=prev_device, next_device=next_device))
        else:
            raise ValueError(f"action {a} is not one a resident pipeline stage runs (F B S R, "
                             f"U with `update`)")
    return jobs


def message_job(a: Action, direction: str | None, costs: StageCosts, *, step: int, replica: int,
                prev_device: int | None, next_device: int | None) -> Job:
    """A stage's S or R action as a send or receive job (`direction`: "values" or "grads",
    as atomc.actions.directions says of the stage's whole list)."""
    j, m = a.index, a.micro
    if a.kind == "S" and direction == "values":
        _need(next_device, a)
        return ("send", next_device, costs.values_out_bytes, (step, replica, j, m, "values"))
    if a.kind == "S":
        _need(prev_device, a)
        return ("send", prev_device, costs.grads_out_bytes, (step, replica, j - 1, m, "grads"))
    if a.kind == "R" and direction == "values":
        _need(prev_device, a)
        return ("recv", prev_device, (step, replica, j - 1, m, "values"))
    if a.kind == "R":
        _need(next_device, a)
        return ("recv", next_device, (step, replica, j, m, "grads"))
    raise ValueError(f"action {a} is no message (S or R)")


def _need(device: int | None, a: Action) -> None:
    if device is None:
        raise ValueError(f"action {a} talks past the end of the pipeline")


def exchange_jobs(me: int, group: Sequence[int], num_bytes: int, key: object) -> list[Job]:
    """`me`'s part in averaging a vector of `num_bytes` over `group` (device indices, `me`
    among them): its shares out, the others' shares of its own part in, the reduced part
    back out, the others' reduced parts in. Nothing for a group of one."""
    others = [g for g in group if g != me]
    if not others:
        return []
    share = math.ceil(num_bytes / len(group))
    jobs: list[Job] = [("send", o, share, (key, "part", me, o)) for o in others]
    jobs += [("recv", o, (key, "part", o, me)) for o in others]
    jobs += [("send", o, share, (key, "reduced", me, o)) for o in others]
    jobs += [("recv", o, (key, "reduced", o, me)) for o in others]
    return jobs


__all__ = ["INF", "Job", "Links", "NetworkSimulation", "StageCosts", "exchange_jobs",
           "message_job", "pipeline_jobs", "simulate_programs"]
