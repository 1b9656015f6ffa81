"""Event simulation of a swap schedule (docs/design.md, section "Simulate"; ATOM Fig. 12):
actions + stage times -> Timeline.

Input: one step's list of actions (atomc.actions; `simulate_swap` takes ATOM's order, the list
the swap runtime executes) and each sub-model's durations. Output: a Timeline of predicted
events, the step time and the compute lane's busy time.

Four lanes, each doing one thing at a time, in list order:

- compute: F and B (forward, recomputation + backward) of one micro-batch; a sub-model's times
  are given for C micro-batches, so each micro-batch takes its C-th share;
- prefetch (host to device): L, a sub-model's parameters, and its checkpoints (its C
  micro-batches' inputs offloaded in the forward), which stream in from its first B on, ahead
  of the loads listed before that B, one micro-batch ahead (the first is taken to be there
  already; its last B cannot end before the last has arrived);
- offload (device to host): O, a sub-model's gradients, after its latest B;
- optimizer (CPU AdamW): U, after its O.

F and B wait for the latest load of their sub-model listed before them (for P_{k-2}'s
backward, the one before its forward: it is still in its slot; for P_1's forward after an
early prefetch, none: the previous step loaded it). Sub-model i uses
weight slot i % 2, and memory shapes the loads: a load starts when the compute listed before
it has ended (the weights it overwrites and that compute's working memory are free) and the
latest update of its weights is done; and it streams in behind the gradients of the slot's
latest offload, leaving through the same buffer (chunk k of the load waits for chunk k of the
offload), so it cannot end before that offload does.

On a CPU device (`host_copies`; `copies_on_host` says which devices) there are no copy
engines and no cores to spare: the swap runtime's one thread computes and also loads, streams
checkpoints, offloads and updates (atomc.runtime.optim.updates_on_a_thread), one job at a
time in list order. The thread also spends time of its own between actions (the
Python that drives them): `host_gap_ns` before each action, which a measured profile holds
(atomc.calibrate.probe) and `atomc calibrate` fits (none otherwise).

A step lasts from the end of its first action, P_0's refresh in ATOM's order (every update has
ended by then: the optimizer lane takes P_0 last), to the end of the next step's; steps are
identical. Every duration is an integer number of nanoseconds, so a simulated step is exactly
the sum the partitioner's search adds up (see atomc.partition.search). The runtime records
measured events in the same `Event`/`Timeline` form, so a prediction and a measurement draw
alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from atomc.actions import Action, Run, atom_runs, runs
from atomc.device import names_cpu
from atomc.ir.documents import Document
from atomc.units import NS_PER_MS

LANES = ("compute", "prefetch", "offload", "optimizer", "disk")
KINDS = ("forward", "backward", "load", "checkpoint", "offload", "optimizer", "refresh",
         "activation_out", "state_read", "state_write", "image_read")


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
    # activations="auto": its C micro-batches' sent operator outputs, device to host after its
    # forward (their way back is in checkpoint_ns)
    send_ns: int = 0
    # the disk tier (atomc.runtime.tier): its record (states on disk) read before its update
    # and written back after it, its image read before each load (0: on the host)
    record_read_ns: int = 0
    record_write_ns: int = 0
    image_read_ns: int = 0


@dataclass(frozen=True)
class Simulation:
    timeline: Timeline
    step_ns: int  # one step, start to the end of P_0's refresh
    compute_ns: int  # compute-lane busy time in one step

    @property
    def utilisation(self) -> float:
        return self.compute_ns / self.step_ns if self.step_ns else 0.0



def copies_on_host(device: str) -> bool:
    """Whether a plan's device copies on the thread that computes: the CPU (a profile names it
    "cpu (...)"), whose swap runtime has no streams."""
    return names_cpu(device)


def simulate_swap(stages: list[StageTimes], accum: int, num_steps: int = 1,
                  label: str = "", early_prefetch: bool = False, record: bool = True,
                  host_copies: bool = False, host_gap_ns: int = 0) -> Simulation:
    """Time `num_steps` steady-state steps of ATOM's order (atomc.actions.atom_order).

    With record=False the timeline keeps no events (the partitioner only needs the times);
    with host_copies, copies run on the computing thread (a CPU device, see above), which
    also spends `host_gap_ns` of its own before each action it runs.
    """
    if not stages:
        raise ValueError("a schedule needs at least one sub-model")
    order = atom_runs(len(stages), accum, early_prefetch=early_prefetch)
    return _simulate(_compile(order, stages, accum), stages, accum, num_steps, label, record,
                     host_copies, host_gap_ns)


def simulate_actions(actions: list[Action], stages: list[StageTimes], accum: int, *,
                     num_steps: int = 1, label: str = "", record: bool = True,
                     host_copies: bool = False, host_gap_ns: int = 0) -> Simulation:
    """Time `num_steps` repetitions of one step's `actions` (F, B, L, O, U) on the four lanes.

    A step lasts from the end of its first action (in ATOM's order, P_0's refresh) to the end
    of the next step's first action; the first step starts when its first action has ended,
    at time 0, with every lane idle, which is how each step leaves the next one. Raises
    ValueError for an action the swap lanes do not run, or one listed before the compute
    whose output it needs.
    """
    _check_order(actions, len(stages), accum)
    return _simulate(_compile(runs(actions), stages, accum), stages, accum, num_steps, label,
                     record, host_copies, host_gap_ns)


def _check_order(actions: list[Action], k: int, accum: int) -> None:
    done: set[tuple[str, int, int | None]] = set()
    for a in actions:
        if a.kind in "SR" or a.index >= k or (a.micro is not None and a.micro >= accum):
            raise ValueError(f"action {a} is not one of this swap schedule's ({k} sub-models, "
                             f"C={accum}: F B L O U)")
        if a.kind == "F" and a.index and ("F", a.index - 1, a.micro) not in done:
            raise ValueError(f"action {a} comes before {Action('F', a.index - 1, a.micro)}, "
                             f"whose output it reads")
        if a.kind == "B":
            source = ("B", a.index + 1, a.micro) if a.index + 1 < k else ("F", a.index, a.micro)
            if source not in done:
                raise ValueError(f"action {a} comes before {Action(*source)}, whose output "
                                 f"gradient it needs")
        done.add((a.kind, a.index, a.micro))


def _compile(order: list[Run], stages: list[StageTimes], accum: int) -> tuple[list[tuple], int]:
    """One step's runs as lane jobs (op, sub-model, duration, waits, lane, event kind, number
    of actions), and its compute time.

    A run of F (or B) is one job: the lane runs it back to back and only its first action
    waits for a load, so it times as its actions do and draws as one bar. Each micro-batch
    takes its share of the sub-model's time for C micro-batches (the shares add up exactly).
    A sub-model's checkpoints become a prefetch job "K" right after the compute before its
    first B (ahead of the loads listed before that B, as the runtime issues them), and the
    job holding its last B waits for them. The step's first action, a load, is P_0's refresh.
    """
    first_b: dict[int, int] = {}
    last_b: dict[int, int] = {}
    last_f: dict[int, int] = {}
    for pos, (kind, i, _) in enumerate(order):
        if kind == "B":
            first_b.setdefault(i, pos)
            last_b[i] = pos
        elif kind == "F":
            last_f[i] = pos
    jobs: list[tuple] = []
    after_compute = 0  # where a checkpoint job goes: after the latest compute job
    last_load: int | None = None  # where the latest L and U jobs are (disk reads go ahead)
    last_update: int | None = None
    compute_ns = 0
    for pos, (kind, i, micros) in enumerate(order):
        st = stages[i]
        if kind == "F" or kind == "B":
            total = st.fwd_ns if kind == "F" else st.bwd_ns
            dur = total * micros.stop // accum - total * micros.start // accum
            compute_ns += dur
            if st.checkpoint_ns and first_b.get(i) == pos:
                jobs.insert(after_compute,
                            ("K", i, st.checkpoint_ns, False, "prefetch", "checkpoint", 0))
                last_load = last_load + 1 if last_load is not None and \
                    last_load >= after_compute else last_load
                last_update = last_update + 1 if last_update is not None and \
                    last_update >= after_compute else last_update
            waits = bool(st.checkpoint_ns) and last_b.get(i) == pos  # for its checkpoints
            jobs.append((kind, i, dur, waits, "compute", "forward" if kind == "F" else "backward",
                         len(micros)))
            after_compute = len(jobs)
            if kind == "F" and st.send_ns and last_f.get(i) == pos:
                jobs.append(("A", i, st.send_ns, False, "offload", "activation_out", 0))
        elif kind == "L":
            if st.image_read_ns:  # read ahead: listed with the load before it
                at = last_load if last_load is not None else len(jobs)
                jobs.insert(at, ("I", i, st.image_read_ns, False, "disk", "image_read", 0))
            last_load = len(jobs)
            jobs.append(("L", i, st.load_ns, False, "prefetch", "load" if pos else "refresh", 1))
        elif kind == "O":
            jobs.append(("O", i, st.offload_ns, False, "offload", "offload", 1))
        else:
            if st.record_read_ns:  # read ahead: listed with the update before it
                at = last_update if last_update is not None else 0
                jobs.insert(at, ("R", i, st.record_read_ns, False, "disk", "state_read", 0))
                if last_load is not None and last_load >= at:
                    last_load += 1
            last_update = len(jobs)
            jobs.append(("U", i, st.optimizer_ns, False, "optimizer", "optimizer", 1))
            if st.record_write_ns:
                jobs.append(("W", i, st.record_write_ns, False, "disk", "state_write", 0))
    return jobs, compute_ns


def _simulate(program: tuple[list[tuple], int], stages: list[StageTimes], accum: int,
              num_steps: int, label: str, record: bool, host_copies: bool = False,
              host_gap_ns: int = 0) -> Simulation:
    """Run the jobs of `num_steps` steps and the first job of the next one (see
    simulate_actions): each job starts when its lane is free and what it waits for is done."""
    if num_steps < 1:
        raise ValueError(f"num_steps {num_steps}: simulate at least one step")
    jobs, compute_ns = program
    k = len(stages)
    comp = h2d = d2h = cpu = disk = 0  # when each lane is next free
    load_end = [0] * k  # of the latest load of each sub-model
    ckpt_end = [0] * k
    bwd_end = [0] * k
    offload_end = [0] * k
    update_end = [0] * k
    image_end = [0] * k  # of the latest read of each image from disk
    record_end = [0] * k  # of the latest read of each record
    written = [0] * k  # of the latest write of each record
    slot_offload_end = [0, 0]  # of the latest gradient copy out of each slot
    events: list[tuple[str, int, str, int, int, int]] = []
    starts = [0]
    for step in range(num_steps + 1):
        # the first step starts as its opening job ends, at 0; the last round runs only the
        # opening job of the step after, which ends the last step
        todo = jobs[1:] if step == 0 else jobs[:1] if step == num_steps else jobs
        opening = step > 0
        for op, i, dur, waits, lane, kind, num_actions in todo:
            if host_copies:  # the thread's own time between actions comes first
                comp += host_gap_ns * num_actions
            if host_copies and op in "LOKUA":  # on the computing thread, after what it did so far
                h2d = d2h = cpu = max(h2d, d2h, cpu, comp)
            if op == "F" or op == "B":
                start = max(comp, load_end[i])
                end = start + dur
                comp = max(end, ckpt_end[i]) if waits else end
                if op == "B":
                    bwd_end[i] = comp
            elif op == "L":
                start = max(h2d, comp, update_end[i], image_end[i])
                end = h2d = load_end[i] = max(start + dur, slot_offload_end[i % 2])
            elif op == "O":
                start = max(d2h, bwd_end[i])
                end = d2h = offload_end[i] = slot_offload_end[i % 2] = start + dur
            elif op == "U":
                start = max(cpu, offload_end[i], record_end[i])
                end = cpu = update_end[i] = start + dur
            elif op == "I":  # an image from disk, once its latest write is done
                start = max(disk, written[i])
                end = disk = image_end[i] = start + dur
            elif op == "R":  # a record read ahead of its update
                start = max(disk, written[i])
                end = disk = record_end[i] = start + dur
            elif op == "W":  # written back behind its update
                start = max(disk, update_end[i])
                end = disk = written[i] = start + dur
            elif op == "A":  # sent activations, after the forward that made them
                start = max(d2h, comp)
                end = d2h = start + dur
            else:  # "K", checkpoints
                start = max(h2d, comp)
                end = h2d = ckpt_end[i] = start + dur
            if host_copies and op in "LOKUA":  # ... and nothing else meanwhile
                comp = h2d = d2h = cpu = end
            if opening:  # it belongs to the step it ends
                starts.append(end)
            if record:
                events.append((lane, i, kind, start, end, step - 1 if opening else step))
            opening = False
    timeline = Timeline(
        source="predicted", label=label, num_submodels=k, accum=accum,
        events=tuple(Event(lane, sub, kind, s / NS_PER_MS, e / NS_PER_MS, st)
                     for lane, sub, kind, s, e, st in events),
        step_starts_ms=tuple(s / NS_PER_MS for s in starts),
    )
    return Simulation(timeline=timeline, step_ns=starts[-1] - starts[-2], compute_ns=compute_ns)


LANE_WORDS = {"compute": "GPU compute", "prefetch": "loads (host to GPU)",
              "offload": "gradient offload (GPU to host)", "optimizer": "CPU update",
              "disk": "disk (states and images)"}


def binding_lane(timeline: Timeline) -> str:
    """The lane busiest over the step (in words): what a faster step needs more of."""
    busy = {lane: timeline.busy_ms(lane) for lane in LANES}
    return LANE_WORDS[max(busy, key=busy.__getitem__)]


def gradients_in_flight(timeline: Timeline) -> int:
    """The most sub-models whose gradients are on the host at once: from the start of the
    copy that brings them back to the end of the update that consumes them (a host
    gradient ring needs that many buffers for no copy to wait)."""
    spans: dict[tuple[int, int], list[float]] = {}
    for e in timeline.events:
        if e.lane == "offload" and e.kind == "offload":
            spans.setdefault((e.step, e.submodel), [e.start_ms, e.end_ms])[0] = e.start_ms
        elif e.lane == "optimizer" and e.kind == "optimizer":
            spans.setdefault((e.step, e.submodel), [e.start_ms, e.end_ms])[1] = e.end_ms
    edges = sorted([(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()])
    held = most = 0
    for _, change in edges:  # an end and a start at one time: the end first (-1 sorts first)
        held += change
        most = max(most, held)
    return most


def fit_host_gap_ms(stages: list[StageTimes], accum: int, early_prefetch: bool,
                    measured_step_ms: float) -> float:
    """On a CPU device: the runtime thread's time before each action it runs that makes the
    simulated step of `stages` the measured one (what the events leave unexplained: the
    Python between actions, and what copies take beyond their bytes over the bandwidth).
    A few fixed-point rounds: a gap can overlap the wait of a forward for its load."""
    from atomc.actions import atom_order

    num_actions = len(atom_order(len(stages), accum, early_prefetch=early_prefetch))
    target_ns = measured_step_ms * NS_PER_MS
    gap_ns = 0.0
    for _ in range(6):
        sim = simulate_swap(stages, accum, early_prefetch=early_prefetch, host_copies=True,
                            host_gap_ns=round(gap_ns), record=False)
        miss = target_ns - sim.step_ns
        if abs(miss) < 1000:  # 1 us
            break
        gap_ns = max(gap_ns + miss / num_actions, 0.0)
    return round(gap_ns) / NS_PER_MS
