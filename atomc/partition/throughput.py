"""The accumulation degree C chosen for tokens a second (part of partition: Profile -> Plan).

A larger C computes more micro-batches per load of each sub-model, so the loads, the gradient
offloads and the CPU update (whose cost is per step, not per micro-batch) weigh less per token;
it also keeps C micro-batches of boundary activations on the GPU, so memory runs out at some C.
The smallest feasible C (choose_accum) is where overlap first holds, not where a step trains
the most tokens a second: a plan whose CPU update binds runs half idle there, and more GPU
memory could give a slower plan.

`sweep_accum` weighs C from the smallest feasible one upwards on a ladder (each about a quarter
more than the one before) to the first that no plan fits, `--max-accum`, or the global batch
bound: at each, the cuts of the plan found so far costed again at that C (one simulation), or,
when their memory no longer fits, the first plan a search finds there. It stops once three
degrees in a row gain less than 1% over the best. The best C is searched in full (its best
plan over the caps) where that predicts at least what the sweep costed for it. partition then
gives every candidate its activation policy and keeps the one of the most tokens a second:
the chosen C predicts at least the tokens a second of every other C the sweep reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atomc.errors import UsageError
from atomc.simulate import Simulation

# a C counts as a gain only when it beats the best so far by this much; so many in a row
# without one end the sweep
GAIN = 1.01
PATIENCE = 3


@dataclass(frozen=True)
class Candidate:
    """A plan at one C: its cuts, how its step boundary hands over, and its simulation."""

    accum: int
    cuts: tuple[int, ...]
    early_prefetch: bool
    sim: Simulation
    feasible: bool
    searched: bool
    tier: int = 0  # the search tier whose constraints it meets (0: all)
    result: object = None  # the search's result, when `searched`

    def tokens_per_s(self, tokens_per_micro: int) -> float:
        return self.accum * tokens_per_micro * 1e9 / self.sim.step_ns if self.sim.step_ns else 0.0


def ladder(start: int, stop: int) -> list[int]:
    """C from `start` to `stop`, each about a quarter more than the one before."""
    out = [start]
    while out[-1] < stop:
        out.append(min(stop, out[-1] + max(1, out[-1] // 4)))
    return out


def parse_global_batch(value: str | None, micro_batch: int, tokens_per_micro: int,
                       takes_tokens: bool) -> int | None:
    """`--max-global-batch` (samples, or tokens with a `tokens` suffix: 512, 1M-tokens,
    65536tokens) -> the largest C it allows (None: no bound). Refused in one line when it is
    not a positive count or is below one micro-batch."""
    if value is None:
        return None
    text = value.strip().lower().replace("_", "")
    unit = "samples"
    for suffix in ("-tokens", "tokens", "tok"):
        if text.endswith(suffix):
            text, unit = text[: -len(suffix)].strip(), "tokens"
            break
    scale = 1
    if text[-1:] in ("k", "m", "g"):
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[text[-1]]
        text = text[:-1]
    try:
        count = int(float(text) * scale)
    except ValueError:
        count = 0
    if count <= 0:
        raise UsageError(f"--max-global-batch {value!r} is not a positive count; give samples "
                         f"(e.g. 64) or tokens (e.g. 512k-tokens)")
    if unit == "tokens" and not takes_tokens:
        raise UsageError(f"--max-global-batch {value!r} counts tokens, but the model takes no "
                         f"token ids; give samples (e.g. 64)")
    per_micro = tokens_per_micro if unit == "tokens" else micro_batch
    if count < per_micro:
        raise UsageError(f"--max-global-batch {value!r} is below one micro-batch ({per_micro} "
                         f"{unit}); give at least {per_micro} {unit}, or profile a smaller "
                         f"micro-batch")
    return count // per_micro


def sweep_accum(first: Candidate, evaluate: Callable[[int, Candidate], Candidate | None],
                best_at: Callable[[int], Candidate | None], stop: int,
                tokens_per_micro: int) -> list[Candidate]:
    """The candidates weighed from `first` (the smallest feasible C, or the best relaxed one)
    up the ladder to `stop`, by C; the one of the most tokens a second is its C's full search
    where that does as well. `evaluate(c, base)` gives a plan at C costed from `base`'s cuts
    or found by a search, None when no plan fits; `best_at(c)` the best plan a full search
    finds at C (None: none)."""
    rate = {first.accum: first.tokens_per_s(tokens_per_micro)}
    candidates = {first.accum: first}
    best = first
    misses = 0
    for c in ladder(first.accum, stop)[1:]:
        found = evaluate(c, best)
        if found is None:
            break  # memory ran out: a larger C only holds more activations
        candidates[c] = found
        rate[c] = found.tokens_per_s(tokens_per_micro)
        if rate[c] > rate[best.accum] * GAIN:
            best, misses = found, 0
        else:
            best = found if rate[c] > rate[best.accum] else best
            misses += 1
            if misses >= PATIENCE:
                break
    if not best.searched:
        full = best_at(best.accum)
        if full is not None and full.tokens_per_s(tokens_per_micro) >= rate[best.accum]:
            candidates[best.accum] = full
    return [candidates[c] for c in sorted(candidates)]
