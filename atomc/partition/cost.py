"""Cost model of a consecutive node range, for the partition stage (Profile -> Plan).

A sub-model is a node range [start, stop) of the profile's graph. For the swap schedule
(DESIGN 4 and 7, ATOM Fig. 12) each range needs:

- parameter bytes (params and buffers, each unique FQN once: a tied weight used twice inside
  one range counts once, and counts again in every other range that uses it), gradient bytes
  (trainable parameters only) and fp32 master bytes (what the CPU AdamW reads and writes);
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

Everything is integer: times in nanoseconds, sizes in bytes, so that the search, the simulator
and a brute-force enumeration add up the same numbers exactly.

`RangeTables` holds the C-independent quantities for every range up to `max_width` nodes as
(start, width) arrays, built with prefix sums, so the search reads any range's cost in O(1);
`derive` turns them into the C-dependent quantities of one run.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from atomc.errors import IRError, UsageError
from atomc.ir import NodeCost, Profile

NS_PER_MS = 1_000_000
ACTIVATIONS = ("recompute", "keep")
# CPU AdamW throughput in GB/s of fp32 master bytes; a vectorised multi-threaded AdamW on a
# server CPU updates about 2e9 parameters a second. An assumption: override per run.
DEFAULT_CPU_ADAM_GBPS = 8.0


def ms_to_ns(ms: float) -> int:
    return round(ms * NS_PER_MS)


def transfer_ns(num_bytes, gbps: float):
    """Copy time of `num_bytes` at `gbps` GB/s, in ns (bytes / (GB/s) = ns). Works on arrays."""
    if gbps <= 0 or math.isinf(gbps):
        return np.zeros_like(np.asarray(num_bytes, dtype=np.int64))
    return np.rint(np.asarray(num_bytes, dtype=np.float64) / gbps).astype(np.int64)


@dataclass(frozen=True)
class StateTensor:
    """A parameter or buffer and the nodes that read it, in order."""

    fqn: str
    param_bytes: int  # in the model's dtype: what is loaded and resident
    grad_bytes: int  # 0 for buffers
    master_bytes: int  # fp32 master copy the CPU optimizer updates; 0 for buffers
    uses: tuple[int, ...]

    @property
    def num_masters(self) -> int:
        """Tensors the CPU optimizer updates for it: 1 for a parameter, 0 for a buffer."""
        return 1 if self.master_bytes else 0


@dataclass(frozen=True)
class NodeFacts:
    """Per-node numbers the cost model needs, read once from a Profile."""

    names: tuple[str, ...]
    ops: tuple[str, ...]
    # the device's time of each node, and the host's time to issue it: one figure for nodes
    # timed synchronously (CPU, estimates, calibrated profiles), apart where measured so
    fwd_ns: np.ndarray
    bwd_ns: np.ndarray
    host_fwd_ns: np.ndarray
    host_bwd_ns: np.ndarray
    saved_bytes: np.ndarray
    extra_fwd_bytes: np.ndarray  # forward peak above the node's own parameters
    extra_bwd_bytes: np.ndarray  # backward peak above its own parameters and their gradients
    value_bytes: np.ndarray  # bytes of the node's outputs: what crosses a cut when it is live
    users: tuple[tuple[int, ...], ...]  # sorted indices of nodes reading this node
    last_use: np.ndarray  # index of the last reader, -1 when none
    state: tuple[StateTensor, ...]
    last_placeholder: int  # -1 when the graph has no placeholders
    output_index: int  # index of the graph's output node, or -1

    @property
    def num_nodes(self) -> int:
        return len(self.names)


def node_sides_ms(c: NodeCost) -> tuple[float, float, float, float]:
    """A node's forward and backward time on the device, then the host's time to issue them.

    Measured on CUDA the two are apart (NodeCost.issue): the host issues kernels ahead of the
    device, so a range of nodes takes the longer of its two sums, not the sum of each node's
    longer side. On an H200 (bench/RESULTS.md, 2026-11-26) that sum overstated GPT-3 large's
    sub-models by 15-24%; the longer of the two sums came within 2% of their measured forward
    and backward.
    """
    if c.issue is None:
        return c.fwd_ms, c.bwd_ms, c.fwd_ms, c.bwd_ms
    i = c.issue
    return i.device_fwd_ms, i.device_bwd_ms, i.host_fwd_ms, i.host_bwd_ms


def node_facts(profile: Profile) -> NodeFacts:
    graph = profile.graph
    nodes = graph.nodes
    costs = profile.costs
    if not nodes:
        raise IRError("the profile's graph has no nodes; profile a model with at least one "
                      "operator")
    if len(costs) != len(nodes):
        raise IRError(
            f"the profile has {len(costs)} node costs for {len(nodes)} graph nodes; "
            f"the file is damaged: profile the model again"
        )
    index = {}
    for i, (n, c) in enumerate(zip(nodes, costs)):
        if c.name != n.name:
            raise IRError(f"profile cost {i} is for '{c.name}' but node {i} is '{n.name}'; "
                          f"profile again")
        index[n.name] = i
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for src in n.inputs:
            j = index.get(src)
            if j is None or j >= i:
                raise IRError(
                    f"node '{n.name}' reads '{src}', which is not an earlier node of the graph; "
                    f"the graph is not in topological order: trace the model again"
                )
            if not users[j] or users[j][-1] != i:
                users[j].append(i)
    state_uses: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for fqn in dict.fromkeys(n.param_fqns + n.buffer_fqns):
            state_uses.setdefault(fqn, []).append(i)
    state = []
    for fqn, uses in state_uses.items():
        if fqn in graph.params:
            spec = graph.params[fqn]
            numel = math.prod(spec.shape)
            state.append(StateTensor(fqn, spec.num_bytes, spec.num_bytes, 4 * numel, tuple(uses)))
        elif fqn in graph.buffers:
            state.append(StateTensor(fqn, graph.buffers[fqn].num_bytes, 0, 0, tuple(uses)))
        else:
            raise IRError(f"node '{nodes[uses[0]].name}' reads '{fqn}', which the graph's params "
                          f"and buffers do not list; trace the model again")
    own_param = np.zeros(len(nodes), dtype=np.int64)
    own_grad = np.zeros(len(nodes), dtype=np.int64)
    for s in state:
        for u in s.uses:
            own_param[u] += s.param_bytes
            own_grad[u] += s.grad_bytes
    peak_fwd = np.array([c.peak_fwd_bytes for c in costs], dtype=np.int64)
    peak_bwd = np.array([c.peak_bwd_bytes for c in costs], dtype=np.int64)
    placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
    outputs = [i for i, n in enumerate(nodes) if n.op == "output"]
    return NodeFacts(
        names=tuple(n.name for n in nodes),
        ops=tuple(n.op for n in nodes),
        **{k: np.array([ms_to_ns(ms) for ms in v], dtype=np.int64)
           for k, v in zip(("fwd_ns", "bwd_ns", "host_fwd_ns", "host_bwd_ns"),
                           zip(*(node_sides_ms(c) for c in costs)))},
        saved_bytes=np.array([c.saved_bytes for c in costs], dtype=np.int64),
        # the profiler's peaks include the node's own parameters (and, backward, their
        # gradients); those are counted once per range as resident bytes instead
        extra_fwd_bytes=np.maximum(peak_fwd - own_param, 0),
        extra_bwd_bytes=np.maximum(peak_bwd - own_param - own_grad, 0),
        value_bytes=np.array([sum(o.num_bytes for o in n.outputs) for n in nodes], dtype=np.int64),
        users=tuple(tuple(u) for u in users),
        last_use=np.array([u[-1] if u else -1 for u in users], dtype=np.int64),
        state=tuple(state),
        last_placeholder=max(placeholders) if placeholders else -1,
        output_index=outputs[-1] if outputs else -1,
    )


def allowed_cuts(facts: NodeFacts) -> np.ndarray:
    """allowed[q]: may the plan cut between node q-1 and node q (0 < q < N)?

    The first sub-model holds every placeholder and at least one operator after them; the
    last holds the output node and at least one operator before it.
    """
    n = facts.num_nodes
    allowed = np.zeros(n + 1, dtype=bool)
    lo = facts.last_placeholder + 2
    hi = facts.output_index - 1 if facts.output_index >= 0 else n - 1
    if lo <= hi:
        allowed[max(lo, 1):hi + 1] = True
    return allowed


def live_sets(facts: NodeFacts, positions: list[int]) -> list[list[int]]:
    """For each cut position q (ascending), the nodes whose values cross it: produced before q
    and read at q or later. One sweep over the graph."""
    out = []
    live: set[int] = set()
    j = 0
    for q in positions:
        while j < q:
            live.add(j)
            j += 1
        live = {i for i in live if facts.last_use[i] >= q}
        out.append(sorted(live))
    return out


@dataclass(frozen=True)
class RangeTables:
    """C-independent costs of every range [a, a+w) with 1 <= w <= max_width, as [a, w] arrays."""

    facts: NodeFacts
    max_width: int
    valid: np.ndarray  # a + w <= N
    fwd_ns: np.ndarray
    bwd_ns: np.ndarray  # without recomputation
    saved_bytes: np.ndarray
    param_bytes: np.ndarray  # unique params and buffers
    grad_bytes: np.ndarray
    master_bytes: np.ndarray
    num_masters: np.ndarray  # parameter tensors the CPU optimizer updates
    in_bytes: np.ndarray  # values produced before a and read inside the range
    out_bytes: np.ndarray  # values produced inside and read at a+w or later
    extra_fwd_bytes: np.ndarray  # largest single-node transient
    extra_bwd_bytes: np.ndarray
    start_ok: np.ndarray  # the range may start at a (a == 0 or an allowed cut)
    end_ok: np.ndarray  # ... and end at a+w
    cut_bytes: np.ndarray  # [q]: bytes of values crossing the cut before node q, q = 0..N
    saved_prefix: np.ndarray  # [q]: saved activations of the nodes before q (one micro-batch)
    allowed: np.ndarray  # [q]

    @property
    def num_nodes(self) -> int:
        return self.facts.num_nodes

    def row_arrays(self) -> list[np.ndarray]:
        """Every per-range array, for comparing two start positions (block folding).

        With activations="keep" a range's memory also depends on `saved_prefix` at its start,
        which differs between any two starts: the partitioner does not fold then.
        """
        cut_start = np.broadcast_to(self.cut_bytes[:-1, None], self.valid.shape)
        return [self.valid, self.fwd_ns, self.bwd_ns, self.saved_bytes, self.param_bytes,
                self.grad_bytes, self.master_bytes, self.num_masters, self.in_bytes, self.out_bytes,
                self.extra_fwd_bytes, self.extra_bwd_bytes, self.start_ok, self.end_ok, cut_start]


def max_width_for(facts: NodeFacts, usable_bytes: int) -> int:
    """Widest range whose parameters and gradients alone fit in `usable_bytes` (at least 1).

    Counted with first uses only (a lower bound of a range's resident bytes), so no range that
    could fit is left out.
    """
    n = facts.num_nodes
    first = np.zeros(n + 1, dtype=np.int64)
    for s in facts.state:
        first[s.uses[0] + 1] += s.param_bytes + s.grad_bytes
    prefix = np.cumsum(first)
    width = 1
    stop = 0
    for a in range(n):  # two pointers: prefix is non-decreasing
        stop = max(stop, a + 1)
        while stop < n and prefix[stop + 1] - prefix[a] <= usable_bytes:
            stop += 1
        width = max(width, stop - a)
    return min(width, n)


def build_tables(facts: NodeFacts, max_width: int) -> RangeTables:
    n = facts.num_nodes
    w_max = max(1, min(max_width, n))
    starts = np.arange(n)[:, None]
    widths = np.arange(w_max + 1)[None, :]
    ends = np.minimum(starts + widths, n)
    valid = (widths >= 1) & (starts + widths <= n)

    def span(per_node: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0], np.cumsum(per_node, dtype=np.int64)])
        return prefix[ends] - prefix[starts]

    # unique state: a tensor's weights and gradients count in [a, a+w) when one of its uses
    # lies there. Count it at its first use after a: the first use overall (prefix sums), or
    # a later use whose previous use lies before a (a few correction rectangles, e.g. a tied
    # LM head). Its master and optimizer state live in its first holder only (runtime.store):
    # the range with its first use overall updates it.
    state_sums = []
    for attr in ("param_bytes", "grad_bytes", "master_bytes", "num_masters"):
        first = np.zeros(n, dtype=np.int64)
        for s in facts.state:
            first[s.uses[0]] += getattr(s, attr)
        table = span(first)
        for s in facts.state:
            weight = getattr(s, attr)
            if not weight or attr in ("master_bytes", "num_masters"):
                continue
            for prev, use in zip(s.uses, s.uses[1:]):
                lo = max(prev + 1, use - w_max + 1)
                rows = np.arange(lo, use + 1)
                if len(rows):
                    table[lo:use + 1] += weight * (widths > (use - rows)[:, None])
        state_sums.append(table)
    param_bytes, grad_bytes, master_bytes, num_masters = state_sums

    extra_fwd = np.zeros((n, w_max + 1), dtype=np.int64)
    extra_bwd = np.zeros((n, w_max + 1), dtype=np.int64)
    for w in range(1, w_max + 1):
        last = np.minimum(np.arange(n) + w - 1, n - 1)
        extra_fwd[:, w] = np.maximum(extra_fwd[:, w - 1], facts.extra_fwd_bytes[last])
        extra_bwd[:, w] = np.maximum(extra_bwd[:, w - 1], facts.extra_bwd_bytes[last])

    # out_bytes[a, c-a] = sum over j in [a, c) of value_bytes[j] when j is read at c or later
    out_bytes = np.zeros((n, w_max + 1), dtype=np.int64)
    for c in range(1, n + 1):
        lo = max(0, c - w_max)
        j = np.arange(lo, c)
        contrib = np.where(facts.last_use[lo:c] >= c, facts.value_bytes[lo:c], 0)
        suffix = np.cumsum(contrib[::-1])[::-1]
        out_bytes[j, c - j] = suffix

    # live values at each cut, swept once; in_bytes needs each live value's next reader
    delta = np.zeros(n + 2, dtype=np.int64)
    for j in range(n):
        if facts.last_use[j] > j:
            delta[j + 1] += facts.value_bytes[j]
            delta[facts.last_use[j] + 1] -= facts.value_bytes[j]
    cut_bytes = np.cumsum(delta)[: n + 1]
    in_bytes = np.zeros((n, w_max + 1), dtype=np.int64)
    live: set[int] = set()
    for a in range(n):
        # values live at cut a: produced before a, read at a or later
        if a > 0 and facts.last_use[a - 1] >= a:
            live.add(a - 1)
        live = {j for j in live if facts.last_use[j] >= a}
        for j in live:
            users = facts.users[j]
            nxt = users[bisect.bisect_left(users, a)]  # its first reader at a or later
            if nxt - a < w_max:
                in_bytes[a, nxt - a + 1:] += facts.value_bytes[j]

    allowed = allowed_cuts(facts)
    start_ok = np.broadcast_to(((np.arange(n) == 0) | allowed[:n])[:, None], valid.shape)
    end_ok = (ends == n) | allowed[ends]
    return RangeTables(
        facts=facts, max_width=w_max, valid=valid,
        fwd_ns=np.maximum(span(facts.fwd_ns), span(facts.host_fwd_ns)),
        bwd_ns=np.maximum(span(facts.bwd_ns), span(facts.host_bwd_ns)),
        saved_bytes=span(facts.saved_bytes),
        param_bytes=param_bytes, grad_bytes=grad_bytes, master_bytes=master_bytes,
        num_masters=num_masters, in_bytes=in_bytes, out_bytes=out_bytes, extra_fwd_bytes=extra_fwd,
        extra_bwd_bytes=extra_bwd,
        start_ok=np.ascontiguousarray(start_ok), end_ok=end_ok & valid, cut_bytes=cut_bytes,
        saved_prefix=np.concatenate([[0], np.cumsum(facts.saved_bytes, dtype=np.int64)]),
        allowed=allowed,
    )


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
    # the runtime's slots are sized for the largest sub-model (slot_bytes): with a cap, every
    # range's parameters stay within it and its working memory fits beside 2 x 2 slots of it
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
class Derived:
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


def derive_values(p: CostParams, *, fwd, bwd, saved, params, grads, master, masters, inb, outb,
                  extra_fwd, extra_bwd, cut_start, saved_before, is_last) -> Derived:
    """The C-dependent formulas, shared by the whole-table and the single-range paths."""
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
    load_fwd = transfer_ns(params, p.h2d_gbps)
    offload = transfer_ns(grads, p.d2h_gbps)
    optimizer = optimizer_ns(p, master, masters)
    return Derived(
        fwd_ns=fwd_c, bwd_ns=bwd_c, load_fwd_ns=load_fwd,
        checkpoint_ns=transfer_ns(checkpoint, p.h2d_gbps),
        offload_ns=offload, optimizer_ns=optimizer, tail_ns=offload + optimizer + load_fwd,
        param_bytes=np.asarray(params), grad_bytes=np.asarray(grads),
        mem_fwd_bytes=np.asarray(mem_fwd), mem_bwd_bytes=np.asarray(mem_bwd),
    )


def derive(tables: RangeTables, p: CostParams) -> Derived:
    t = tables
    cut_start = t.cut_bytes[:-1, None]
    d = derive_values(p, fwd=t.fwd_ns, bwd=t.bwd_ns, saved=t.saved_bytes, params=t.param_bytes,
                      grads=t.grad_bytes, master=t.master_bytes, masters=t.num_masters,
                      inb=t.in_bytes, outb=t.out_bytes,
                      extra_fwd=t.extra_fwd_bytes, extra_bwd=t.extra_bwd_bytes, cut_start=cut_start,
                      saved_before=t.saved_prefix[:-1, None],
                      is_last=(np.arange(t.num_nodes)[:, None] + np.arange(t.max_width + 1)[None, :]
                               == t.num_nodes))
    ok = (t.valid & t.start_ok & t.end_ok & (d.mem_fwd_bytes <= p.usable_bytes)
          & (d.mem_bwd_bytes <= p.usable_bytes))
    work = np.maximum(d.mem_fwd_bytes - d.param_bytes,
                      d.mem_bwd_bytes - d.param_bytes - d.grad_bytes)
    # the runtime holds two weight and two gradient slots; with one sub-model, one of each
    per_cap = np.full(ok.shape, 4, dtype=np.int64)
    if t.max_width >= t.num_nodes:
        per_cap[0, t.num_nodes] = 2
    d = Derived(**{**d.__dict__, "ok": ok, "work_bytes": work, "slots_per_cap": per_cap})
    if p.slot_cap_bytes > 0:
        d = with_slot_cap(d, p.slot_cap_bytes, p.usable_bytes)
    return d


def with_slot_cap(d: Derived, cap: int, usable_bytes: int) -> Derived:
    """`d` (derive's) with only the ranges that can be sub-models of a plan whose largest
    sub-model holds at most `cap` bytes: the runtime's slots are sized for that largest one
    and held all step (slot_bytes), so every sub-model's working memory must fit beside them."""
    ok = (d.ok & (d.param_bytes <= cap)
          & (d.work_bytes + d.slots_per_cap * np.int64(cap) <= usable_bytes))
    return dataclasses.replace(d, ok=ok)


def slot_fits(d: Derived, usable_bytes: int) -> np.ndarray:
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


def handover_tail(*, bwd0_ns, checkpoint0_ns, offload0_ns, optimizer0_ns, load0_ns,
                  load1_ns, offload1_ns, optimizer1_ns, bwd1_ns, checkpoint1_ns, last1):
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
    reload0 = np.where(last1, 0, load0_ns)
    stall = np.maximum(bwd1_ns, checkpoint1_ns + reload0) - np.maximum(bwd1_ns, checkpoint1_ns)
    lead = np.maximum(bwd0_ns, checkpoint0_ns) + stall
    update1_end = offload1_ns + optimizer1_ns - lead
    tail = (np.maximum(np.maximum(offload1_ns - lead, 0) + offload0_ns, update1_end)
            + optimizer0_ns)
    wait = np.maximum(update1_end, 0) + load1_ns
    return tail, wait


def first_pair(*, fwd0_ns, bwd0_ns, checkpoint0_ns, offload0_ns, optimizer0_ns, load0_ns,
               param0_bytes, grad0_bytes, load1_ns, offload1_ns, optimizer1_ns, param1_bytes,
               bwd1_ns, checkpoint1_ns, last1, tier: int, usable_bytes):
    """The two ways the first sub-model P_0 (left) can hand over to P_1 (right).

    Times are of C micro-batches (Derived's, a RangeCost's accum_*): F forward, B backward,
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
    tail, wait = handover_tail(
        bwd0_ns=bwd0_ns, checkpoint0_ns=checkpoint0_ns, offload0_ns=offload0_ns,
        optimizer0_ns=optimizer0_ns, load0_ns=load0_ns, load1_ns=load1_ns,
        offload1_ns=offload1_ns, optimizer1_ns=optimizer1_ns, bwd1_ns=bwd1_ns,
        checkpoint1_ns=checkpoint1_ns, last1=last1)
    late = np.maximum(fwd0_ns, load1_ns) + tail + load0_ns
    early = fwd0_ns + np.maximum(tail, wait) + load0_ns
    early_ok = param0_bytes + grad0_bytes + param1_bytes <= usable_bytes
    if tier == 0:
        late_ok = fwd0_ns >= load1_ns
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
    late, _, early, _ = first_pair(
        fwd0_ns=first.accum_fwd_ns, bwd0_ns=first.accum_bwd_ns, checkpoint0_ns=first.checkpoint_ns,
        offload0_ns=first.offload_ns, optimizer0_ns=first.optimizer_ns,
        load0_ns=first.load_fwd_ns, param0_bytes=first.param_bytes, grad0_bytes=first.grad_bytes,
        load1_ns=second.load_fwd_ns, offload1_ns=second.offload_ns,
        optimizer1_ns=second.optimizer_ns, param1_bytes=second.param_bytes,
        bwd1_ns=second.accum_bwd_ns, checkpoint1_ns=second.checkpoint_ns, last1=len(costs) == 2,
        tier=1, usable_bytes=0)
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
    tail, wait = handover_tail(
        bwd0_ns=first.accum_bwd_ns, checkpoint0_ns=first.checkpoint_ns,
        offload0_ns=first.offload_ns, optimizer0_ns=first.optimizer_ns,
        load0_ns=first.load_fwd_ns, load1_ns=second.load_fwd_ns, offload1_ns=second.offload_ns,
        optimizer1_ns=second.optimizer_ns, bwd1_ns=second.accum_bwd_ns,
        checkpoint1_ns=second.checkpoint_ns, last1=len(costs) == 2)
    return int(tail), int(wait)


# constraint names, and the search tier from which each is relaxed (memory never is)
MEMORY = "memory"


def slot_bytes(costs: list[RangeCost]) -> int:
    """Device bytes of the runtime's weight and gradient slots (atomc.runtime.slots): two of
    each (one with one sub-model), each sized for the largest sub-model, and held all step. A
    plan of uneven sub-models needs more than the pairs of neighbours the search checks."""
    return min(2, len(costs)) * 2 * max((c.param_bytes for c in costs), default=0)
FORWARD_OVERLAP = "forward overlap"
BACKWARD_OVERLAP = "backward overlap"
GRADIENT_OFFLOAD = "gradient offload"
OPTIMIZER = "optimizer"
TIME_CONSTRAINTS = (FORWARD_OVERLAP, BACKWARD_OVERLAP, GRADIENT_OFFLOAD, OPTIMIZER)


@dataclass(frozen=True)
class Slack:
    """How much room one constraint of one sub-model has; negative when it is violated."""

    submodel: int  # the sub-model computing while the constraint applies
    constraint: str  # MEMORY or one of TIME_CONSTRAINTS
    slack: int  # bytes for MEMORY, ns otherwise
    detail: str  # what is compared, for messages


def plan_slacks(costs: list[RangeCost], usable_bytes: int,
                early_prefetch: bool = False) -> list[Slack]:
    """Every constraint of DESIGN 4 (plus the two gradient-lane ones) for a plan's ranges.

    With `early_prefetch` sub-model 1 loads during sub-model 0's update tail, so sub-model 0's
    forward overlap compares that tail with the load, and the tail has a memory requirement.
    Sub-model 1's offload and update against sub-model 0's backward are no constraint: they
    meet at the step boundary, where the handover prices what they overrun (first_pair).
    """
    from atomc.units import format_bytes

    def ms(ns: int) -> str:
        return f"{ns / NS_PER_MS:.1f} ms"

    out: list[Slack] = []
    k = len(costs)
    slots = slot_bytes(costs)
    for i, c in enumerate(costs):
        nxt = costs[i + 1] if i + 1 < k else None
        prv = costs[i - 1] if i > 0 else None
        need = [(c.mem_fwd_bytes, "its forward alone"), (c.mem_bwd_bytes, "its backward alone"),
                (slots + c.mem_fwd_bytes - c.param_bytes,
                 f"its forward in the runtime's slots ({format_bytes(slots)})"),
                (slots + c.mem_bwd_bytes - c.param_bytes - c.grad_bytes,
                 f"its backward in the runtime's slots ({format_bytes(slots)})")]
        if nxt:
            need.append((c.mem_fwd_bytes + nxt.param_bytes,
                         f"its forward + loading sub-model {i + 1}'s parameters"))
            need.append((c.mem_bwd_bytes + nxt.grad_bytes,
                         f"its backward + sub-model {i + 1}'s gradients leaving"))
        if prv:
            need.append((c.mem_bwd_bytes + prv.param_bytes,
                         f"its backward + loading sub-model {i - 1}'s parameters"))
        for num_bytes, what in need:
            out.append(Slack(i, MEMORY, usable_bytes - num_bytes,
                             f"{what} needs {format_bytes(num_bytes)} of "
                             f"{format_bytes(usable_bytes)}"))
        if nxt and i == 0 and early_prefetch:
            tail, wait = first_tail(costs)
            out.append(Slack(i, FORWARD_OVERLAP, tail - wait,
                             f"its update tail {ms(tail)} vs sub-model 1's update and load "
                             f"{ms(wait)}"))
            num_bytes = c.param_bytes + c.grad_bytes + nxt.param_bytes
            out.append(Slack(i, MEMORY, usable_bytes - num_bytes,
                             f"its update tail + loading sub-model 1 needs "
                             f"{format_bytes(num_bytes)} of {format_bytes(usable_bytes)}"))
        elif nxt:
            out.append(Slack(i, FORWARD_OVERLAP, c.accum_fwd_ns - nxt.load_fwd_ns,
                             f"C*t_fwd {ms(c.accum_fwd_ns)} vs loading sub-model {i + 1} "
                             f"{ms(nxt.load_fwd_ns)}"))
        if nxt and i:  # between P_1 and P_0 the handover prices it (first_pair)
            out.append(Slack(i, GRADIENT_OFFLOAD, c.accum_bwd_ns - nxt.offload_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs offloading sub-model {i + 1}'s "
                             f"gradients {ms(nxt.offload_ns)}"))
            out.append(Slack(i, OPTIMIZER,
                             c.accum_bwd_ns + c.offload_ns - nxt.offload_ns - nxt.optimizer_ns,
                             f"C*t_bwd + own offload {ms(c.accum_bwd_ns + c.offload_ns)} vs "
                             f"sub-model {i + 1}'s offload + CPU update "
                             f"{ms(nxt.offload_ns + nxt.optimizer_ns)}"))
        if prv and nxt:  # the last one's predecessor is still in its slot: nothing loads
            out.append(Slack(i, BACKWARD_OVERLAP,
                             c.accum_bwd_ns - c.checkpoint_ns - prv.load_fwd_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs its checkpoints "
                             f"{ms(c.checkpoint_ns)} + loading sub-model {i - 1} "
                             f"{ms(prv.load_fwd_ns)}"))
        elif c.checkpoint_ns:
            out.append(Slack(i, BACKWARD_OVERLAP, c.accum_bwd_ns - c.checkpoint_ns,
                             f"C*t_bwd {ms(c.accum_bwd_ns)} vs its checkpoints "
                             f"{ms(c.checkpoint_ns)}"))
    return out


def range_stage_times(costs: list[RangeCost]):
    """The simulator's input for a plan's ranges (atomc.simulate.stage_times reads a Plan's)."""
    from atomc.simulate.events import StageTimes

    return [StageTimes(fwd_ns=c.accum_fwd_ns, bwd_ns=c.accum_bwd_ns, load_ns=c.load_fwd_ns,
                       checkpoint_ns=c.checkpoint_ns, offload_ns=c.offload_ns,
                       optimizer_ns=c.optimizer_ns)
            for c in costs]
