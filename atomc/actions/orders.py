"""Schedule generators: (sub-models or stages, micro-batches) -> one step's list of actions.

`atom_order` is the swap runtime's step (ATOM Fig. 12; docs/design.md, section "Runtime: one
core for every way of training"); `gpipe` and `one_f_one_b` are one pipeline stage's step in
the layout runner (docs/design.md, section "Place: DT-FM layouts"); `swapped_stage_order` is a
layout stage's step when its sub-models are swapped. `pipedream` is a baseline that only the
simulator times (atomc.compare): asynchronous 1F1B over several steps, which no atomc runtime
executes (it would have to stash weight versions). The lists are in issue order: a runtime
executes them front to back, and the simulator times them in that order.
"""

from __future__ import annotations

from atomc.actions.action import Action, Run
from atomc.errors import UsageError

PIPELINE_ORDERS = ("gpipe", "1f1b")


def _check(num_micro: int, count: int, what: str, stage: int = 0) -> None:
    if count < 1 or num_micro < 1:
        raise ValueError(f"a schedule needs at least one {what} and one micro-batch "
                         f"(got {count} and {num_micro})")
    if not 0 <= stage < count:
        raise ValueError(f"stage {stage} is not one of the {count} stages")


def atom_order(num_submodels: int, num_micro: int, *, early_prefetch: bool = False) -> list[Action]:
    """One step of ATOM's swap schedule over k sub-models and C micro-batches.

    Sub-model i uses weight slot i % 2. The step opens with P_0's load: its weights changed in
    the previous step's update, though it is still in its slot. Each forward P_i (i < k-1)
    first prefetches P_{i+1} into the other slot; P_{k-1} runs forward and backward per
    micro-batch; P_{k-2} is still in its own slot for its backward, so it is not loaded
    again; each backward P_i (0 < i < k-1) prefetches P_{i-1}. Gradients leave (O) after a
    sub-model's last backward and the CPU updates them (U) while the backward goes on.
    With `early_prefetch` (k > 1 only), P_1's load for the next step ends this one, after its
    update, while P_0's update runs: the next step then opens with P_0's load alone.
    """
    order = atom_runs(num_submodels, num_micro, early_prefetch=early_prefetch)
    return [Action(kind, i, m) for kind, i, micros in order for m in (micros or (None,))]


def atom_runs(num_submodels: int, num_micro: int, *, early_prefetch: bool = False) -> list[Run]:
    """`atom_order` as runs (atomc.actions.runs): O(k + C) items for its O(k C) actions, so
    that the partitioner's simulation of a plan does not build the whole list."""
    _check(num_micro, num_submodels, "sub-model")
    k, micro = num_submodels, range(num_micro)
    early = early_prefetch and k > 1
    out: list[Run] = [("L", 0, None)]
    for i in range(k - 1):
        if not (early and i == 0):
            out.append(("L", i + 1, None))
        out.append(("F", i, micro))
    last = k - 1
    for m in micro:
        out += [("F", last, range(m, m + 1)), ("B", last, range(m, m + 1))]
    out += [("O", last, None), ("U", last, None)]
    for i in range(k - 2, -1, -1):
        if i > 0:
            out.append(("L", i - 1, None))
        out += [("B", i, micro), ("O", i, None), ("U", i, None)]
    if early:
        out.append(("L", 1, None))
    return out


def _with_wires(order: list[tuple[str, int]], stage: int, num_stages: int) -> list[Action]:
    """F and B with their messages: values come in before F and go on after it; gradients
    come back before B and go back after it. The first stage reads the batch and the last
    computes the loss, so neither talks past the ends of the pipeline."""
    first, last = stage == 0, stage == num_stages - 1
    out = []
    for kind, m in order:
        before, after = (not first, not last) if kind == "F" else (not last, not first)
        if before:
            out.append(Action("R", stage, m))
        out.append(Action(kind, stage, m))
        if after:
            out.append(Action("S", stage, m))
    return out


def gpipe(num_micro: int, stage: int, num_stages: int) -> list[Action]:
    """GPipe (Huang et al. 2019): every forward, then every backward."""
    _check(num_micro, num_stages, "stage", stage)
    order = [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
    return _with_wires(order, stage, num_stages)


def one_f_one_b(num_micro: int, stage: int, num_stages: int) -> list[Action]:
    """1F1B with a flush (PipeDream-flush, Narayanan et al. 2021): stage j runs D_PP - j - 1
    warm-up forwards, then alternates one forward and one backward, then drains backwards.
    At most D_PP - j micro-batches are in flight on stage j instead of GPipe's M."""
    _check(num_micro, num_stages, "stage", stage)
    return _with_wires(_one_f_one_b_items(num_micro, stage, num_stages), stage, num_stages)


def _one_f_one_b_items(num_micro: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    warm = min(num_stages - stage - 1, num_micro)
    order = [("F", m) for m in range(warm)]
    for m in range(num_micro - warm):
        order += [("F", warm + m), ("B", m)]
    return order + [("B", m) for m in range(num_micro - warm, num_micro)]


def pipedream(num_micro: int, stage: int, num_stages: int, num_steps: int) -> list[Action]:
    """PipeDream (Narayanan et al., SOSP 2019): asynchronous 1F1B over `num_steps` steps of
    `num_micro` micro-batches each, numbered on across the steps (step s holds s x num_micro
    to (s + 1) x num_micro - 1). Stage j runs D_PP - j - 1 warm-up forwards once, then one
    forward and one backward in turn across the step boundaries, with no flush between steps,
    and drains only at the end. Each backward is followed by the stage's weight update (U):
    PipeDream updates after every mini-batch, a micro-batch here, and stashes the weight
    version each in-flight micro-batch's forward used for its backward, so stage j holds up to
    D_PP - j versions and D_PP - j micro-batches' activations. The update comes after the
    backward's gradients have gone back. A step ends on a stage at the U after its last
    micro-batch's backward, the one numbered (s + 1) x num_micro - 1 for step s."""
    _check(num_micro, num_stages, "stage", stage)
    if num_steps < 1:
        raise ValueError(f"a PipeDream order needs at least one step (got {num_steps})")
    out = []
    for kind, m in _one_f_one_b_items(num_micro * num_steps, stage, num_stages):
        # the update after the gradients have gone back
        out += _with_wires([(kind, m)], stage, num_stages)
        if kind == "B":
            out.append(Action("U", stage))
    return out


def pipeline_order(name: str, num_micro: int, stage: int, num_stages: int) -> list[Action]:
    """Stage `stage`'s step of the pipeline schedule `name` ("gpipe" or "1f1b")."""
    if name == "gpipe":
        return gpipe(num_micro, stage, num_stages)
    if name == "1f1b":
        return one_f_one_b(num_micro, stage, num_stages)
    raise UsageError(f"pipeline schedule {name!r} is unknown; choose one of "
                     f"{', '.join(PIPELINE_ORDERS)}")


def max_in_flight(actions: list[Action]) -> int:
    """Micro-batches whose forward ran and backward did not yet: activations held at once."""
    live = peak = 0
    for a in actions:
        if a.kind in ("F", "B"):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
    return peak


def swapped_stage_order(k: int, num_micro: int, stage: int,
                        holds_output: bool) -> list[Action]:
    """A swapped stage's step: receive every micro-batch, run ATOM's forward over the stage's k
    sub-models, send, then the same for the gradients in reverse. The stage's last sub-model
    is the loss's (forward and backward per micro-batch) only when it holds the output.

    An L for every load the swap executor makes, as in `atom_order`: sub-model i uses slot
    i % 2, the previous step's updates changed every sub-model, so each is loaded before its
    first forward (P_0 too, with k = 1); the last two are still in their slots for their
    backward, and every other one is loaded again while the one after it runs its backward."""
    M = range(num_micro)
    first = stage == 0
    order = [] if first else [Action("R", stage, m) for m in M]
    order.append(Action("L", 0))
    top = k - 1 if holds_output else k
    for i in range(top):
        if i + 1 < k:
            order.append(Action("L", i + 1))
        order += [Action("F", i, m) for m in M]
    if holds_output:
        for m in M:
            order += [Action("F", k - 1, m), Action("B", k - 1, m)]
        order.append(Action("O", k - 1))
    else:
        order += [Action("S", stage, m) for m in M]
        order += [Action("R", stage, m) for m in M]
    for i in range(top - 1 if holds_output else k - 1, -1, -1):
        if 0 < i < k - 1:  # P_{i-1} is in the slot P_{i+1} took over
            order.append(Action("L", i - 1))
        order += [Action("B", i, m) for m in M]
        order.append(Action("O", i))
    if not first:
        order += [Action("S", stage, m) for m in M]
    return order
