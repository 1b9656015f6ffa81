"""An independent checker for plans: Profile + Plan -> the constraints a plan breaks.

It shares no code with cost.py or search.py: it walks the graph node by node with plain
Python sets and sums, recomputes every sub-model's bytes and times from the profile, and tests
the constraints of docs/design.md, section "Partition: Algorithm 1, exact", as the search
states them (see search.py's docstring):

    memory     forward  mem_fwd(P_i) + params(P_{i+1})           <= M
               backward mem_bwd(P_{i+1}) + params(P_i)           <= M
                        mem_bwd(P_i) + grads(P_{i+1})            <= M
               alone    mem_fwd(P_i) <= M,  mem_bwd(P_i) <= M
               early handover: params(P_0) + grads(P_0) + params(P_1) <= M
               slots    4 * max_j params(P_j) + mem(P_i) - params(P_i) (- grads(P_i) in
                        the backward) <= M: the runtime holds two weight and two gradient
                        slots sized for the largest sub-model (2 * 1 with one sub-model)
    overlap    forward  C*t_fwd(P_i) >= t_load(P_{i+1})   (P_0 with the early handover:
                        its update tail hides P_1's update wait and load)
               backward C*t_bwd(P_i) >= t_ckpt(P_i) + t_load(P_{i-1})   (P_0: >= t_ckpt(P_0);
                        P_{k-1}: >= t_ckpt, P_{k-2} is still in its slot)
    gradients  C*t_bwd(P_i) >= t_offload(P_{i+1})                         (i >= 1)
    optimizer  C*t_bwd(P_i) + t_offload(P_i) >= t_offload(P_{i+1}) + t_adam(P_{i+1})   (i >= 1)

Between P_1 and P_0 the last two are no constraints: P_0's update tail at the step boundary
waits for what P_1's offload and update overrun, and the step prices that wait (P_0's update
tail, `update_tail`, written out here again from the lanes' order).

with mem_fwd = params + C*(values crossing its start cut + values it passes on) + largest
single-node forward transient, mem_bwd = params + grads + the same boundary + one
micro-batch's saved activations + largest backward transient. When keeping activations, both
hold C micro-batches' saved activations of this sub-model and of every one before it instead
(the runtime keeps their autograd graphs on the device until their backward), and no
checkpoints stream in. It also checks the plan's structure and the numbers it records. Bytes
are the device's at the plan's transfer and autocast dtypes
(atomc.partition.precision.device_view, which the cost model reads too).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from atomc.ir import Plan, Profile, Submodel
from atomc.partition.cost import runtime_params
from atomc.partition.precision import Precision, device_view, model_dtype
from atomc.partition.tables import node_sides_ms

NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class Violation:
    submodel: int  # -1 for the plan as a whole
    constraint: str
    message: str


@dataclass(frozen=True)
class RangeFacts:
    """One range's costs, recomputed from the profile (ints: ns and bytes)."""

    start: int
    stop: int
    fwd_ns: int  # C micro-batches
    bwd_ns: int  # C micro-batches, recomputation included (but in the last range)
    load_ns: int
    checkpoint_ns: int
    offload_ns: int
    adam_ns: int
    param_bytes: int
    grad_bytes: int
    mem_fwd_bytes: int
    mem_bwd_bytes: int
    crossing_out: tuple[str, ...]  # names of values crossing the cut after the range


def _copy_ns(num_bytes: int, gbps: float) -> int:
    if gbps <= 0 or math.isinf(gbps):
        return 0
    return round(num_bytes / gbps)


class Checker:
    """Recomputes range facts from a profile; `range_facts` is usable on any cut set."""

    def __init__(self, profile: Profile, accum: int, usable_bytes: int, activations: str,
                 cpu_adam_gbps: float):
        self.profile = profile
        self.accum = accum
        self.usable = usable_bytes
        self.keep = activations == "keep"
        self.cpu = cpu_adam_gbps
        # the runtime's own time in each call: on a CPU device, where the profile measured it
        own = runtime_params(profile)
        self.call_fwd_ns = own.get("call_fwd_ns", 0)
        self.call_bwd_ns = own.get("call_bwd_ns", 0)
        g = profile.graph
        self.nodes = g.nodes
        self.costs = profile.costs
        self.index = {n.name: i for i, n in enumerate(g.nodes)}
        self.readers: dict[str, list[int]] = {n.name: [] for n in g.nodes}
        for i, n in enumerate(g.nodes):
            for src in n.inputs:
                self.readers[src].append(i)
        self.value_bytes = {n.name: sum(o.num_bytes for o in n.outputs) for n in g.nodes}
        self.last_read = {name: max(rs, default=-1) for name, rs in self.readers.items()}
        self._names = [n.name for n in g.nodes]
        self._last_reads = np.array([self.last_read[n.name] for n in g.nodes], dtype=np.int64)
        self.params = g.params
        self.buffers = g.buffers
        self.frozen = set(g.frozen or ())
        # a tied weight's master and optimizer state live in its first holder (runtime.store)
        self.owner: dict[str, int] = {}
        for i, n in enumerate(g.nodes):
            for f in n.param_fqns:
                self.owner.setdefault(f, i)

    def _update_ns(self, master_bytes: int, num_masters: int) -> int:
        """Bytes at the update rate, plus the runtime's fixed and per-tensor update costs."""
        ns = _copy_ns(master_bytes, self.cpu)
        rt = self.profile.runtime
        if rt is None or not num_masters or self.cpu <= 0 or math.isinf(self.cpu):
            return ns
        return (ns + round(rt.update_ms * NS_PER_MS)
                + num_masters * round(rt.update_tensor_ms * NS_PER_MS))

    def crossing(self, q: int) -> list[str]:
        """Values produced before node q and read at q or later."""
        return [self._names[i] for i in np.flatnonzero(self._last_reads[:q] >= q)]

    def range_facts(self, start: int, stop: int) -> RangeFacts:
        c = self.accum
        nodes = self.nodes[start:stop]
        costs = self.costs[start:stop]
        fqns = set()
        for n in nodes:
            fqns.update(n.param_fqns)
            fqns.update(n.buffer_fqns)
        param_bytes = sum((self.params.get(f) or self.buffers[f]).num_bytes for f in fqns)
        # frozen weights: no gradient, offload or update
        trains = [f for f in fqns if f in self.params and f not in self.frozen]
        grad_bytes = sum(self.params[f].num_bytes for f in trains)
        owned = [f for f in trains if start <= self.owner[f] < stop]
        master_bytes = sum(4 * math.prod(self.params[f].shape) for f in owned)
        num_masters = len(owned)
        # the device's and the host's sides summed apart; the range takes the longer
        sides = [sum(round(ms * NS_PER_MS) for ms in side)
                 for side in zip(*(node_sides_ms(k) for k in costs))] or [0, 0, 0, 0]
        fwd, bwd = max(sides[0], sides[2]), max(sides[1], sides[3])
        last = stop == len(self.nodes)
        one_fwd = fwd + self.call_fwd_ns
        one_bwd = (bwd if self.keep or last else bwd + fwd) + self.call_bwd_ns
        saved = sum(k.saved_bytes for k in costs)
        kept = c * (saved + sum(k.saved_bytes for k in self.costs[:start])) if self.keep else 0
        extra_fwd = extra_bwd = 0
        for n, k in zip(nodes, costs):
            own = sum((self.params.get(f) or self.buffers[f]).num_bytes
                      for f in set(n.param_fqns) | set(n.buffer_fqns))
            own_grad = sum(self.params[f].num_bytes for f in set(n.param_fqns)
                           if f in self.params and f not in self.frozen)
            extra_fwd = max(extra_fwd, k.peak_fwd_bytes - own)
            extra_bwd = max(extra_bwd, k.peak_bwd_bytes - own - own_grad)
        cross_in = self.crossing(start)
        cross_out = self.crossing(stop)
        in_bytes = sum(self.value_bytes[name] for name in cross_in
                       if any(start <= r < stop for r in self.readers[name]))
        produced_out = sum(self.value_bytes[n.name] for n in nodes
                           if any(r >= stop for r in self.readers[n.name]))
        boundary = c * (sum(self.value_bytes[name] for name in cross_in) + produced_out)
        mem_fwd = param_bytes + boundary + extra_fwd + kept
        mem_bwd = param_bytes + grad_bytes + boundary + (kept if self.keep else saved) + extra_bwd
        checkpoint = 0 if last or self.keep else c * in_bytes
        return RangeFacts(
            start=start, stop=stop, fwd_ns=c * one_fwd,
            bwd_ns=c * one_bwd,  # the last one keeps its graph: no recomputation
            load_ns=_copy_ns(param_bytes, self.profile.h2d_gbps),
            checkpoint_ns=_copy_ns(checkpoint, self.profile.h2d_gbps),
            offload_ns=_copy_ns(grad_bytes, self.profile.d2h_gbps),
            adam_ns=self._update_ns(master_bytes, num_masters),
            param_bytes=param_bytes, grad_bytes=grad_bytes, mem_fwd_bytes=mem_fwd,
            mem_bwd_bytes=mem_bwd, crossing_out=tuple(cross_out),
        )

    def with_policy(self, facts: list[RangeFacts], subs: Sequence[Submodel]) -> list[RangeFacts]:
        """activations="auto": each range's costs with the plan's kept and sent operators,
        from the profile: their forward time leaves the recomputation; kept outputs stay on
        the device through every later range, sent ones come back for the range's backward."""
        c = self.accum
        held = 0
        out = []
        for f, s in zip(facts, subs):
            kept = [self.index[n] for n in s.kept]
            sent = [self.index[n] for n in s.sent]
            saving = sum(round(node_sides_ms(self.costs[j])[0] * NS_PER_MS)
                         for j in (*kept, *sent))
            held += c * sum(self.costs[j].output_bytes for j in kept)
            extra = held + c * sum(self.costs[j].output_bytes for j in sent)
            fetch = _copy_ns(c * sum(self.costs[j].output_bytes for j in sent),
                             self.profile.h2d_gbps)
            out.append(dataclasses.replace(
                f, bwd_ns=f.bwd_ns - c * saving, checkpoint_ns=f.checkpoint_ns + fetch,
                mem_fwd_bytes=f.mem_fwd_bytes + extra, mem_bwd_bytes=f.mem_bwd_bytes + extra))
        return out

    def violations(self, cuts: list[int], early_prefetch: bool = False) -> list[Violation]:
        bounds = [0, *cuts, len(self.nodes)]
        facts = [self.range_facts(a, b) for a, b in itertools.pairwise(bounds)]
        return self.check_facts(facts, early_prefetch)

    def check_facts(self, facts: list[RangeFacts], early_prefetch: bool = False) -> list[Violation]:
        out = []
        m = self.usable

        def need(i: int, what: str, num_bytes: int) -> None:
            if num_bytes > m:
                out.append(Violation(i, "memory", f"{what}: {num_bytes} bytes > {m}"))

        # the runtime's weight and gradient slots: two of each, sized for the largest
        slots = min(2, len(facts)) * 2 * max(r.param_bytes for r in facts)
        for i, r in enumerate(facts):
            need(i, "forward alone", r.mem_fwd_bytes)
            need(i, "backward alone", r.mem_bwd_bytes)
            need(i, "forward in the slots", slots + r.mem_fwd_bytes - r.param_bytes)
            need(i, "backward in the slots",
                 slots + r.mem_bwd_bytes - r.param_bytes - r.grad_bytes)
        if facts[0].bwd_ns < facts[0].checkpoint_ns:
            out.append(Violation(0, "backward overlap",
                                 f"C*t_bwd {facts[0].bwd_ns} ns < its checkpoints "
                                 f"{facts[0].checkpoint_ns} ns"))
        for i in range(len(facts) - 1):
            left, right = facts[i], facts[i + 1]
            need(i, "forward + next loading", left.mem_fwd_bytes + right.param_bytes)
            need(i + 1, "backward + previous loading", right.mem_bwd_bytes + left.param_bytes)
            need(i, "backward + next's gradients leaving", left.mem_bwd_bytes + right.grad_bytes)
            if i == 0 and early_prefetch:
                need(0, "update tail + next loading",
                     left.param_bytes + left.grad_bytes + right.param_bytes)
                tail, update1_end = update_tail(facts)
                wait = max(update1_end, 0) + right.load_ns
                if tail < wait:
                    out.append(Violation(0, "forward overlap",
                                         f"update tail {tail} ns < next's update wait and load "
                                         f"{wait} ns"))
            elif left.fwd_ns < right.load_ns:
                out.append(Violation(i, "forward overlap",
                                     f"C*t_fwd {left.fwd_ns} ns < next load {right.load_ns} ns"))
            # the last sub-model's predecessor is still in its slot: nothing loads for it
            reload = left.load_ns if i + 2 < len(facts) else 0
            if right.bwd_ns < right.checkpoint_ns + reload:
                out.append(Violation(i + 1, "backward overlap",
                                     f"C*t_bwd {right.bwd_ns} ns < checkpoints "
                                     f"{right.checkpoint_ns} ns + previous load {reload} ns"))
            if i == 0:
                continue  # P_1's offload and update meet P_0's at the step boundary: priced
            if left.bwd_ns < right.offload_ns:
                out.append(Violation(i, "gradient offload",
                                     f"C*t_bwd {left.bwd_ns} ns < next's offload "
                                     f"{right.offload_ns} ns"))
            if left.bwd_ns + left.offload_ns < right.offload_ns + right.adam_ns:
                out.append(Violation(i, "optimizer",
                                     f"C*t_bwd + offload {left.bwd_ns + left.offload_ns} ns < "
                                     f"next's offload + update {right.offload_ns + right.adam_ns} "
                                     f"ns"))
        return out


def update_tail(facts: list[RangeFacts]) -> tuple[int, int]:
    """P_0's update tail and the end of P_1's update, both from the end of P_0's backward.

    Lanes in the runtime's order: P_1's gradients leave when its backward ends, then P_0
    reloads for its own backward (unless P_1 is the last sub-model: P_0 is still in its slot)
    and P_0's checkpoints stream in; P_0's gradients leave after its backward and after P_1's
    have; the CPU updates P_1, then P_0."""
    first, second = facts[0], facts[1]
    reload = first.load_ns if len(facts) > 2 else 0
    p1_end = max(second.bwd_ns, second.checkpoint_ns)  # P_1's backward waits for its checkpoints
    p0_start = max(second.bwd_ns, second.checkpoint_ns + reload)  # ... and P_0 for its reload
    p0_end = p0_start + max(first.bwd_ns, first.checkpoint_ns)
    out1_end = p1_end + second.offload_ns
    update1_end = out1_end + second.adam_ns
    out0_end = max(p0_end, out1_end) + first.offload_ns
    update0_end = max(out0_end, update1_end) + first.adam_ns
    return update0_end - p0_end, update1_end - p0_end


def check_plan(profile: Profile, plan: Plan) -> list[Violation]:
    """Everything wrong with `plan` for `profile`: structure, recorded numbers, constraints."""
    out: list[Violation] = []
    g = profile.graph
    n = len(g.nodes)
    subs = plan.submodels
    if plan.graph_hash != g.structure_hash():
        out.append(Violation(-1, "structure", "the plan is for another graph"))
    if plan.accum < 1:
        out.append(Violation(-1, "structure", f"accum {plan.accum} < 1"))
    if not subs:
        return out + [Violation(-1, "structure", "no sub-models")]
    expected = 0
    for i, s in enumerate(subs):
        if s.index != i or s.start != expected or s.stop <= s.start:
            out.append(Violation(i, "structure",
                                 f"range [{s.start}, {s.stop}) does not follow {expected}"))
        expected = s.stop
    if expected != n:
        out.append(Violation(-1, "structure",
                             f"sub-models end at node {expected}, the graph has {n}"))
    if out:
        return out
    for i, n_ in enumerate(g.nodes):
        if n_.op == "placeholder" and i >= subs[0].stop:
            out.append(Violation(-1, "structure",
                                 f"placeholder '{n_.name}' is not in the first sub-model"))
        if n_.op == "output" and i < subs[-1].start:
            out.append(Violation(-1, "structure",
                                 f"output node '{n_.name}' is not in the last sub-model"))
    # the bytes the device holds at the plan's dtypes: the one rule both sides read
    view = device_view(profile, Precision(plan.transfer_dtype or model_dtype(g), plan.autocast))
    checker = Checker(view, plan.accum, plan.capacity_bytes - plan.reserve_bytes,
                      plan.activations, plan.cpu_adam_gbps)
    facts = [checker.range_facts(s.start, s.stop) for s in subs]
    if plan.activations == "auto":
        unknown = [n for s in subs for n in (*s.kept, *s.sent) if n not in checker.index]
        if unknown:
            return [Violation(-1, "structure", f"the policy names operators the graph does not "
                                               f"have: {', '.join(unknown[:3])}")]
        facts = checker.with_policy(facts, subs)
    for i, (s, f) in enumerate(zip(subs, facts)):
        if s.param_bytes != f.param_bytes:
            out.append(Violation(i, "recorded", f"param_bytes {s.param_bytes} != {f.param_bytes}"))
        if round(s.fwd_ms * plan.accum * NS_PER_MS) != f.fwd_ns:
            out.append(Violation(i, "recorded", f"fwd_ms {s.fwd_ms} does not match the profile"))
        if s.peak_bytes != max(f.mem_fwd_bytes, f.mem_bwd_bytes):
            out.append(Violation(i, "recorded", f"peak_bytes {s.peak_bytes} != "
                                                f"{max(f.mem_fwd_bytes, f.mem_bwd_bytes)}"))
        if i + 1 < len(subs) and tuple(t.name for t in s.crossing) != f.crossing_out:
            out.append(Violation(i, "recorded",
                                 "the values crossing its end cut are not the ones listed"))
    out.extend(checker.check_facts(facts, plan.early_prefetch))
    if plan.feasible and any(v.constraint not in ("structure", "recorded") for v in out):
        out.append(Violation(-1, "recorded", "the plan says feasible but breaks constraints"))
    return out
