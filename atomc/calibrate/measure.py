"""Calibrate stage, input side: a generated package trained for a few traced steps -> Measurement.

`measure_package` trains the package with the swap runtime (atomc.runtime.SwapTrainer with
trace=True): `warmup` steps first, which it does not measure (allocations, the optimizer's
moments, caches), then `steps` measured ones. `summarise` turns their event traces
(atomc.runtime.trace) into what a plan predicts, as medians over the measured steps:

- the step, from its start to the next step's start: what a training loop's throughput sees
  (so one more step is run than is measured);
- each lane's busy time (compute, prefetch, offload, optimizer);
- per sub-model: forward and backward compute per micro-batch (the backward with the
  recomputation the runtime does: none in the last sub-model), one load of its weights, its
  checkpoints streamed in, its gradients' offload and its CPU update;
- the bandwidths the weight loads and gradient offloads achieved (bytes over time).

The runtime times compute spans around compute only: loads, waits for an update and
checkpoint copies that must come first run outside them (atomc.runtime.interpret), on CUDA as
on the CPU. On CUDA, device spans are CUDA-event times; a traced step ends with one
synchronisation, which the measured step includes.

A measurement is unusable, and refused with CalibrationError, when a step failed (raised or
gave a non-finite loss), when its device is not the plan's, or when a step's trace lacks what
the plan's schedule does (a sub-model's forward or backward).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from atomc.device import describe_device
from atomc.errors import AtomcError, CalibrationError, UsageError
from atomc.ir.documents import Document
from atomc.runtime.trace import LANES, StepTrace

LOADS = ("load", "refresh")


@dataclass(frozen=True)
class MeasuredSubmodel:
    """One sub-model's medians over the measured steps."""

    index: int
    fwd_ms: float  # one micro-batch
    bwd_ms: float  # one micro-batch, with the runtime's recomputation
    load_ms: float  # one load of its weights (0: never loaded in the measured steps)
    load_bytes: int
    checkpoint_ms: float  # its C micro-batches' checkpoints, host to device, in one step
    offload_ms: float  # its gradients to the host, in one step
    offload_bytes: int
    optimizer_ms: float  # its CPU update (gradient gathering included), in one step


@dataclass(frozen=True)
class Measurement(Document):
    """Measured steps of one plan's package on one device."""

    KIND: ClassVar[str] = "atomc.measurement"

    package: str
    plan_hash: str  # the plan the package was generated from
    device: str  # as profiles name devices (atomc.device.describe_device)
    accum: int
    activations: str
    warmup_steps: int
    step_ms: tuple[float, ...]  # each measured step, start to the next start
    lane_busy_ms: dict[str, tuple[float, ...]]  # lane -> busy time in each measured step
    losses: tuple[float, ...]  # every step's loss, warm-up included
    submodels: tuple[MeasuredSubmodel, ...]
    h2d_gbps: float  # achieved by the weight loads (0: nothing loaded)
    d2h_gbps: float  # achieved by the gradient offloads (0: nothing moved)

    @property
    def num_steps(self) -> int:
        return len(self.step_ms)

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms)

    def busy_fraction(self, lane: str) -> float:
        """Median over the measured steps of `lane`'s busy time over the step."""
        busy = self.lane_busy_ms.get(lane, ())
        return statistics.median(b / s for b, s in zip(busy, self.step_ms)) if busy else 0.0

    def table(self) -> str:
        """Short text form: the step and lanes, then one line per sub-model (ms)."""
        lanes = ", ".join(f"{lane} {self.busy_fraction(lane):.1%}" for lane in LANES)
        lines = [(f"{self.num_steps} steps of plan {self.plan_hash} on {self.device}, "
                  f"C={self.accum}: step {self.median_step_ms:.2f} ms (median); busy {lanes}"),
                 "  sub-model   fwd/mb   bwd/mb     load     ckpt  offload   update"]
        lines += [f"  P{s.index:<9d}{s.fwd_ms:8.3f} {s.bwd_ms:8.3f} {s.load_ms:8.3f} "
                  f"{s.checkpoint_ms:8.3f} {s.offload_ms:8.3f} {s.optimizer_ms:8.3f}"
                  for s in self.submodels]
        return "\n".join(lines)


def device_matches(planned: str, measured: str) -> bool:
    """Whether steps on `measured` time what a plan for `planned` predicts: the same CPU (its
    description names the thread count) or a GPU of the same name, whatever its index."""
    def key(name: str) -> str:
        kind, _, rest = name.partition(" ")
        return rest if kind.startswith("cuda") else name

    return planned.startswith(("cpu", "cuda")) and key(planned) == key(measured)


def check_device(planned: str, measured: str, what: str) -> None:
    if device_matches(planned, measured):
        return
    if not planned.startswith(("cpu", "cuda")):
        raise CalibrationError(
            f"{what} ran on {measured}, but the plan's times are estimated for {planned}; a "
            f"calibration corrects a profile measured on the device it runs on: profile on this "
            f"device (atomc profile --device ...), partition, generate, then calibrate")
    raise CalibrationError(
        f"{what} ran on {measured}, but the plan was made for {planned}; calibrate on the "
        f"plan's device (same GPU model, or the same CPU and torch thread count), or profile "
        f"and partition again on this one")


def check_losses(losses: tuple[float, ...] | list[float]) -> None:
    bad = [x for x in losses if not math.isfinite(x)]
    if bad:
        raise CalibrationError(f"a measured step gave a loss of {bad[0]}: a failed step times "
                               f"nothing a plan predicts; fix the run, then calibrate again")


class _Tally:
    """What `summarise` takes from the measured steps' events: per step, each lane's busy time
    and each sub-model's compute per micro-batch and other work; loads and the bytes copied."""

    def __init__(self, num_submodels: int, accum: int) -> None:
        k = self.k = num_submodels
        self.accum = accum
        self.busy: dict[str, list[float]] = {lane: [] for lane in LANES}
        self.compute: dict[tuple[int, str], list[float]] = {}
        self.per_step: dict[tuple[int, str], list[float]] = {}
        self.loads: list[list[float]] = [[] for _ in range(k)]
        self.load_bytes = [0] * k
        self.offload_bytes = [0] * k
        self.moved = {"h2d": [0, 0.0], "d2h": [0, 0.0]}  # bytes, ms

    def add(self, t: StepTrace) -> None:
        k = self.k
        lane_ms = dict.fromkeys(LANES, 0.0)
        sums: dict[tuple[int, str], float] = {}
        for e in t.events:
            d = e.end_ms - e.start_ms
            if not (math.isfinite(e.start_ms) and math.isfinite(e.end_ms)) or d < 0:
                raise CalibrationError(f"step {t.step + 1}: event {e.lane}/{e.kind} of "
                                       f"P{e.submodel} runs from {e.start_ms} to {e.end_ms} ms; "
                                       f"the trace is damaged: measure again")
            if e.submodel >= k:
                raise CalibrationError(f"step {t.step + 1} has events of sub-model {e.submodel}, "
                                       f"the plan has {k}: the trace is of another package")
            lane_ms[e.lane] = lane_ms.get(e.lane, 0.0) + d
            key = (e.submodel, e.kind)
            sums[key] = sums.get(key, 0.0) + d
            if e.kind in LOADS:
                self.loads[e.submodel].append(d)
                self.load_bytes[e.submodel] = max(self.load_bytes[e.submodel], e.num_bytes)
            elif e.kind == "offload":
                self.offload_bytes[e.submodel] = max(self.offload_bytes[e.submodel], e.num_bytes)
            # bandwidths from the weight and gradient copies the cost model prices by bytes;
            # checkpoints are many small copies, whose time is mostly latency
            if e.num_bytes > 0 and e.kind in LOADS:
                self.moved["h2d"][0] += e.num_bytes
                self.moved["h2d"][1] += d
            elif e.num_bytes > 0 and e.kind == "offload":
                self.moved["d2h"][0] += e.num_bytes
                self.moved["d2h"][1] += d
        for i in range(k):
            for kind in ("forward", "backward"):
                if (i, kind) not in sums:
                    raise CalibrationError(
                        f"step {t.step + 1}'s trace has no {kind} of sub-model {i}: it is not "
                        f"a step of this plan's schedule; measure the plan's package as "
                        f"generated")
                self.compute.setdefault((i, kind), []).append(sums[(i, kind)] / self.accum)
            for kind in ("checkpoint", "offload", "optimizer", "grad_prepare"):
                self.per_step.setdefault((i, kind), []).append(sums.get((i, kind), 0.0))
        for lane in LANES:
            self.busy[lane].append(lane_ms.get(lane, 0.0))


def summarise(traces: list[StepTrace], *, num_submodels: int, accum: int, activations: str,
              device: str, plan_hash: str, package: str = "", warmup_steps: int = 0,
              losses: tuple[float, ...] = (), steps: set[int] | None = None) -> Measurement:
    """Medians of consecutive traced steps; the last one only ends the one before it.

    `steps` picks the steps measured (by step number, each followed by the next one in
    `traces`); default: all but the last. Two disjoint picks of one run (even and odd steps)
    calibrate on one and check on the other under the same conditions."""
    traces = sorted(traces, key=lambda t: t.step)
    if len(traces) < 2:
        raise CalibrationError(f"{len(traces)} traced step(s): a step's time runs to the next "
                               f"step's start, so at least 2 are needed; measure more steps")
    for a, b in itertools.pairwise(traces):
        if b.step != a.step + 1:
            raise CalibrationError(f"traced steps {a.step + 1} and {b.step + 1} are not "
                                   f"consecutive; measure consecutive steps")
    check_losses(losses)
    k, c = num_submodels, accum
    pairs = [(a, b) for a, b in itertools.pairwise(traces) if steps is None or a.step in steps]
    if not pairs:
        raise CalibrationError(f"none of steps {sorted(steps or ())} is followed by a traced "
                               f"step; pick measured steps of the run")
    tally = _Tally(k, c)
    for a, _ in pairs:
        tally.add(a)
    compute, per_step = tally.compute, tally.per_step
    step_ms = [(b.host_start - a.host_start) * 1e3 for a, b in pairs]

    def med(xs: list[float]) -> float:
        return float(statistics.median(xs)) if xs else 0.0

    subs = tuple(
        MeasuredSubmodel(
            index=i, fwd_ms=med(compute[(i, "forward")]), bwd_ms=med(compute[(i, "backward")]),
            load_ms=med(tally.loads[i]), load_bytes=tally.load_bytes[i],
            checkpoint_ms=med(per_step[(i, "checkpoint")]),
            offload_ms=med(per_step[(i, "offload")]), offload_bytes=tally.offload_bytes[i],
            optimizer_ms=med([a + b for a, b in zip(per_step[(i, "optimizer")],
                                                    per_step[(i, "grad_prepare")])]))
        for i in range(k))

    def gbps(num_bytes: int, ms: float) -> float:
        return num_bytes / (ms * 1e6) if ms > 0 else 0.0  # bytes per ns is GB/s

    return Measurement(
        package=package, plan_hash=plan_hash, device=device, accum=c, activations=activations,
        warmup_steps=warmup_steps, step_ms=tuple(step_ms),
        lane_busy_ms={lane: tuple(v) for lane, v in tally.busy.items()}, losses=tuple(losses),
        submodels=subs, h2d_gbps=gbps(*tally.moved["h2d"]), d2h_gbps=gbps(*tally.moved["d2h"]))


def measure_package(package: str | Path, *, steps: int = 20, warmup: int = 3,
                    device: str | None = None, seed: int = 0, plan: Any = None,
                    batches: Callable[[int], Any] | None = None, data: str = "stdlib",
                    optimizer: dict[str, Any] | None = None,
                    ) -> tuple[Measurement, list[StepTrace]]:
    """Train `package` for `warmup` + `steps` + 1 traced steps and summarise the measured ones.

    `batches(step)` gives each step's batch (see SwapTrainer.step); by default byte-level text
    (`data`: "stdlib" or a text file) for a model with one integer input. `plan` is the Plan
    (or its JSON path) the package must have been generated from (default: its plan.json).
    Batches are made before the first step, so that the steps time training alone. Returns
    the measurement and the measured steps' traces (with the one that ends the last).
    """
    from atomc.data.text import text_batches
    from atomc.runtime import SwapTrainer

    if steps < 1:
        raise UsageError(f"--steps {steps}: measure 1 or more steps")
    if warmup < 0:
        raise UsageError(f"--warmup {warmup} must be 0 or more")
    trainer = SwapTrainer.from_package(package, device=device, seed=seed, plan=plan, trace=True,
                                       optimizer=optimizer)
    try:
        if trainer.plan is None:
            raise CalibrationError(f"{package} has no plan.json beside its code, so its plan is "
                                   f"unknown; give the plan it was generated from (--plan)")
        where = describe_device(trainer.device)
        check_device(trainer.plan.device, where, f"{package}")
        total = warmup + steps + 1
        trainer.executor.tracer.keep_last = total
        make = batches if batches is not None else text_batches(trainer, data, seed).batch
        inputs = [make(s) for s in range(trainer.step_count, trainer.step_count + total)]
        first = trainer.step_count
        losses = []
        for n, batch in enumerate(inputs):
            try:
                loss = trainer.step(batch)
            except AtomcError:
                raise
            except Exception as e:  # a failed step makes the measurement unusable
                why = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise CalibrationError(
                    f"step {n + 1} of {total} failed ({type(e).__name__}"
                    f"{': ' + why if why else ''}); a failed step measures nothing: make "
                    f"`atomc train` run this package, then calibrate again") from e
            if not math.isfinite(loss):
                raise CalibrationError(
                    f"step {n + 1} of {total} gave a loss of {loss}; a diverging run measures "
                    f"nothing a plan predicts: lower the learning rate (--lr) and calibrate "
                    f"again")
            losses.append(loss)
        traced = trainer.traces
        traces = [traced[s] for s in range(first + warmup, first + total)]
        measurement = summarise(
            traces, num_submodels=len(trainer.store.layouts), accum=trainer.accum,
            activations=trainer.executor.activations, device=where,
            plan_hash=trainer.package.plan_hash, package=str(package), warmup_steps=warmup,
            losses=tuple(losses))
    finally:
        trainer.close()
    return measurement, traces
