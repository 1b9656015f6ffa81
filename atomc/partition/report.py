"""Plan -> text: the table `atomc partition` and `atomc show` print."""

from __future__ import annotations

from atomc.ir import HostMemory, Plan, Submodel
from atomc.units import format_bytes, format_ms

DEFAULT_ROWS = 40


def _layers(s: Submodel) -> str:
    if not s.layers:
        return s.first_node if s.first_node == s.last_node else f"{s.first_node} .. {s.last_node}"
    if len(s.layers) == 1:
        return s.layers[0]
    return f"{s.layers[0]} .. {s.layers[-1]}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "~" + text[-(width - 1):]


def _signed_ms(ms: float) -> str:
    return format_ms(ms) if ms >= 0 else "-" + format_ms(-ms)


def summary(plan: Plan) -> str:
    name = plan.config or plan.model_path
    how = ("fixed" if plan.accum_fixed else
           f"the most tokens a second of {len(plan.sweep)} weighed: atomc show --sweep"
           if plan.sweep else "searched")
    lines = [
        f"plan      {name} ({plan.model_path}), micro-batch {plan.batch_size}, on {plan.device}",
        (f"memory    {format_bytes(plan.capacity_bytes)} GPU, "
         f"reserve {format_bytes(plan.reserve_bytes)}, activations {plan.activations}"),
        (f"dtypes    weights and gradients {plan.transfer_dtype or 'as the model'} on the GPU, "
         f"compute {'autocast ' + plan.autocast if plan.autocast else 'without autocast'}, "
         f"CPU AdamW {plan.cpu_adam_gbps:g} GB/s "
         f"({(plan.cpu_adam_source or 'given').split(':')[0]})"),
        f"accum     C={plan.accum} ({how}); physical bound C >= {plan.physical_bound_accum:.1f}",
        f"plan      {len(plan.submodels)} sub-models, {format_bytes(plan.cut_bytes)} crossing cuts "
        f"per micro-batch"
        + ("; sub-model 1 loads during sub-model 0's update" if plan.early_prefetch else ""),
        (f"predicted step {format_ms(plan.predicted_step_ms)}, "
         f"GPU busy {plan.predicted_utilisation:.1%}"
         + (f", {_rate(plan.tokens_per_step, plan.predicted_step_ms)} "
            f"({plan.tokens_per_step:,} a step)" if plan.tokens_per_step else "")
         + (f" (recomputing everything: {format_ms(plan.recompute_step_ms)})"
            if plan.recompute_step_ms is not None else "")),
    ]
    if plan.activations == "auto":
        lines.append(policy_line(plan))
    if plan.host is not None:
        lines.append(host_line(plan.host))
        if plan.host.disk is not None:
            lines.append(disk_line(plan))
    if plan.feasible:
        lines.append("status    every constraint met")
    else:
        lines.append(f"status    no plan meets every constraint up to this C; "
                     f"binding: {plan.binding}")
    return "\n".join(lines)


def _rate(tokens: float, step_ms: float) -> str:
    return f"{tokens / (step_ms / 1e3):,.0f} tokens/s" if step_ms else "- tokens/s"


def sweep_table(plan: Plan) -> str:
    """Per C weighed: the predicted step, tokens a second and what binds the step."""
    if not plan.sweep:
        return ("sweep     none: C was given (--accum) or the smallest feasible one asked for "
                "(--accum min)")
    per_c = plan.tokens_per_step // plan.accum if plan.accum else 0
    header = (f"{'C':>4} {'step':>11} {'tokens/s':>11} {'tokens/step':>12} {'GPU busy':>9}  "
              f"{'binding':<32} plan")
    lines = [header]
    for pt in plan.sweep:
        mark = "chosen" if pt.accum == plan.accum else ""
        how = ("searched" if pt.searched else "cuts of a smaller C") + (
            "" if pt.feasible else ", a constraint broken")
        lines.append(f"{pt.accum:>4} {format_ms(pt.step_ms):>11} {pt.tokens_per_s:>11,.0f} "
                     f"{pt.accum * per_c:>12,} {pt.gpu_busy:>9.1%}  {pt.binding:<32} "
                     f"{how}{'  <- ' + mark if mark else ''}")
    return "\n".join(lines)


def policy_line(plan: Plan) -> str:
    """What activations="auto" stores: bytes kept on the GPU, sent to the host, and the
    recomputation left (C micro-batches)."""
    c = plan.accum
    subs = plan.submodels[:-1]
    kept = c * sum(s.kept_bytes for s in subs)
    sent = c * sum(s.sent_bytes for s in subs)
    saved = c * sum(s.recompute_saved_ms for s in subs)
    left = c * sum(s.fwd_ms for s in subs) - saved
    return (f"policy    {sum(len(s.kept) for s in subs)} operators' outputs kept "
            f"({format_bytes(kept)}), {sum(len(s.sent) for s in subs)} sent to host "
            f"({format_bytes(sent)}); recomputation {format_ms(left)} per step, "
            f"{format_ms(saved)} skipped")


def host_line(host: HostMemory) -> str:
    from atomc.partition.hostmem import describe

    checked = (f"fits {format_bytes(host.limit_bytes)} ({host.limit_source})" if host.limit_bytes
               else host.limit_source)
    frozen = (f"; {host.frozen_params / 1e6:.1f}M frozen weights: no gradient buffer, moments "
              f"or update" if host.frozen_params else "")
    return (f"host      {describe(host.by_kind)}, moments {host.optimizer_states}{frozen}; "
            f"{checked}")


def disk_line(plan: Plan) -> str:
    """What the disk tier holds, by kind, on which drives, and how busy their lane is."""
    from atomc.simulate import simulate_plan

    host = plan.host
    assert host is not None and host.disk is not None
    d = host.disk
    kinds = " + ".join(f"{format_bytes(n)} {kind}" for kind, n in host.disk_by_kind.items())
    on = sum(1 for k in host.disk_kinds if k)
    sim = simulate_plan(plan)
    busy = sim.timeline.busy_ms("disk", 0) / (sim.step_ns / 1e6) if sim.step_ns else 0.0
    room = f" of {format_bytes(d.drives * d.capacity_bytes)}" if d.capacity_bytes else ""
    return (f"disk      {format_bytes(sum(host.disk_by_kind.values()))} ({kinds}) of {on} "
            f"sub-models on {d.drives} drive(s), {format_bytes(host.disk_need_bytes)} free "
            f"needed{room}; {d.read_gbps:g}/{d.write_gbps:g} GB/s read/write each "
            f"({d.source.split(';')[0]}); disk lane busy {busy:.1%} of the step")


def submodel_table(plan: Plan, max_rows: int | None = DEFAULT_ROWS) -> str:
    c = plan.accum
    head = (f"{'#':>4} {'nodes':>11}  {'layers':<34} {'params':>10} {'peak':>10} "
            f"{'fwd x C':>9} {'bwd x C':>9} {'load':>9} {'slack fwd':>10} {'slack bwd':>10} "
            f"{'slack mem':>10}"
            + (f" {'kept':>10} {'sent':>10} {'recomp.':>9}" if plan.activations == "auto" else ""))
    rows = [head, "-" * len(head)]
    subs = list(plan.submodels)
    shown = subs
    hidden = 0
    if max_rows is not None and len(subs) > max_rows:
        half = max_rows // 2
        shown = subs[:half] + subs[-half:]
        hidden = len(subs) - 2 * half
    for k, s in enumerate(shown):
        if hidden and k == max_rows // 2:
            rows.append(f"{'':>4} ... {hidden} more sub-models (--all shows them)")
        rows.append(
            f"{s.index:>4} {f'{s.start}-{s.stop - 1}':>11}  {_clip(_layers(s), 34):<34} "
            f"{format_bytes(s.param_bytes):>10} {format_bytes(s.peak_bytes):>10} "
            f"{format_ms(c * s.fwd_ms):>9} {format_ms(c * s.bwd_ms):>9} {format_ms(s.load_ms):>9} "
            f"{_signed_ms(s.slack_fwd_ms):>10} {_signed_ms(s.slack_bwd_ms):>10} "
            f"{format_bytes(s.slack_memory_bytes):>10}"
            + (f" {format_bytes(c * s.kept_bytes):>10} {format_bytes(c * s.sent_bytes):>10} "
               f"{format_ms(c * (s.fwd_ms - s.recompute_saved_ms)):>9}"
               if plan.activations == "auto" else ""))
    return "\n".join(rows)


def cut_table(plan: Plan, max_rows: int | None = DEFAULT_ROWS) -> str:
    """Which values cross each cut, and their bytes (one micro-batch)."""
    rows = ["cuts (values crossing, one micro-batch)"]
    cuts = list(plan.submodels[:-1])
    if max_rows is not None and len(cuts) > max_rows:
        cuts = cuts[: max_rows // 2] + [None] + cuts[-(max_rows // 2):]  # type: ignore[list-item]
    for s in cuts:
        if s is None:
            rows.append("  ...")
            continue
        names = ", ".join(t.name for t in s.crossing)
        total = sum(t.num_bytes for t in s.crossing)
        rows.append(f"  after {s.index:>4} (node {s.stop}): {format_bytes(total):>10}  {names}")
    return "\n".join(rows)


def render_plan(plan: Plan, max_rows: int | None = DEFAULT_ROWS) -> str:
    parts = [summary(plan), "", submodel_table(plan, max_rows)]
    if len(plan.submodels) > 1:
        parts += ["", cut_table(plan, max_rows)]
    if plan.notes:
        parts += ["", *("note      " + n for n in plan.notes)]
    return "\n".join(parts)
