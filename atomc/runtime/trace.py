"""Runtime stage, event trace: what the swap executor did in a step, with measured times.

Input: spans the executor opens around each load, compute phase, copy and optimizer update.
Output: a `StepTrace` of `TraceEvent`s (lane, sub-model, kind, start_ms, end_ms) per step,
times relative to the step's start; `to_timeline` turns traces into the simulator's
`Timeline`, so a measured timeline draws beside the predicted one (atomc.simulate).

Lanes and kinds are the simulator's: "compute" (forward, backward — recomputation included),
"prefetch" (load, refresh: weights host to device; checkpoint: stashed boundary activations
and sent operator outputs host to device), "offload" (offload: gradients device to host;
checkpoint_out: boundary activations device to host; activation_out: operator outputs sent to
host memory) and "optimizer" (optimizer; grad_prepare and grad_norm when the
update waits for every gradient).

On CUDA, device spans are timed with CUDA events recorded on the stream that does the work;
they are read once, at the end of a traced step (the only synchronisation tracing adds).
Optimizer spans are host `perf_counter` times placed on the same axis: the previous traced
step ended with a sync, so the step's start event is recorded with nothing queued before it
and host time at that record is the GPU's time zero to within launch latency.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from atomc.simulate import Timeline

LANES = ("compute", "prefetch", "offload", "optimizer")
KINDS = ("forward", "backward", "load", "refresh", "checkpoint", "checkpoint_out", "offload",
         "optimizer", "grad_prepare", "grad_norm", "activation_out")


@dataclass(frozen=True)
class TraceEvent:
    lane: str
    submodel: int
    kind: str
    start_ms: float
    end_ms: float
    step: int = 0
    num_bytes: int = 0  # for copies: bytes moved
    slot: int = -1  # for loads: the device slot filled

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class StepTrace:
    step: int
    events: list[TraceEvent] = field(default_factory=list)
    wall_ms: float = 0.0  # host time from the start of step() to its return
    host_start: float = 0.0  # perf_counter at the step's start: places steps on one axis

    def total_ms(self, lane: str | None = None, kind: str | None = None) -> float:
        return sum(e.duration_ms for e in self.events
                   if (lane is None or e.lane == lane) and (kind is None or e.kind == kind))

    def span_ms(self) -> float:
        """From the first event's start to the last device event's end (the GPU step time)."""
        dev = [e for e in self.events if e.lane != "optimizer"]
        if not dev:
            return 0.0
        return max(e.end_ms for e in dev) - min(e.start_ms for e in dev)

    def busy_fraction(self) -> float:
        """Fraction of the device span the compute lane was busy."""
        span = self.span_ms()
        return self.total_ms(lane="compute") / span if span > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "wall_ms": self.wall_ms,
                "events": [e.__dict__ for e in self.events]}

    def table(self) -> str:
        """Short text form: one line per event, in start order."""
        lines = [f"step {self.step}: {len(self.events)} events, wall {self.wall_ms:.2f} ms"]
        for e in sorted(self.events, key=lambda e: (e.start_ms, LANES.index(e.lane))):
            size = f"  {e.num_bytes / 2**20:8.2f} MiB" if e.num_bytes else ""
            who = f"P{e.submodel}" if e.submodel >= 0 else "all"
            lines.append(f"  {e.lane:9s} {who:4s} {e.kind:14s} "
                         f"{e.start_ms:10.3f} -> {e.end_ms:10.3f} ms{size}")
        return "\n".join(lines)


class Tracer:
    """Collects spans for one step at a time; cheap no-ops when disabled.

    The optimizer thread adds its spans to the step whose gradients it used, possibly after
    that step's trace was closed; a lock keeps the two threads' appends apart.
    """

    def __init__(self, device: torch.device, enabled: bool = True, keep_last: int = 8):
        self.device = device
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.keep_last = keep_last  # traces kept (by step); older ones are dropped
        self.step: int = 0
        self._host_t0: dict[int, float] = {}
        self._start_event: Any = None
        self._cuda_spans: list[tuple[str, int, str, Any, Any, int, int]] = []
        self._lock = threading.Lock()
        self.traces: dict[int, StepTrace] = {}

    def begin_step(self, step: int, stream: Any = None) -> None:
        self.step = step
        self._cuda_spans = []
        if not self.enabled:
            return
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record(stream)
        with self._lock:
            self._host_t0[step] = time.perf_counter()
            self.traces[step] = StepTrace(step, host_start=self._host_t0[step])
            for old in sorted(self.traces)[:-self.keep_last]:
                del self.traces[old]
                self._host_t0.pop(old, None)

    def _host_ms(self, step: int, t: float) -> float:
        return (t - self._host_t0[step]) * 1e3

    def _add(self, step: int, event: TraceEvent) -> None:
        with self._lock:
            trace = self.traces.get(step)
            if trace is not None:
                trace.events.append(event)

    @contextmanager
    def span(self, lane: str, submodel: int, kind: str, stream: Any = None,
             num_bytes: int = 0, slot: int = -1) -> Iterator[None]:
        """Time the work issued inside the block: on `stream` with CUDA events, else on the host."""
        if not self.enabled:
            yield
            return
        if self.cuda and stream is not None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._cuda_spans.append((lane, submodel, kind, start, end, num_bytes, slot))
        else:
            step = self.step
            t0 = time.perf_counter()
            yield
            t1 = time.perf_counter()
            self._add(step, TraceEvent(lane, submodel, kind, self._host_ms(step, t0),
                                       self._host_ms(step, t1), step, num_bytes, slot))

    def host_event(self, step: int, lane: str, submodel: int, kind: str, t0: float,
                   t1: float) -> None:
        """A span timed with perf_counter on another thread, placed on `step`'s axis."""
        if not self.enabled:
            return
        with self._lock:
            if step not in self._host_t0:
                return
            origin = self._host_t0[step]
        self._add(step, TraceEvent(lane, submodel, kind, (t0 - origin) * 1e3,
                                   (t1 - origin) * 1e3, step))

    def end_step(self, wall_ms: float) -> StepTrace | None:
        """Close the step: read the CUDA events (one wait for the step's last one)."""
        if not self.enabled:
            return None
        step = self.step
        if self.cuda and self._cuda_spans:
            for span in self._cuda_spans:
                span[4].synchronize()
            for lane, sub, kind, start, end, nbytes, slot in self._cuda_spans:
                self._add(step, TraceEvent(lane, sub, kind, self._start_event.elapsed_time(start),
                                           self._start_event.elapsed_time(end), step, nbytes, slot))
        self._cuda_spans = []
        with self._lock:
            trace = self.traces[step]
            trace.wall_ms = wall_ms
        return trace


def replay_residency(trace: StepTrace, initially: dict[int, int] | None = None) -> int:
    """Most sub-models whose weights were in device slots at once, replayed from the trace.

    Each load event names the slot it filled (evicting that slot's previous sub-model);
    `initially` maps slot -> sub-model at the step's start. Raises AssertionError when a
    compute event runs a sub-model that is not in a slot at that moment.
    """
    slots: dict[int, int] = dict(initially or {})
    most = len(set(slots.values()))
    def loads(e: TraceEvent) -> bool:
        return e.kind in ("load", "refresh")

    for e in sorted(trace.events, key=lambda e: (e.start_ms, 0 if loads(e) else 1)):
        if loads(e):
            slots[e.slot] = e.submodel
            most = max(most, len(set(slots.values())))
        elif e.lane == "compute" and e.submodel not in slots.values():
            raise AssertionError(f"step {trace.step}: P{e.submodel} computed ({e.kind}) while "
                                 f"not resident; slots {slots}")
    return most


def to_timeline(traces: list[StepTrace], num_submodels: int, accum: int,
                label: str = "") -> Timeline:
    """Measured steps as the simulator's Timeline (source "measured"), on one time axis.

    Each step starts at its host start time; it ends where the next starts, or for the last
    step at its last device event (optimizer work may run on into the next step).
    """
    from atomc.simulate import Event, Timeline

    if not traces:
        raise ValueError("no traced steps: train with trace=True")
    traces = sorted(traces, key=lambda t: t.step)
    origin = traces[0].host_start
    events, starts = [], []
    for t in traces:
        offset = (t.host_start - origin) * 1e3
        starts.append(offset)
        for e in t.events:
            events.append(Event(e.lane, e.submodel, e.kind, offset + e.start_ms,
                                offset + e.end_ms, t.step))
    last = traces[-1]
    device_ends = [e.end_ms for e in last.events if e.lane != "optimizer"] or [0.0]
    starts.append(starts[-1] + max(max(device_ends), 0.0))
    return Timeline(source="measured", label=label, num_submodels=num_submodels, accum=accum,
                    events=tuple(sorted(events, key=lambda e: (e.start_ms, e.lane))),
                    step_starts_ms=tuple(starts))
