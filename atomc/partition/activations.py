"""Partition stage, activation policy: which heavy operators' outputs each sub-model keeps on the
device or sends to host memory between its forward and its backward, so that its
recomputation skips them (activations="auto"; the runtime side is atomc.runtime.opcache).

Candidates are the operators with forward FLOPs (matmuls, convolutions, attention): each
saves its forward time from the recomputation of every micro-batch and costs its output bytes.
Element-wise operators are always recomputed (cheaper to redo than to move or hold).

A greedy pass over all sub-models' candidates, the most recompute time saved per byte first,
each candidate kept or sent where the rules allow (the pass runs twice, trying keep first and
send first, and the simulator picks the faster):
- **keep** when the bytes fit: kept outputs of sub-model i stay on the device from its forward
  to its backward, through the forward and backward of every later sub-model, so C times the
  bytes must fit the memory slack of i and of every sub-model after it;
- **send** when: C times the bytes fit sub-model i's memory slack (they come back for its
  backward), their copy to the host fits in the next sub-model's forward (the device-to-host
  link is otherwise idle then), their copy back fits the slack of the next sub-model's
  backward (under which sub-model i's load and checkpoints already stream), and the host has
  room for them;
- either way the time saved may not shorten sub-model i's backward below what must hide under
  it (the slack of its backward: the previous sub-model's load and checkpoints, the next
  one's gradient offload and CPU update).

Within those rules, the pass is the greedy approximation of a knapsack with several resources
(memory at each sub-model, backward slack, the link both ways, host room): it takes candidates
in the order of saving per byte and skips one that does not fit. It has no proven bound; on
small graphs tests compare it with an exhaustive search over every keep/send/recompute
assignment (the better of the two passes saved 0.999-1.0 of the optimum there; keep-first
alone 0.57 on the loosest instance). The result is re-simulated; where it does
not beat recomputing everything, the plan recomputes everything.
"""

from __future__ import annotations

import dataclasses

from atomc.ir import Plan, Profile, Submodel
from atomc.partition.check import Checker
from atomc.partition.precision import Precision, device_view, model_dtype
from atomc.partition.tables import node_sides_ms
from atomc.simulate.plan import simulate_plan
from atomc.units import format_bytes


@dataclasses.dataclass
class _Candidate:
    submodel: int
    node: str
    saving_ms: float  # recomputation skipped for one micro-batch
    nbytes: int  # its outputs, one micro-batch


def candidates(view: Profile, sub: Submodel) -> list[_Candidate]:
    """The heavy operators of one sub-model's range, with what storing them saves and costs."""
    out = []
    for j in range(sub.start, sub.stop):
        c = view.costs[j]
        node = view.graph.nodes[j]
        if c.fwd_flops <= 0 or c.output_bytes <= 0 or node.op in ("placeholder", "output"):
            continue
        out.append(_Candidate(sub.index, node.name, node_sides_ms(c)[0], c.output_bytes))
    return out


def choose_policy(plan: Plan, profile: Profile, host_room_bytes: int | None = None,
                  view: Profile | None = None) -> Plan:
    """`plan` (cut for recomputed activations, from `profile`) with each sub-model's kept and
    sent operators, its times and slacks adjusted, re-simulated; `plan` with activations
    "auto" and nothing stored when that is no faster. `host_room_bytes`: host memory free
    beyond the plan's own (None: not checked); `view`: the profile at the plan's dtypes, when
    the caller has it (device_view)."""
    subs = list(plan.submodels)
    c = plan.accum
    if len(subs) < 2 or plan.activations == "keep":
        return plan
    view = view or _view(profile, plan)
    h2d, d2h = profile.h2d_gbps, profile.d2h_gbps
    pool = [cand for s in subs[:-1] for cand in candidates(view, s)]
    pool.sort(key=lambda x: (-x.saving_ms / x.nbytes, x.submodel, x.node))
    # the independent checker's constraints, on its own costs of these cuts
    checker = Checker(view, c, plan.capacity_bytes - plan.reserve_bytes, "recompute",
                      plan.cpu_adam_gbps)
    facts = [checker.range_facts(s.start, s.stop) for s in subs]
    known = {(v.submodel, v.constraint) for v in checker.check_facts(facts, plan.early_prefetch)}
    best = None
    # keeping first spends memory every later sub-model needs, sending first spends the link:
    # the pass runs both ways and the simulator picks
    for prefer in ("ks", "sk"):
        kept, sent = _assign(pool, subs, c, h2d, d2h, host_room_bytes, prefer)
        # the rules above are the binding ones; the independent checker has the rest (the
        # step-boundary handover): a sub-model it finds broken stores nothing, nor does the
        # one before it send into its backward
        for _ in subs:
            auto = _stored(plan, kept, sent, h2d, d2h)
            broken = {v.submodel for v in checker.check_facts(
                          checker.with_policy(facts, auto.submodels), plan.early_prefetch)
                      if (v.submodel, v.constraint) not in known and v.submodel >= 0}
            if not broken:
                break
            for i in broken:
                kept[i], sent[i] = [], []
                if i > 0:
                    sent[i - 1] = []
        if not any(kept) and not any(sent):
            continue
        sim = simulate_plan(auto)
        if best is None or sim.step_ns < best[1].step_ns:
            best = (auto, sim)
    if best is None:
        return _recomputing(plan, "nothing fits the memory and link slack")
    auto, sim = best
    if sim.step_ns / 1e6 >= plan.predicted_step_ms:
        return _recomputing(plan, "keeping or sending outputs would not shorten the step")
    return _finish(plan, auto, sim)


def apply_policy(plan: Plan, profile: Profile, like: Plan) -> Plan:
    """`plan` (cut for recomputed activations) storing the operators `like` (an auto plan of
    the same cuts) stores, costed on `profile`: what that policy takes there (atomc.partition
    .recost: a calibrated profile)."""
    view = _view(profile, plan)
    by_name = {x.node: x for s in plan.submodels for x in candidates(view, s)}
    kept = [[by_name[n] for n in s.kept if n in by_name] for s in like.submodels]
    sent = [[by_name[n] for n in s.sent if n in by_name] for s in like.submodels]
    if not any(kept) and not any(sent):
        return dataclasses.replace(plan, activations="auto",
                                   recompute_step_ms=plan.predicted_step_ms)
    auto = _stored(plan, kept, sent, profile.h2d_gbps, profile.d2h_gbps)
    return _finish(plan, auto, simulate_plan(auto))


def _view(profile: Profile, plan: Plan) -> Profile:
    return device_view(profile, Precision(plan.transfer_dtype or model_dtype(profile.graph),
                                          plan.autocast))


def _stored(plan: Plan, kept: list[list[_Candidate]], sent: list[list[_Candidate]],
            h2d: float, d2h: float) -> Plan:
    subs = list(plan.submodels)
    return _restep(dataclasses.replace(
        plan, activations="auto",
        submodels=tuple(_with_policy(s, kept[s.index], sent[s.index], plan.accum, h2d, d2h)
                        for s in subs)), subs)


def _finish(plan: Plan, auto: Plan, sim) -> Plan:
    c = plan.accum
    stored = sum(len(s.kept) + len(s.sent) for s in auto.submodels)
    kept_b = c * sum(s.kept_bytes for s in auto.submodels)
    sent_b = c * sum(s.sent_bytes for s in auto.submodels)
    note = (f"activations auto: {stored} operators' outputs stored ({format_bytes(kept_b)} kept "
            f"on the GPU, {format_bytes(sent_b)} sent to host memory, C micro-batches); step "
            f"{sim.step_ns / 1e6:.1f} ms vs {plan.predicted_step_ms:.1f} ms recomputing "
            f"everything")
    host = auto.host
    if host is not None and sent_b:
        by_kind = {**host.by_kind, "activations_sent": sent_b}
        host = dataclasses.replace(host, by_kind=by_kind)
    return dataclasses.replace(
        auto, predicted_step_ms=sim.step_ns / 1e6, predicted_utilisation=sim.utilisation,
        recompute_step_ms=plan.predicted_step_ms, host=host, notes=(*plan.notes, note))


def _assign(pool: list[_Candidate], subs: list[Submodel], c: int, h2d_gbps: float,
            d2h_gbps: float, host_room: int | None, prefer: str
            ) -> tuple[list[list[_Candidate]], list[list[_Candidate]]]:
    """One greedy pass over `pool` (best saving per byte first): each candidate kept or sent,
    in the order `prefer` tries them, where the rules of the module docstring allow."""
    k = len(subs)
    room_mem = [s.slack_memory_bytes for s in subs]
    # backward time each sub-model may lose, and the copy-back time the next one can hide
    room_bwd = [max(0.0, min(s.slack_bwd_ms, s.slack_optimizer_ms)) for s in subs]
    room_d2h = [c * subs[i + 1].fwd_ms - subs[i + 1].checkpoint_ms if i + 1 < k else 0.0
                for i in range(k)]
    kept: list[list[_Candidate]] = [[] for _ in subs]
    sent: list[list[_Candidate]] = [[] for _ in subs]
    for cand in pool:
        i, nbytes, saving = cand.submodel, c * cand.nbytes, c * cand.saving_ms
        if saving > room_bwd[i]:
            continue
        back_ms, out_ms = _ms(nbytes, h2d_gbps), _ms(nbytes, d2h_gbps)
        for how in prefer:
            if how == "k" and all(room_mem[j] >= nbytes for j in range(i, k)):
                for j in range(i, k):
                    room_mem[j] -= nbytes
                kept[i].append(cand)
            elif how == "s" and (room_mem[i] >= nbytes and back_ms <= room_bwd[i + 1]
                                 and out_ms <= room_d2h[i]
                                 and (host_room is None or host_room >= nbytes)):
                room_mem[i] -= nbytes
                room_bwd[i + 1] -= back_ms
                room_d2h[i] -= out_ms
                if host_room is not None:
                    host_room -= nbytes
                sent[i].append(cand)
            else:
                continue
            room_bwd[i] -= saving
            break
    return kept, sent


def _recomputing(plan: Plan, why: str) -> Plan:
    note = f"activations auto: every sub-model recomputes ({why})"
    return dataclasses.replace(plan, activations="auto", recompute_step_ms=plan.predicted_step_ms,
                               notes=(*plan.notes, note))


def _ms(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3 if gbps > 0 else 0.0


def _with_policy(s: Submodel, kept: list[_Candidate], sent: list[_Candidate], c: int,
                 h2d_gbps: float, d2h_gbps: float) -> Submodel:
    saved = float(sum(x.saving_ms for x in (*kept, *sent)))
    kept_bytes = sum(x.nbytes for x in kept)
    sent_bytes = sum(x.nbytes for x in sent)
    fetch = _ms(c * sent_bytes, h2d_gbps)
    return dataclasses.replace(
        s, kept=tuple(x.node for x in kept), sent=tuple(x.node for x in sent),
        kept_bytes=kept_bytes, sent_bytes=sent_bytes, recompute_saved_ms=saved,
        bwd_ms=s.bwd_ms - saved, checkpoint_ms=s.checkpoint_ms + fetch, fetch_ms=fetch,
        send_ms=_ms(c * sent_bytes, d2h_gbps), slack_bwd_ms=s.slack_bwd_ms - c * saved,
        slack_optimizer_ms=s.slack_optimizer_ms - c * saved)


def _restep(plan: Plan, before: list[Submodel]) -> Plan:
    """Memory and backward slacks after the policy: kept bytes occupy every later sub-model's
    memory, sent bytes come back under the next sub-model's backward."""
    c = plan.accum
    subs = list(plan.submodels)
    held = 0
    out = []
    for i, s in enumerate(subs):
        held += c * s.kept_bytes
        prev_fetch = subs[i - 1].fetch_ms if i else 0.0
        out.append(dataclasses.replace(
            s, slack_memory_bytes=before[i].slack_memory_bytes - held - c * s.sent_bytes,
            peak_bytes=before[i].peak_bytes + held + c * s.sent_bytes,
            slack_bwd_ms=s.slack_bwd_ms - prev_fetch))
    return dataclasses.replace(plan, submodels=tuple(out))
