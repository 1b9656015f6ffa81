"""Which stages of a layout run swapped: each device's memory budget, each stage's bytes kept
resident (partition.stagemem, the rule `atomc compare` predicts layouts with), and the
decision every rank makes alike from the budgets of all devices.

A stage runs swapped when `swap_stages` names it or when, kept resident (weights, gradients,
AdamW moments and the activations of its micro-batches in flight), it does not fit its
device's memory budget. Any swapped stage makes the layout run GPipe, and the stages are
decided again for GPipe's micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atomc.actions import max_in_flight, pipeline_order
from atomc.errors import UsageError
from atomc.ir import Plan
from atomc.partition.stagemem import resident_stage_bytes
from atomc.units import format_bytes


def resident_need(plan: Plan, ranges, num_micro: int, stage: int,
                  schedule: str) -> tuple[int, int]:
    """(bytes, micro-batches in flight) of stage `stage`, over the plan's sub-models
    `ranges[stage]`, kept resident under `schedule` with `num_micro` micro-batches
    (stagemem.resident_stage_bytes: the rule `atomc compare` predicts layouts with)."""
    flight = max_in_flight(pipeline_order(schedule, num_micro, stage, len(ranges)))
    start, stop = ranges[stage]
    return resident_stage_bytes(plan, start, stop, flight), flight


@dataclass(frozen=True)
class DeviceBudget:
    """The device bytes one rank's stage may hold, and where that figure comes from."""

    device: str  # the layout's name of the device
    bytes: int | None  # None: no figure known
    source: str


def device_budget(device: str, configured: int | None, memory: int | None, source: str,
                  reserve: int) -> DeviceBudget:
    """A device's budget: the configured one as it is, else its `memory` (from `source`) less
    `reserve`; no figure when neither is known. A memory the reserve leaves nothing of is an
    error."""
    if configured is not None:
        return DeviceBudget(device, configured, "the configured memory budget")
    if memory is None:
        return DeviceBudget(device, None, "")
    if memory <= reserve:
        raise UsageError(f"device {device} has {format_bytes(memory)} ({source}), and "
                         f"the reserve of {format_bytes(reserve)} leaves nothing of it; give a "
                         f"smaller reserve (--memory-reserve) or a budget (--memory-budget)")
    return DeviceBudget(device, memory - reserve, f"{format_bytes(memory)} from {source}, less "
                                                  f"the reserve of {format_bytes(reserve)}")


@dataclass(frozen=True)
class SwapDecision:
    """Which stages run swapped, the schedule every stage runs, and why (one line a stage)."""

    swapped: frozenset[int]
    schedule: str
    reasons: tuple[str, ...]  # per stage

    def lines(self, configured: str) -> list[str]:
        out = [f"stage {j} {'swapped' if j in self.swapped else 'resident'}: {why}"
               for j, why in enumerate(self.reasons)]
        if self.schedule != configured:
            out.append(f"schedule {self.schedule} instead of {configured}: a swapped stage runs "
                       f"every micro-batch through each sub-model in turn, which only GPipe's "
                       f"neighbours wait for")
        return out


def decide_swaps(schedule: str, budgets: list[list[DeviceBudget]], forced: tuple[int, ...],
                 need: Callable[[int, str], tuple[int, int]]) -> SwapDecision:
    """The stages that run swapped and the schedule that runs.

    `budgets[j]`: the budgets of the devices of stage j's replicas; `need(j, schedule)`: the
    bytes stage j needs resident under `schedule`, and its micro-batches in flight. A stage
    swaps, on every replica (their gradients are reduced as one flat buffer, in the order its
    kind of stage keeps them), when `forced` names it or it does not fit one replica's budget.
    A swapped stage makes the layout run GPipe, where a resident stage holds every micro-batch
    in flight, more than under 1F1B: the stages are then decided again under GPipe, so that
    a stage that fits 1F1B but not GPipe swaps too. The swapped set only grows and the
    schedule changes at most once, so this settles.
    """
    why: dict[int, str] = dict.fromkeys(forced, "named in swap_stages")
    swapped = set(forced)
    while True:
        for j, devices in enumerate(budgets):
            if j in swapped:
                continue
            known = [b for b in devices if b.bytes is not None]
            if not known:
                names = ", ".join(b.device for b in devices)
                why[j] = (f"no memory budget for {names} (give --memory-budget, or --network "
                          f"with the devices' memory_bytes)")
                continue
            tight = min(known, key=lambda b: b.bytes)
            nbytes, flight = need(j, schedule)
            over = nbytes > tight.bytes
            if over:
                swapped.add(j)
            why[j] = (f"needs {format_bytes(nbytes)} resident with {flight} micro-batch(es) in "
                      f"flight under {schedule}, {'over' if over else 'within'} {tight.device}'s "
                      f"budget of {format_bytes(tight.bytes)} ({tight.source})")
        if not swapped or schedule == "gpipe":
            return SwapDecision(frozenset(swapped), schedule,
                                tuple(why[j] for j in range(len(budgets))))
        schedule = "gpipe"


__all__ = ["DeviceBudget", "SwapDecision", "decide_swaps", "device_budget", "resident_need"]
