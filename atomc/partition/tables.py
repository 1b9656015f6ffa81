"""Prefix tables of the partition cost model: what every node range [start, stop) of a profile's
graph costs independently of the accumulation degree C, read in O(1) by the search.

`node_facts` reads the per-node numbers of a Profile once; `build_tables` turns them into
`RangeTables`, (start, width) arrays for every range up to `max_width` nodes, built with prefix
sums: forward and backward time of one micro-batch, saved activations, the bytes crossing its
cuts, its largest single-node transient, and its state: parameter bytes (params and buffers,
each unique FQN once: a tied weight used twice inside one range counts once, and counts again
in every other range that uses it), gradient bytes (trainable parameters only) and fp32 master
bytes (what the CPU AdamW reads and writes). `atomc.partition.cost` turns them into one run's
costs.

Everything is integer: times in nanoseconds, sizes in bytes, so that the search, the simulator
and a brute-force enumeration add up the same numbers exactly.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from atomc.errors import IRError
from atomc.ir import NodeCost, Profile
from atomc.units import ms_to_ns


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
    # a frozen weight (a LoRA model's base) has no gradient slot, offload or CPU update
    # (atomc.runtime.slots and store hold trainable weights' gradients only)
    frozen = set(graph.frozen or ())
    for fqn, uses in state_uses.items():
        if fqn in graph.params:
            spec = graph.params[fqn]
            numel = math.prod(spec.shape)
            trains = fqn not in frozen
            state.append(StateTensor(fqn, spec.num_bytes, spec.num_bytes if trains else 0,
                                     4 * numel if trains else 0, tuple(uses)))
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


def _state_tables(facts: NodeFacts, w_max: int,
                  span: Callable[[np.ndarray], np.ndarray]) -> list[np.ndarray]:
    """Parameter, gradient and master bytes and the number of masters of every range.

    Unique state: a tensor's weights and gradients count in [a, a+w) when one of its uses
    lies there. Count it at its first use after a: the first use overall (prefix sums), or
    a later use whose previous use lies before a (a few correction rectangles, e.g. a tied
    LM head). Its master and optimizer state live in its first holder only (runtime.store):
    the range with its first use overall updates it."""
    n = facts.num_nodes
    widths = np.arange(w_max + 1)[None, :]
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
    return state_sums


def _extra_tables(facts: NodeFacts, w_max: int) -> tuple[np.ndarray, np.ndarray]:
    """The largest working memory beyond saved values of any operator of each range, forward
    and backward."""
    n = facts.num_nodes
    extra_fwd = np.zeros((n, w_max + 1), dtype=np.int64)
    extra_bwd = np.zeros((n, w_max + 1), dtype=np.int64)
    for w in range(1, w_max + 1):
        last = np.minimum(np.arange(n) + w - 1, n - 1)
        extra_fwd[:, w] = np.maximum(extra_fwd[:, w - 1], facts.extra_fwd_bytes[last])
        extra_bwd[:, w] = np.maximum(extra_bwd[:, w - 1], facts.extra_bwd_bytes[last])
    return extra_fwd, extra_bwd


def _boundary_tables(facts: NodeFacts, w_max: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out_bytes, cut_bytes, in_bytes): the values each range hands on, the values live at
    each cut, and the values each range reads from before it."""
    n = facts.num_nodes
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
    return out_bytes, cut_bytes, in_bytes


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

    param_bytes, grad_bytes, master_bytes, num_masters = _state_tables(facts, w_max, span)
    extra_fwd, extra_bwd = _extra_tables(facts, w_max)
    out_bytes, cut_bytes, in_bytes = _boundary_tables(facts, w_max)
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
