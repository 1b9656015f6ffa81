"""Event simulation of the swap schedule (DESIGN 5, ATOM Fig. 12): stage times -> Timeline.

Four lanes, each doing one thing at a time, in schedule order:

- compute: forward of P_0..P_{k-1} (each on C micro-batches), then backward of P_{k-1}..P_0;
- prefetch (host to device): the parameters of P_{i+1}, starting when P_i starts its forward;
  in the backward, when P_i starts: P_i's own checkpoints (its C micro-batches' inputs, streamed
  one micro-batch ahead; the first is taken to be there already, and the backward cannot end
  before the last has arrived) and then the parameters of P_{i-1}; at the end of the step,
  P_0's updated parameters;
- offload (device to host): the gradients of P_i when its backward ends;
- optimizer (CPU AdamW): P_i's update once its gradients are on the host.

P_0 stays resident across the step boundary and P_{k-1} across the forward/backward turn, so
neither is loaded there; P_0's parameters are refreshed in place after its CPU update, and
the next step starts when that copy ends (every other update has finished by then, since the
optimizer lane takes P_0 last). With `early_prefetch`, P_1's parameters for the next step are
loaded during that tail instead of during P_0's next forward, as soon as P_1's update is done;
a step then starts with P_1 already on the device.

Memory shapes two rules. While P_i computes, the other buffer receives P_{i+1}'s parameters in
the forward, or P_{i-1}'s in the backward; in the backward that buffer still holds P_{i+1}'s
gradients on their way out, so the load streams in behind the offload (chunk k of the load
waits for chunk k of the offload) and cannot end before the offload does.

Every duration is an integer number of nanoseconds, so a simulated step is exactly the sum the
partitioner's search adds up (see atomc.partition.search). The runtime records measured
events in the same `Event`/`Timeline` form, so a prediction and a measurement draw alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from atomc.ir import Document

LANES = ("compute", "prefetch", "offload", "optimizer")
KINDS = ("forward", "backward", "load", "checkpoint", "offload", "optimizer", "refresh")
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class Event:
    """Something one lane did for one sub-model, from start_ms to end_ms."""

    lane: str  # one of LANES
    submodel: int
    kind: str  # one of KINDS
    start_ms: float
    end_ms: float
    step: int = 0

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Timeline(Document):
    """Events of one or more training steps, predicted or measured."""

    KIND: ClassVar[str] = "atomc.timeline"

    source: str  # "predicted" or "measured"
    label: str
    num_submodels: int
    accum: int
    events: tuple[Event, ...]
    step_starts_ms: tuple[float, ...]  # when each step starts; the last entry ends the last step

    @property
    def num_steps(self) -> int:
        return len(self.step_starts_ms) - 1

    def step_ms(self, step: int = -1) -> float:
        starts = self.step_starts_ms
        i = step % self.num_steps
        return starts[i + 1] - starts[i]

    def busy_ms(self, lane: str = "compute", step: int | None = None) -> float:
        return sum(e.duration_ms for e in self.events
                   if e.lane == lane and (step is None or e.step == step))

    def utilisation(self, lane: str = "compute") -> float:
        """Busy fraction of `lane` over all steps."""
        span = self.step_starts_ms[-1] - self.step_starts_ms[0]
        return self.busy_ms(lane) / span if span > 0 else 0.0

    def lane_events(self, lane: str) -> list[Event]:
        return sorted((e for e in self.events if e.lane == lane), key=lambda e: e.start_ms)


@dataclass(frozen=True)
class StageTimes:
    """One sub-model's durations for the schedule, in ns (C micro-batches where it says so)."""

    fwd_ns: int  # forward of C micro-batches
    bwd_ns: int  # backward of C micro-batches, recomputation included
    load_ns: int  # its parameters, host to device
    checkpoint_ns: int  # its C micro-batches' checkpoints, host to device during its backward
    offload_ns: int  # its gradients, device to host
    optimizer_ns: int  # CPU AdamW over its fp32 masters


class _Discard(list):
    def append(self, item) -> None:
        pass


@dataclass(frozen=True)
class Simulation:
    timeline: Timeline
    step_ns: int  # one step, start to the end of P_0's refresh
    compute_ns: int  # compute-lane busy time in one step

    @property
    def utilisation(self) -> float:
        return self.compute_ns / self.step_ns if self.step_ns else 0.0


def simulate_swap(stages: list[StageTimes], accum: int, num_steps: int = 1,
                  label: str = "", early_prefetch: bool = False, record: bool = True) -> Simulation:
    """Replay `num_steps` steady-state steps of the swap schedule; they are identical.

    With record=False the timeline keeps no events (the partitioner only needs the times).
    """
    if not stages:
        raise ValueError("a schedule needs at least one sub-model")
    k = len(stages)
    events: list[tuple[str, int, str, int, int, int]] = []
    if not record:
        events = _Discard()  # type: ignore[assignment]
    starts = [0]
    t0 = 0
    step_ns = compute_ns = 0
    for step in range(num_steps):
        # lane_free: when each lane can take its next job; all are free when a step starts
        h2d = d2h = cpu = compute = t0
        early = early_prefetch and k > 1
        loaded = {0: t0}  # P_0 is resident and fresh
        if early:
            loaded[1] = t0  # loaded during the previous step's tail
        for i in range(k):  # forward
            start = max(compute, loaded[i])
            if i + 1 < k and not (early and i == 0):
                ls = max(start, h2d)
                h2d = ls + stages[i + 1].load_ns
                loaded[i + 1] = h2d
                events.append(("prefetch", i + 1, "load", ls, h2d, step))
            compute = start + stages[i].fwd_ns
            events.append(("compute", i, "forward", start, compute, step))
        bwd_loaded = {k - 1: compute}  # P_{k-1} stays resident
        offload_end: dict[int, int] = {}
        update_end: dict[int, int] = {}
        for i in range(k - 1, -1, -1):  # backward
            start = max(compute, bwd_loaded[i])
            ls = max(start, h2d)
            h2d = ls + stages[i].checkpoint_ns
            checkpoints_in = h2d
            if stages[i].checkpoint_ns:
                events.append(("prefetch", i, "checkpoint", ls, h2d, step))
            if i > 0:
                ls = h2d
                le = ls + stages[i - 1].load_ns
                if i + 1 < k:  # streams in behind P_{i+1}'s gradients leaving the same buffer
                    le = max(le, offload_end[i + 1])
                h2d = le
                bwd_loaded[i - 1] = le
                events.append(("prefetch", i - 1, "load", ls, le, step))
            events.append(("compute", i, "backward", start, start + stages[i].bwd_ns, step))
            # its last micro-batch cannot run before its checkpoint has arrived
            compute = max(start + stages[i].bwd_ns, checkpoints_in)
            os_ = max(compute, d2h)
            d2h = os_ + stages[i].offload_ns
            offload_end[i] = d2h
            events.append(("offload", i, "offload", os_, d2h, step))
            as_ = max(d2h, cpu)
            cpu = as_ + stages[i].optimizer_ns
            update_end[i] = cpu
            events.append(("optimizer", i, "optimizer", as_, cpu, step))
        if early:  # P_1 for the next step, once updated, while P_0's update runs
            ls = max(compute, update_end[1], h2d)
            h2d = ls + stages[1].load_ns
            events.append(("prefetch", 1, "load", ls, h2d, step))
        rs = max(cpu, h2d)
        end = rs + stages[0].load_ns
        events.append(("prefetch", 0, "refresh", rs, end, step))
        step_ns = end - t0
        compute_ns = sum(s.fwd_ns + s.bwd_ns for s in stages)
        t0 = end
        starts.append(end)
    timeline = Timeline(
        source="predicted", label=label, num_submodels=k, accum=accum,
        events=tuple(Event(lane, sub, kind, s / NS_PER_MS, e / NS_PER_MS, st)
                     for lane, sub, kind, s, e, st in events),
        step_starts_ms=tuple(s / NS_PER_MS for s in starts),
    )
    return Simulation(timeline=timeline, step_ns=step_ns, compute_ns=compute_ns)
