"""Choice of the accumulation degree C, and the physical bound it is compared with
(docs/design.md, section "Partition: Algorithm 1, exact").

A larger C lengthens each sub-model's compute (C micro-batches) against the same parameter
loads, so overlap gets easier; it also keeps C micro-batches of boundary activations on the
device, so memory gets harder. The search asks for the smallest C whose best plan meets every
constraint: double C until a plan is feasible, then bisect between the last infeasible and the
first feasible value. Feasibility is assumed monotone below the first feasible C (true when
the overlap constraints are what binds); when memory runs out first, no larger C can help.

When no C up to the cap is feasible, the best relaxed plan (loads allowed to stall) among the
C values tried is kept: the one the simulator predicts keeps the GPU busiest.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from atomc.ir import Profile
from atomc.partition.precision import profile_compute_dtype
from atomc.units import DTYPE_BYTES


class Outcome:
    """What one C gives: a feasible plan, or the best relaxed plan, or nothing that fits.

    `relax` gives the plan and its utilisation: the best feasible plan of a feasible C, the
    best relaxed plan of an infeasible one. It runs only when result or utilisation is asked
    for, which choose_accum does for the C it keeps; `fits` (whether any plan meets memory,
    cheaper than the best relaxed plan) answers memory_ok when given. When a larger C turns out
    feasible, nobody asks (it proves this C fits).
    """

    def __init__(self, accum: int, feasible: bool, result: object | None = None,
                 utilisation: float = 0.0,
                 relax: Callable[[], tuple[object | None, float]] | None = None,
                 fits: Callable[[], bool] | None = None):
        self.accum = accum
        self.feasible = feasible
        self._relax = relax or (lambda: (result, utilisation))
        self._fits = fits

    @functools.cached_property
    def _relaxed(self) -> tuple[object | None, float]:
        return self._relax()

    @functools.cached_property
    def memory_ok(self) -> bool:
        """Some plan meets the memory constraints."""
        if self.feasible:
            return True
        if self._fits is not None:
            return self._fits()
        return self._relaxed[0] is not None

    @property
    def result(self) -> object | None:
        """SearchResult of tier 0 when feasible, else of the relaxed tier."""
        return self._relaxed[0]

    @property
    def utilisation(self) -> float:
        """Simulated, of `result`."""
        return self._relaxed[1]


@dataclass
class AccumChoice:
    outcome: Outcome | None  # None when no C tried fits in memory
    tried: dict[int, Outcome] = field(default_factory=dict)


def choose_accum(run: Callable[[int], Outcome], max_accum: int,
                 fixed: int | None = None) -> AccumChoice:
    tried: dict[int, Outcome] = {}

    def at(c: int) -> Outcome:
        if c not in tried:
            tried[c] = run(c)
        return tried[c]

    if fixed is not None:
        o = at(fixed)
        return AccumChoice(o if o.memory_ok else None, tried)

    # doubling: find a feasible C, or the first C that does not fit. Memory only gets harder
    # with C, so a feasible next C proves this one fits: ask it first, and run this C's
    # relaxed search only when it is not
    c, last_bad, feasible_at, no_memory_at = 1, 0, None, None
    while True:
        o = at(c)
        if o.feasible:
            feasible_at = c
            break
        nxt = min(2 * c, max_accum)
        if c < max_accum and at(nxt).feasible:
            last_bad, feasible_at = c, nxt
            break
        if not o.memory_ok:
            no_memory_at = c
            break
        last_bad = c
        if c >= max_accum:
            break
        c = nxt

    if feasible_at is None and no_memory_at is not None and last_bad:
        # between the last C that fits and the first that does not, one may still be feasible
        lo, hi = last_bad, no_memory_at
        while hi - lo > 1:
            mid = (lo + hi) // 2
            o = at(mid)
            if o.feasible:
                feasible_at, last_bad = mid, lo
                break
            if o.memory_ok:
                lo = mid
            else:
                hi = mid

    if feasible_at is not None:
        lo, hi = last_bad, feasible_at  # bisect for the smallest feasible C
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid).feasible:
                hi = mid
            else:
                lo = mid
        return AccumChoice(at(hi), tried)

    fitting = [o for o in tried.values()
               if (no_memory_at is None or o.accum < no_memory_at) and o.memory_ok]
    if not fitting:
        return AccumChoice(None, tried)
    best = max(fitting, key=lambda o: (round(o.utilisation, 9), -o.accum))
    return AccumChoice(best, tried)


def takes_tokens(profile: Profile) -> bool:
    """Whether the model's first integer input is token ids (tokens_per_microbatch counts
    them); a model of floating inputs counts samples."""
    return any(node.op == "placeholder" and node.outputs
               and node.outputs[0].dtype.startswith(("int", "uint"))
               for node in profile.graph.nodes)


def tokens_per_microbatch(profile: Profile) -> int:
    """Tokens in one micro-batch: the first integer input's elements (batch x sequence)."""
    for node in profile.graph.nodes:
        if (node.op == "placeholder" and node.outputs
                and node.outputs[0].dtype.startswith(("int", "uint"))):
            return max(math.prod(node.outputs[0].shape), 1)
    seq = profile.graph.options.get("seq_len", 1)
    return max(profile.graph.batch_size * seq, 1)


def achieved_flops_per_s(profile: Profile) -> float:
    """F: the hardware profile's peak for the compute dtype times its efficiency, else measured."""
    hw = profile.hardware
    if hw is not None:
        dtype = profile_compute_dtype(profile)
        peak = hw.peak_tflops.get(dtype) or max(hw.peak_tflops.values(), default=0.0)
        if peak:
            return peak * 1e12 * hw.compute_efficiency
    flops = sum(c.fwd_flops for c in profile.costs)
    ms = sum(c.fwd_ms for c in profile.costs)
    return flops / (ms / 1e3) if ms > 0 else 0.0


def physical_bound_accum(profile: Profile) -> float:
    """C such that C*T = bytes_per_param * F / (2 * B): forward hides a block's load
    (docs/design.md, section "Partition: Algorithm 1, exact").

    Per transformer block a micro-batch of T tokens costs about 24*T*d^2 FLOPs forward and the
    block's 12*d^2 parameters must be loaded, independent of d.
    """
    bytes_per_param = DTYPE_BYTES.get(profile.graph.dtype, 4)
    f = achieved_flops_per_s(profile)
    b = profile.h2d_gbps * 1e9
    t = tokens_per_microbatch(profile)
    if b <= 0 or f <= 0:
        return 0.0
    return bytes_per_param * f / (2 * b * t)
