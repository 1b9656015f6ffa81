"""Cost formulas of the partition stage (Profile -> Plan): one run's costs of a sub-model, and the
step time the search adds up from them.

A sub-model is a node range [start, stop) of the profile's graph; `atomc.partition.tables` holds
its C-independent quantities. For the swap schedule (docs/design.md, sections "Partition:
Algorithm 1, exact" and "Runtime: one core for every way of training"; ATOM Fig. 12) each range
needs, for C micro-batches (`derive` over all ranges, `plan_costs` for a plan's):

- forward and backward time of one micro-batch; with activations="recompute" the backward
  repeats the forward first, except in the last sub-model, which runs forward and backward
  per micro-batch and keeps the autograd graph in between (as the runtime does);
- working memory for C micro-batches: every value crossing the range's start cut (inputs and
  pass-through values) and every value it produces for later ranges, for all C micro-batches,
  plus one micro-batch's transient peak (and, when recomputing, one micro-batch's saved
  activations during the backward). With activations="keep" the runtime keeps every
  sub-model's autograd graphs on the device from its forward to its backward, so a range's
  forward and backward also hold all C micro-batches' saved activations of every range before
  it and its own: the memory depends on where the range starts (`RangeTables.saved_prefix`);
- transfer times: parameters host-to-device before its forward and again before its
  backward; when recomputing, its C micro-batches' checkpoints (its inputs) streamed in during
  its own backward, one micro-batch ahead (the last sub-model keeps them: it never leaves;
  nothing streams when keeping); gradients device-to-host after its backward; the CPU
  optimizer over fp32 masters. The forward's checkpoint copies to the host ride the otherwise
  idle device-to-host lane and are not modelled.

The step's handover at the step boundary (`handover_tail`, `first_pair`) and its additive sum
(`additive_step_ns`) are here too; the constraints a plan must meet are in
`atomc.partition.constraints`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atomc.errors import UsageError
from atomc.ir import Profile
from atomc.partition.memo import once_per_object
from atomc.partition.tables import RangeTables
from atomc.units import ms_to_ns

ACTIVATIONS = ("recompute", "keep")
# CPU AdamW throughput in GB/s of fp32 master bytes; a vectorised multi-threaded AdamW on a
# server CPU updates about 2e9 parameters a second. An assumption: override per run.
DEFAULT_CPU_ADAM_GBPS = 8.0


def transfer_ns(num_bytes, gbps: float):
    """Copy time of `num_bytes` at `gbps` GB/s, in ns (bytes / (GB/s) = ns). Works on arrays."""
    if gbps <= 0 or math.isinf(gbps):
        return np.zeros_like(np.asarray(num_bytes, dtype=np.int64))
    return np.rint(np.asarray(num_bytes, dtype=np.float64) / gbps).astype(np.int64)


@dataclass(frozen=True)
class CostParams:
    """What turns C-independent range facts into one run's costs."""

    accum: int
    usable_bytes: int  # capacity minus reserve
    h2d_gbps: float
    d2h_gbps: float
    cpu_adam_gbps: float = DEFAULT_CPU_ADAM_GBPS  # 0 or inf: the optimizer is not modelled
    activations: str = "recompute"
    # a sub-model's update beyond its bytes: fixed, and per parameter tensor (the profile's
    # RuntimeCosts; 0 when not measured)
    update_ns: int = 0
    update_tensor_ns: int = 0
    # on a CPU device, the runtime's own time inside each forward and each backward of a
    # sub-model (one micro-batch), beyond its operators' (RuntimeCosts; 0 when not measured)
    call_fwd_ns: int = 0
    call_bwd_ns: int = 0
    # the runtime's slots are sized for the largest sub-model (constraints.slot_bytes): with a
    # cap, every range's parameters stay within it and its working memory fits beside 2 x 2
    # slots of it
    # (0: no cap; the search then checks neighbours in pairs only)
    slot_cap_bytes: int = 0

    def __post_init__(self) -> None:
        if self.accum < 1:
            raise UsageError(f"accumulation degree {self.accum} must be 1 or more")
        if self.activations not in ACTIVATIONS:
            raise UsageError(f"activations {self.activations!r}: expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        if not self.h2d_gbps > 0 or not self.d2h_gbps > 0:
            raise UsageError(f"host-device bandwidths must be positive (got H2D {self.h2d_gbps} "
                             f"GB/s, D2H {self.d2h_gbps} GB/s); check the profile")


@dataclass(frozen=True)
class CostTables:
    """One run's per-range costs; arrays shaped like the tables (or scalars for one range)."""

    fwd_ns: np.ndarray  # C micro-batches
    bwd_ns: np.ndarray  # C micro-batches, recomputation included
    load_fwd_ns: np.ndarray  # parameters H2D (before its forward, and again before its backward
    # unless the next sub-model is the last)
    checkpoint_ns: np.ndarray  # its C micro-batches' checkpoints H2D, during its own backward
    # (0 when keeping activations: the autograd graphs hold them on the device)
    offload_ns: np.ndarray  # gradients D2H
    optimizer_ns: np.ndarray  # CPU AdamW
    tail_ns: np.ndarray  # first sub-model only: offload + optimizer + refresh its parameters
    param_bytes: np.ndarray
    grad_bytes: np.ndarray
    mem_fwd_bytes: np.ndarray  # resident + forward working memory
    mem_bwd_bytes: np.ndarray  # resident + gradients + backward working memory
    ok: np.ndarray | None = field(default=None)  # unary feasibility (tables only)
    # working memory beside the runtime's slots: the larger of the forward's and the
    # backward's, its own parameters and gradients left out (tables only)
    work_bytes: np.ndarray | None = field(default=None)
    slots_per_cap: np.ndarray | None = field(default=None)  # 4, or 2 for the whole graph


def optimizer_ns(p: CostParams, master_bytes, num_masters):
    """CPU update time of ranges with these fp32 master bytes and parameter tensors: bytes at
    the update rate, plus the update's fixed and per-tensor costs (a range that owns no
    parameter has no update; with the optimizer not modelled, nothing)."""
    by_bytes = transfer_ns(master_bytes, p.cpu_adam_gbps)
    if p.cpu_adam_gbps <= 0 or math.isinf(p.cpu_adam_gbps):
        return by_bytes
    masters = np.asarray(num_masters, dtype=np.int64)
    return by_bytes + np.where(masters > 0, p.update_ns + p.update_tensor_ns * masters, 0)


def runtime_params(profile: Profile) -> dict[str, int]:
    """CostParams' fields for the runtime's own costs that `profile` measured (none: 0)."""
    rt = profile.runtime
    if rt is None:
        return {}
    return {"update_ns": ms_to_ns(rt.update_ms),
            "update_tensor_ns": ms_to_ns(rt.update_tensor_ms),
            "call_fwd_ns": ms_to_ns(rt.forward_ms or 0.0),
            "call_bwd_ns": ms_to_ns(rt.backward_ms or 0.0)}


def one_micro_batch(p: CostParams, fwd, bwd, is_last):
    """A sub-model's forward and backward of one micro-batch from its operators' times: the
    backward recomputes the forward, but where activations are kept and in the last
    sub-model (it keeps each micro-batch's autograd graph from its forward to its backward:
    F and B alternate there); each also costs the runtime's own time per call."""
    back = bwd if p.activations == "keep" else np.where(is_last, bwd, bwd + fwd)
    return fwd + p.call_fwd_ns, back + p.call_bwd_ns


def link_costs(p: CostParams, params, grads, master, masters) -> tuple:
    """(load, offload, update) ns of ranges: what no C changes."""
    return (transfer_ns(params, p.h2d_gbps), transfer_ns(grads, p.d2h_gbps),
            optimizer_ns(p, master, masters))


def derive_values(p: CostParams, *, fwd, bwd, saved, params, grads, master, masters, inb, outb,
                  extra_fwd, extra_bwd, cut_start, saved_before, is_last,
                  links: tuple | None = None) -> CostTables:
    """The C-dependent formulas, shared by the whole-table and the single-range paths
    (`links`: link_costs of the same ranges, where the caller holds them)."""
    c = np.int64(p.accum)
    one_fwd, one_bwd = one_micro_batch(p, fwd, bwd, is_last)
    fwd_c, bwd_c = c * one_fwd, c * one_bwd
    boundary = c * (cut_start + outb)
    if p.activations == "keep":
        # the graphs of this range and of every range before it, C micro-batches each, stay
        # on the device until their backward; nothing streams back in
        kept = c * (saved_before + saved)
        mem_fwd = params + boundary + extra_fwd + kept
        mem_bwd = params + grads + boundary + kept + extra_bwd
        checkpoint = np.zeros_like(np.asarray(inb))
    else:
        mem_fwd = params + boundary + extra_fwd
        mem_bwd = params + grads + boundary + saved + extra_bwd
        checkpoint = np.where(is_last, 0, c * inb)
    load_fwd, offload, optimizer = links or link_costs(p, params, grads, master, masters)
    return CostTables(
        fwd_ns=fwd_c, bwd_ns=bwd_c, load_fwd_ns=load_fwd,
        checkpoint_ns=transfer_ns(checkpoint, p.h2d_gbps),
        offload_ns=offload, optimizer_ns=optimizer, tail_ns=offload + optimizer + load_fwd,
        param_bytes=np.asarray(params), grad_bytes=np.asarray(grads),
        mem_fwd_bytes=np.asarray(mem_fwd), mem_bwd_bytes=np.asarray(mem_bwd),
    )


def derive(tables: RangeTables, p: CostParams) -> CostTables:
    t = tables
    cut_start = t.cut_bytes[:-1, None]
    # what no C changes, once per tables: a partition derives them at several C
    links = once_per_object(
        t, ("links", p.h2d_gbps, p.d2h_gbps, p.cpu_adam_gbps, p.update_ns, p.update_tensor_ns),
        lambda: link_costs(p, t.param_bytes, t.grad_bytes, t.master_bytes, t.num_masters))
    is_last = once_per_object(t, "is_last", lambda: (
        np.arange(t.num_nodes)[:, None] + np.arange(t.max_width + 1)[None, :] == t.num_nodes))
    may_cut = once_per_object(t, "may_cut", lambda: t.valid & t.start_ok & t.end_ok)
    d = derive_values(p, fwd=t.fwd_ns, bwd=t.bwd_ns, saved=t.saved_bytes, params=t.param_bytes,
                      grads=t.grad_bytes, master=t.master_bytes, masters=t.num_masters,
                      inb=t.in_bytes, outb=t.out_bytes,
                      extra_fwd=t.extra_fwd_bytes, extra_bwd=t.extra_bwd_bytes, cut_start=cut_start,
                      saved_before=t.saved_prefix[:-1, None], is_last=is_last, links=links)
    ok = may_cut & (d.mem_fwd_bytes <= p.usable_bytes) & (d.mem_bwd_bytes <= p.usable_bytes)
    work = np.maximum(d.mem_fwd_bytes - d.param_bytes,
                      d.mem_bwd_bytes - d.param_bytes - d.grad_bytes)
    # the runtime holds two weight and two gradient slots; with one sub-model, one of each
    per_cap = np.full(ok.shape, 4, dtype=np.int64)
    if t.max_width >= t.num_nodes:
        per_cap[0, t.num_nodes] = 2
    d = CostTables(**{**d.__dict__, "ok": ok, "work_bytes": work, "slots_per_cap": per_cap})
    if p.slot_cap_bytes > 0:
        d = with_slot_cap(d, p.slot_cap_bytes, p.usable_bytes)
    return d


def with_slot_cap(d: CostTables, cap: int, usable_bytes: int) -> CostTables:
    """`d` (derive's) with only the ranges that can be sub-models of a plan whose largest
    sub-model holds at most `cap` bytes: the runtime's slots are sized for that largest one
    and held all step (constraints.slot_bytes), so every sub-model's working memory must fit
    beside them."""
    ok = (d.ok & (d.param_bytes <= cap)
          & (d.work_bytes + d.slots_per_cap * np.int64(cap) <= usable_bytes))
    return dataclasses.replace(d, ok=ok)


def slot_fits(d: CostTables, usable_bytes: int) -> np.ndarray:
    """Ranges that can be the largest sub-model of a plan: their own slots leave room for their
    working memory (every cap worth trying is the parameter bytes of such a range)."""
    return d.ok & (d.slots_per_cap * d.param_bytes + d.work_bytes <= usable_bytes)


@dataclass(frozen=True)
class RangeCost:
    """One sub-model's costs for one run (ints: ns and bytes)."""

    start: int
    stop: int
    fwd_ns: int  # one micro-batch, the runtime's own time per call included
    bwd_ns: int  # one micro-batch, recomputation and the runtime's own time included
    accum_fwd_ns: int  # C micro-batches
    accum_bwd_ns: int
    load_fwd_ns: int
    checkpoint_ns: int
    offload_ns: int
    optimizer_ns: int
    param_bytes: int
    grad_bytes: int
    mem_fwd_bytes: int
    mem_bwd_bytes: int
    in_bytes: int
    out_bytes: int


def _gather(tables: RangeTables, p: CostParams, starts: np.ndarray,
            stops: np.ndarray) -> list[RangeCost]:
    t = tables
    w = stops - starts
    if len(w) and (w.min() < 1 or w.max() > t.max_width or starts.min() < 0
                   or stops.max() > t.num_nodes):
        raise ValueError(f"ranges outside the tables (max width {t.max_width})")
    fwd, bwd = t.fwd_ns[starts, w], t.bwd_ns[starts, w]
    d = derive_values(
        p, fwd=fwd, bwd=bwd, saved=t.saved_bytes[starts, w], params=t.param_bytes[starts, w],
        grads=t.grad_bytes[starts, w], master=t.master_bytes[starts, w],
        masters=t.num_masters[starts, w],
        inb=t.in_bytes[starts, w], outb=t.out_bytes[starts, w],
        extra_fwd=t.extra_fwd_bytes[starts, w], extra_bwd=t.extra_bwd_bytes[starts, w],
        cut_start=t.cut_bytes[starts], saved_before=t.saved_prefix[starts],
        is_last=stops == t.num_nodes)
    one_fwd, one_bwd = one_micro_batch(p, fwd, bwd, stops == t.num_nodes)
    cols = [starts, stops, one_fwd, one_bwd, d.fwd_ns, d.bwd_ns, d.load_fwd_ns, d.checkpoint_ns,
            d.offload_ns, d.optimizer_ns, d.param_bytes, d.grad_bytes, d.mem_fwd_bytes,
            d.mem_bwd_bytes, t.in_bytes[starts, w], t.out_bytes[starts, w]]
    rows = zip(*(np.broadcast_to(np.asarray(c, dtype=np.int64), w.shape).tolist() for c in cols))
    return [RangeCost(start=a, stop=b, fwd_ns=f1, bwd_ns=b1, accum_fwd_ns=fc, accum_bwd_ns=bc,
                      load_fwd_ns=load, checkpoint_ns=ckpt, offload_ns=off, optimizer_ns=opt,
                      param_bytes=par, grad_bytes=grad, mem_fwd_bytes=mem_f, mem_bwd_bytes=mem_b,
                      in_bytes=inb, out_bytes=outb)
            for (a, b, f1, b1, fc, bc, load, ckpt, off, opt, par, grad, mem_f, mem_b, inb, outb)
            in rows]


def range_cost(tables: RangeTables, p: CostParams, start: int, stop: int) -> RangeCost:
    """Costs of [start, stop) from the tables (the range must be at most max_width wide)."""
    return _gather(tables, p, np.array([start]), np.array([stop]))[0]


def plan_costs(tables: RangeTables, p: CostParams,
               cuts: list[int] | tuple[int, ...]) -> list[RangeCost]:
    bounds = np.array([0, *cuts, tables.num_nodes], dtype=np.int64)
    return _gather(tables, p, bounds[:-1], bounds[1:])


@dataclass(frozen=True)
class PairSide:
    """One side of the step boundary's handover (`handover_tail`, `first_pair`): a sub-model's
    terms, ints or arrays alike (times of C micro-batches)."""

    fwd_ns: Any  # F
    bwd_ns: Any  # B, recomputation included
    checkpoint_ns: Any  # K
    offload_ns: Any  # O
    optimizer_ns: Any  # A
    load_ns: Any  # L
    param_bytes: Any
    grad_bytes: Any

    @classmethod
    def of_tables(cls, d: CostTables, start, width) -> PairSide:
        """The ranges [start, start + width) of the tables (indices or arrays of them)."""
        return cls(d.fwd_ns[start, width], d.bwd_ns[start, width],
                   d.checkpoint_ns[start, width], d.offload_ns[start, width],
                   d.optimizer_ns[start, width], d.load_fwd_ns[start, width],
                   d.param_bytes[start, width], d.grad_bytes[start, width])

    @classmethod
    def of_cost(cls, c: RangeCost) -> PairSide:
        return cls(c.accum_fwd_ns, c.accum_bwd_ns, c.checkpoint_ns, c.offload_ns,
                   c.optimizer_ns, c.load_fwd_ns, c.param_bytes, c.grad_bytes)


def handover_tail(p0: PairSide, p1: PairSide, last1):
    """P_0's update tail at the step boundary, and what P_1's early load waits for.

    Both are measured from the end of P_0's backward (which lasts max(B_0, K_0): it cannot
    end before its checkpoints are in). P_1's gradients started leaving S + max(B_0, K_0)
    before that, where S = max(B_1, K_1 + L_0) - max(B_1, K_1) is the stall before P_0's
    backward (P_0 reloads during P_1's backward; when P_1 is the last sub-model, `last1`, P_0
    is still in its slot and S = 0). One copy engine each way and one CPU lane, in list order:

        tail = max(max(0, O_1 - S - max(B_0, K_0)) + O_0,  O_1 + A_1 - S - max(B_0, K_0)) + A_0
        wait = max(0, O_1 + A_1 - S - max(B_0, K_0)) + L_1

    P_0's gradients leave once P_1's have left, and the CPU updates P_0 once it has updated
    P_1. When P_1's offload and update are hidden behind P_0's backward and offload (O_1 <=
    B_0 and O_1 + A_1 <= B_0 + O_0), tail = O_0 + A_0. Otherwise the GPU, which waits for P_0's
    update and refresh at the step boundary anyway, waits that much longer: the handover
    prices it exactly (the simulator's step), rather than forbidding it as a constraint.
    Works elementwise on arrays."""
    reload0 = np.where(last1, 0, p0.load_ns)
    stall = (np.maximum(p1.bwd_ns, p1.checkpoint_ns + reload0)
             - np.maximum(p1.bwd_ns, p1.checkpoint_ns))
    lead = np.maximum(p0.bwd_ns, p0.checkpoint_ns) + stall
    update1_end = p1.offload_ns + p1.optimizer_ns - lead
    tail = (np.maximum(np.maximum(p1.offload_ns - lead, 0) + p0.offload_ns, update1_end)
            + p0.optimizer_ns)
    wait = np.maximum(update1_end, 0) + p1.load_ns
    return tail, wait


def first_pair(p0: PairSide, p1: PairSide, *, last1, tier: int, usable_bytes):
    """The two ways the first sub-model P_0 (left) can hand over to P_1 (right).

    Times are of C micro-batches (CostTables', a RangeCost's accum_*): F forward, B backward,
    K checkpoint stream, O gradient offload, A CPU optimizer, L parameter load; the suffix 0
    or 1 names the sub-model. T is P_0's update tail (`handover_tail`: O_0 + A_0 when P_1's
    offload and update keep pace with P_0's backward, longer by what they overrun).

    late:  P_1 loads during P_0's forward; after P_0's backward its gradients go out, the CPU
           updates it and its parameters are refreshed:  max(F_0, L_1) + T + L_0.
    early: P_1's parameters for the next step load during that update tail (the H2D lane is
           idle then), once P_1's own update is done, so P_0's next forward hides nothing:
           F_0 + max(T, max(0, O_1 + A_1 - max(B_0, K_0) - S) + L_1) + L_0, if P_0's
           parameters and outgoing gradients and P_1's parameters fit together (S: see
           `handover_tail`).

    Returns (late_term, late_ok, early_term, early_ok); works elementwise on arrays. In tier 0
    the late way must hide the load behind the forward (F_0 >= L_1) and the early way behind
    the tail; tiers 1 and 2 let loads stall.
    """
    tail, wait = handover_tail(p0, p1, last1)
    late = np.maximum(p0.fwd_ns, p1.load_ns) + tail + p0.load_ns
    early = p0.fwd_ns + np.maximum(tail, wait) + p0.load_ns
    early_ok = p0.param_bytes + p0.grad_bytes + p1.param_bytes <= usable_bytes
    if tier == 0:
        late_ok = p0.fwd_ns >= p1.load_ns
        early_ok = early_ok & (wait <= tail)
    else:
        late_ok = np.ones_like(early_ok)
    return late, late_ok, early, early_ok


def additive_step_ns(costs: list[RangeCost], early_prefetch: bool = False) -> int:
    """Step time as the search adds it up: pair terms plus the ends (see search.py).

    Equal to the simulator's step whenever the gradient-offload and optimizer constraints
    hold (between P_1 and P_0 they need not: the handover prices what those lanes overrun);
    the search's fallback tier minimises an estimate built on it when they cannot.
    """
    first = costs[0]
    total = costs[-1].accum_fwd_ns + max(first.accum_bwd_ns, first.checkpoint_ns)
    if len(costs) == 1:
        return total + first.offload_ns + first.optimizer_ns + first.load_fwd_ns
    second = costs[1]
    late, _, early, _ = first_pair(PairSide.of_cost(first), PairSide.of_cost(second),
                                   last1=len(costs) == 2, tier=1, usable_bytes=0)
    total += int(early if early_prefetch else late)
    for i, (left, right) in enumerate(itertools.pairwise(costs)):
        if i:
            total += max(left.accum_fwd_ns, right.load_fwd_ns)
        total += max(right.accum_bwd_ns, right.checkpoint_ns + backward_load_ns(left, right, costs))
    return total


def backward_load_ns(left: RangeCost, right: RangeCost, costs: list[RangeCost]) -> int:
    """What the H2D lane loads for `left` while `right` runs its backward: left's parameters,
    unless right is the last sub-model: then left (P_{k-2}) is still in its slot from its
    forward, and nothing is loaded."""
    return 0 if right is costs[-1] else left.load_fwd_ns


def first_tail(costs: list[RangeCost]) -> tuple[int, int]:
    """A plan's handover_tail: P_0's update tail and P_1's early-load wait (k > 1)."""
    first, second = costs[0], costs[1]
    tail, wait = handover_tail(PairSide.of_cost(first), PairSide.of_cost(second),
                               last1=len(costs) == 2)
    return int(tail), int(wait)


def range_stage_times(costs: list[RangeCost]):
    """The simulator's input for a plan's ranges (atomc.simulate.stage_times reads a Plan's)."""
    from atomc.simulate.events import StageTimes

    return [StageTimes(fwd_ns=c.accum_fwd_ns, bwd_ns=c.accum_bwd_ns, load_ns=c.load_fwd_ns,
                       checkpoint_ns=c.checkpoint_ns, offload_ns=c.offload_ns,
                       optimizer_ns=c.optimizer_ns)
            for c in costs]
